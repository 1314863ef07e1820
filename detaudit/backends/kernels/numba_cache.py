"""Keeps numba's on-disk caches of the compiled CPU kernels true to the sources beside them.

numba checks a cached function against its own source file only (its modification time and size), but
a kernel's cached machine code also holds what it inlined from other modules: `cpu_team` runs
`cpu_loop`'s, `cpu_attention`'s and `cpu_rows`' kernels, `cpu_attention` inlines `cpu_lanes`'
intrinsics. Editing one of those in a checkout left the callers running the old code from the cache.
Here a digest of every kernel module's source is kept beside the caches, and when it changes the
caches of all of them are removed before any is loaded (numba then compiles afresh and caches again).
An installed wheel replaces every file together, so this matters in checkouts. Not covered: caches numba
keeps elsewhere (`NUMBA_CACHE_DIR`, or its user-wide folder where `__pycache__` cannot be written), and a
process that imported the old sources and saves a cache after another has refreshed (restart it). No
numba import here."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

STAMP = "detaudit-kernels.sha256"
COMPILED = ("cpu_lanes", "cpu_attention", "cpu_rows", "cpu_loop", "cpu_team")  # every module numba compiles


@functools.cache
def fresh() -> None:
    """`refresh` of this package's compiled modules, once a process: each of them calls it as it is
    imported, before numba loads any cache (at a kernel's first call)."""
    refresh(Path(__file__).parent, COMPILED)


def refresh(folder: Path, modules: tuple[str, ...]) -> bool:
    """Remove the numba caches (`__pycache__/<module>.*.nbi|nbc`) of `modules` in `folder` where the
    digest of their sources differs from the one recorded there, then record it. True when removed."""
    digest = hashlib.sha256()
    for name in modules:
        digest.update(name.encode() + b"\0" + (folder / f"{name}.py").read_bytes())
    cache = folder / "__pycache__"
    stamp = cache / STAMP
    want = digest.hexdigest()
    try:
        if stamp.read_text() == want:
            return False
    except OSError:
        pass
    try:
        for name in modules:
            for path in (*cache.glob(f"{name}.*.nbi"), *cache.glob(f"{name}.*.nbc")):
                path.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(want)
    except OSError:
        return False
    return True
