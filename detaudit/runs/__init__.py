"""Run directories: the record schema, the typed manifest, the run directory itself, merging runs,
and the environment fingerprint."""
