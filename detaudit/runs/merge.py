"""`detaudit merge`: combine run directories (shards of one grid, or runs on several machines).

Refuses runs that are not comparable (`Manifest.comparable()`: another model, suite, decoding
setting, dtype, limit or engine) or of another code version; and, unless allowed, other hardware
(then the merged manifest says so and the reports show it). Every cell is validated as `analyze`
validates it before it is copied; an invalid one is not recorded as done. The merge is built in a
temporary directory beside the output and renamed into place at the end: a failed merge leaves the
output path as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from detaudit.errors import DetauditError
from detaudit.runs.manifest import CellMeta, Manifest, numerics_conflicts, speculative_conflicts, widen_grid
from detaudit.runs.rundir import PROMPTS, RunDir, atomic_write_bytes, now, open_regular, umask


def _check_paths(paths: list[Path], output: Path) -> None:
    """Each input once, and the output outside every input (merging X into X/cells/sub would write
    into the run being read)."""
    seen: dict[Path, Path] = {}
    out = output.resolve()
    for path in paths:
        real = Path(path).resolve()
        if real in seen:
            raise DetauditError(f"{path} is given twice (as {seen[real]} and {path}): list each run directory once")
        seen[real] = Path(path)
        if out == real or real in out.parents:
            raise DetauditError(
                f"--output-path {output} lies inside the input run directory {path}: write it elsewhere"
            )


def _load(paths: list[Path]) -> list[RunDir]:
    if not paths:
        raise DetauditError("merge needs at least one run directory")
    runs = []
    for path in paths:
        run = RunDir(path)
        run.load()
        runs.append(run)
    first = runs[0].manifest
    assert first is not None
    for run in runs[1:]:
        m = run.manifest
        assert m is not None
        if m.comparable() != first.comparable():
            diff = ", ".join(first.differences(m)) or "sweep"
            raise DetauditError(f"cannot merge {run.path} into {runs[0].path}: different {diff}")
        if m.code_version != first.code_version:
            raise DetauditError(f"cannot merge {run.path}: detaudit {m.code_version} vs {first.code_version}")
        clash = speculative_conflicts(first.speculative, m.speculative)
        if clash:
            raise DetauditError(
                f"cannot merge {run.path} into {runs[0].path}: another draft model or n-gram lookup under the "
                f"same name ({'; '.join(clash)})"
            )
        clash = numerics_conflicts(first.backends, m.backends)
        if clash:
            raise DetauditError(
                f"cannot merge {run.path} into {runs[0].path}: their cells were computed with other "
                f"numerics (differing: {'; '.join(clash)})"
            )
    return runs


def _merged_manifest(runs: list[RunDir], hardware: list[str]) -> Manifest:
    first = runs[0].manifest
    assert first is not None
    cfg = dict(first.config)
    widen_grid(cfg, *(r.manifest.config for r in runs[1:]))  # type: ignore[union-attr]
    cfg.pop("shard", None)
    return Manifest(
        config=cfg,
        identity=dict(first.identity),
        cells={},
        model=first.model,
        suites=first.suites,
        environment=first.environment,
        hardware_key=first.hardware_key,
        command=first.command,
        code_version=first.code_version,
        git_hash=first.git_hash,
        backends={k: v for r in runs for k, v in r.manifest.backends.items()},  # type: ignore[union-attr]
        speculative={k: v for r in runs for k, v in r.manifest.speculative.items()},  # type: ignore[union-attr]
        executor=first.executor,
        created=now(),
        merged_from=[str(r.path) for r in runs],
        mixed_hardware=len(hardware) > 1,
        hardware_keys=hardware,
        extra={"merged": now(), "environments": [r.manifest.environment for r in runs], "duplicates": {}},  # type: ignore[union-attr]
    )


def _same_outputs(a: RunDir, b: RunDir, cid: str) -> bool:
    cols = ["cell_id", "output_token_ids"]
    return (
        a.read_table(cid, cols).column("output_token_ids").to_pylist()
        == b.read_table(cid, cols).column("output_token_ids").to_pylist()
    )


def merge_runs(inputs: list[Path], output: Path, allow_mixed_hardware: bool = False) -> Manifest:
    output = Path(output)
    _check_paths(inputs, output)
    runs = _load(inputs)
    hardware = sorted({r.manifest.hardware_key or "?" for r in runs})  # type: ignore[union-attr]
    if len(hardware) > 1 and not allow_mixed_hardware:
        raise DetauditError(
            f"runs come from different hardware ({' / '.join(hardware)}); "
            "pass --allow-mixed-hardware to merge them anyway"
        )
    if output.exists() and (not output.is_dir() or any(output.iterdir())):
        raise DetauditError(f"{output} already exists; merge into a new --output-path")
    merged = _merged_manifest(runs, hardware)
    try:
        output.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{output.name}.merging-", dir=output.parent))
        staging.chmod(0o777 & ~umask())  # mkdtemp's 0700 would make the merged run unreadable to others
    except OSError as e:
        raise DetauditError(f"cannot write {output}: {e.strerror}") from None
    try:
        out = RunDir(staging)
        out.manifest = merged
        sources: dict[str, RunDir] = {}
        with out.locked():
            for run in runs:
                _merge_cells(run, out, sources)
            prompts = next((r.path / PROMPTS for r in runs if (r.path / PROMPTS).is_file()), None)
            if prompts is not None:  # comparable runs sent the same prompts (their identity holds the hashes)
                with open_regular(prompts) as f:
                    atomic_write_bytes(staging / PROMPTS, f.read())
            out.save()
        os.unlink(staging / ".lock")
        if output.exists():
            output.rmdir()
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return merged


def _readable(run: RunDir, cid: str) -> bool:
    """Every column present and its rows its own: as analyze will read it."""
    try:
        run.read_table(cid)
        return True
    except DetauditError:
        return False


def _merge_cells(run: RunDir, out: RunDir, sources: dict[str, RunDir]) -> None:
    assert run.manifest is not None and out.manifest is not None
    dups = out.manifest.extra["duplicates"]
    for cid, meta in run.manifest.cells.items():
        valid = meta.state == "done" and run.cell_is_valid(cid, meta) and _readable(run, cid)
        have = out.manifest.cells.get(cid)
        if have is not None and have.state == "done":
            if valid:
                dups[cid] = (
                    "identical" if _same_outputs(run, sources[cid], cid) else f"differs in {run.path}; kept the first"
                )
            continue
        copy = CellMeta(**{**meta.__dict__, "extra": {**meta.extra, "source_run": str(run.path)}})
        if valid:
            out.write_cell_bytes(cid, run.read_bytes(cid))
            sources[cid] = run
        elif meta.state == "done":
            copy.update(state="pending", error=f"cell file in {run.path} is missing or corrupt; not merged")
        out.manifest.cells[cid] = copy
