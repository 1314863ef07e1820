"""`detaudit merge`: combine run directories (shards of one grid, or runs on several machines).

Refuses runs that are not comparable: another model, suite, decoding setting, dtype, limit, engine or
code version; and, unless allowed, other hardware (then the merged manifest says so and the reports
show it)."""

from __future__ import annotations

import shutil
from pathlib import Path

from detaudit.errors import DetauditError
from detaudit.store import RunDir, now


def merge_runs(inputs: list[Path], output: Path, allow_mixed_hardware: bool = False) -> dict:
    if len(inputs) < 1:
        raise DetauditError("merge needs at least one run directory")
    runs = []
    for path in inputs:
        run = RunDir(path)
        if not run.path.is_dir():
            raise DetauditError(f"run directory {path} does not exist")
        run.load()
        runs.append(run)
    first = runs[0].manifest
    for run in runs[1:]:
        m = run.manifest
        if m.get("comparable_key") != first.get("comparable_key"):
            diff = [k for k in sorted(set(first.get("comparable", {})) | set(m.get("comparable", {})))
                    if first.get("comparable", {}).get(k) != m.get("comparable", {}).get(k)]
            raise DetauditError(f"cannot merge {run.path} into {runs[0].path}: different {', '.join(diff) or 'sweep'}")
        if m.get("code_version") != first.get("code_version"):
            raise DetauditError(f"cannot merge {run.path}: detaudit {m.get('code_version')} vs {first.get('code_version')}")
    hardware = sorted({r.manifest.get("hardware_key", "?") for r in runs})
    if len(hardware) > 1 and not allow_mixed_hardware:
        raise DetauditError(f"runs come from different hardware ({' / '.join(hardware)}); "
                            "pass --allow-mixed-hardware to merge them anyway")
    out = RunDir(output)
    if out.exists():
        raise DetauditError(f"{output} already holds a run; merge into a new --output-path")
    merged = {k: v for k, v in first.items() if k not in ("cells", "updated")}
    merged.update(cells={}, merged_from=[str(r.path) for r in runs], merged=now(),
                  mixed_hardware=len(hardware) > 1, hardware_keys=hardware,
                  environments=[r.manifest.get("environment") for r in runs], duplicates={})
    cfg = dict(merged["config"])
    for key in ("backends", "tp", "batch_sizes"):
        values = []
        for r in runs:
            values += [v for v in r.manifest["config"][key] if v not in values]
        cfg[key] = values
    cfg.pop("shard", None)
    merged["config"] = cfg
    with out.locked():
        for run in runs:
            for cid, meta in run.manifest["cells"].items():
                done = meta.get("state") == "done" and run.cell_is_valid(cid, meta)
                have = merged["cells"].get(cid)
                if have is not None and have.get("state") == "done":
                    if done:
                        same = run.cell_path(cid).read_bytes() == out.cell_path(cid).read_bytes() or \
                            run.read_cell(cid)["output_token_ids"].map(list).tolist() == out.read_cell(cid)["output_token_ids"].map(list).tolist()
                        merged["duplicates"][cid] = "identical" if same else f"differs in {run.path}; kept the first"
                    continue
                merged["cells"][cid] = {**meta, "source_run": str(run.path)}
                if done:
                    shutil.copyfile(run.cell_path(cid), out.cell_path(cid))
        out.manifest = merged
        out.save()
    return merged
