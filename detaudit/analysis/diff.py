"""Compare two runs: did an upgrade (vLLM, driver, kernel, detaudit) change what a cell computes?

Cells are matched by id (suite, backend, TP, batch size[, speculative setting][, load]) among each run's
completed cells; a cell completed in one run only is listed as such. Two cells are equal when every
record holds the same bits in every numeric field (`records.NUMERIC_FIELDS`: output token ids,
chosen-token, top-k and teacher-forced log-probabilities, top-k ids, MoE routing), compared bit pattern
for bit pattern, never with a tolerance. For a cell that differs: its first difference (field, prompt,
position), the number of prompts whose outputs differ, the earliest position where outputs diverge, and
the published max probability divergence between the two cells. Where the manifests differ (what decides
the bits first: model, suites, decoding, dtype, engine; then the grid, the backends' descriptions, the
environment) is listed before the cells.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from detaudit.analysis.analyze import first_divergence, maxprob_divergence_by_position, top5_probs
from detaudit.errors import DetauditError
from detaudit.runs.manifest import Manifest
from detaudit.runs.records import RecordDifference, record_differences, records_by_key
from detaudit.runs.rundir import RunDir

# manifest sections compared, in the order they are listed: what decides a cell's bits first
SECTIONS = (
    "comparable",
    "config",
    "model",
    "speculative",
    "backends",
    "environment",
    "hardware_key",
    "code_version",
    "git_hash",
)


@dataclass
class CellDiff:
    cell: str
    status: str  # "equal", "differs", "only in A", "only in B"
    prompts: int = 0  # records compared (present in both)
    records_differ: int = 0  # records that differ in any numeric field (or are in one cell only)
    outputs_differ: int = 0  # common records whose output token ids differ
    first_divergence: int | None = None  # earliest output position where the tokens differ
    maxprob_div: float = math.nan  # mean over records of the mean over positions (published definition)
    first_difference: RecordDifference | None = None


@dataclass
class RunDiff:
    a: Path
    b: Path
    manifest: list[tuple[str, Any, Any]] = field(default_factory=list)  # (dotted field, in A, in B)
    cells: list[CellDiff] = field(default_factory=list)

    @property
    def compared(self) -> list[CellDiff]:
        return [c for c in self.cells if c.status in ("equal", "differs")]

    @property
    def equal(self) -> bool:
        """Every cell completed in both runs is bitwise equal."""
        return all(c.status == "equal" for c in self.compared)

    def to_dict(self) -> dict:
        return {
            "a": str(self.a),
            "b": str(self.b),
            "equal": self.equal,
            "manifest": [{"field": f, "a": a, "b": b} for f, a, b in self.manifest],
            "cells": [asdict(c) for c in self.cells],
        }


def _flat(value: Any, prefix: str) -> dict[str, Any]:
    """A nested mapping as {dotted key: leaf}; lists are leaves."""
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k in sorted(value, key=str):
            out.update(_flat(value[k], f"{prefix}.{k}"))
        return out
    return {prefix: value}


def manifest_differences(a: Manifest, b: Manifest) -> list[tuple[str, Any, Any]]:
    """Every manifest field whose value differs, as (dotted field, A, B); None where one run lacks it.
    Timestamps, the command line and the cells' own bookkeeping are left out; what the identity
    (`comparable`) holds is listed there and not again under `config`."""
    da, db = a.to_dict(), b.to_dict()
    identity = set(a.identity) | set(b.identity)
    out = []
    for section in SECTIONS:
        skip = identity if section == "config" else set()
        fa, fb = (
            {k: v for k, v in _flat(d.get(section), section).items() if k.partition(".")[2].split(".")[0] not in skip}
            for d in (da, db)
        )
        out += [(k, fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if _canon(fa.get(k)) != _canon(fb.get(k))]
    return out


def _canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def _done(run: RunDir, manifest: Manifest) -> list[str]:
    """Cells completed in a run whose file is there (a done cell without its file is not compared)."""
    return [cid for cid, m in manifest.cells.items() if m.state == "done" and run.cell_path(cid).exists()]


def compare_cells(cell: str, run_a: RunDir, run_b: RunDir) -> CellDiff:
    ta, tb = run_a.read_table(cell), run_b.read_table(cell)  # validated: columns, cell id, run identity
    keyed = []
    for run, table in ((run_a, ta), (run_b, tb)):
        try:
            keyed.append(records_by_key(table))
        except DetauditError as e:
            raise DetauditError(f"cell file {run.cell_path(cell)} is corrupt: {e}") from None
    rows_a, rows_b = keyed
    diffs = list(record_differences(ta, tb))
    common = [(rows_a[k], rows_b[k]) for k in rows_a if k in rows_b]
    ids_a, ids_b = ta.column("output_token_ids").to_pylist(), tb.column("output_token_ids").to_pylist()
    top_a, top_b = ta.column("topk_logprobs"), tb.column("topk_logprobs")
    divergences, maxprob = [], []
    for i, j in common:
        pos = first_divergence([ids_a[i] or [], ids_b[j] or []])
        if pos is not None:
            divergences.append(pos)
        n = min(len(ids_a[i] or []), len(ids_b[j] or []))
        probs = [top5_probs(top_a[i].as_py())[:n], top5_probs(top_b[j].as_py())[:n]]
        by_pos = maxprob_divergence_by_position(probs)
        if by_pos.size:
            maxprob.append(float(by_pos.mean()))
    return CellDiff(
        cell=cell,
        status="differs" if diffs else "equal",
        prompts=len(common),
        records_differ=len(diffs),
        outputs_differ=len(divergences),
        first_divergence=min(divergences) if divergences else None,
        maxprob_div=float(np.mean(maxprob)) if maxprob else math.nan,
        first_difference=diffs[0] if diffs else None,
    )


def diff_runs(a: str | os.PathLike, b: str | os.PathLike) -> RunDiff:
    """Compare two run directories (bad input, e.g. not a run or a corrupt manifest or cell file:
    DetauditError)."""
    run_a, run_b = RunDir(a), RunDir(b)
    man_a, man_b = run_a.load(), run_b.load()
    done_a, done_b = _done(run_a, man_a), _done(run_b, man_b)
    if not set(done_a) & set(done_b):
        raise DetauditError(f"{a} and {b} have no completed cell in common: nothing to compare")
    result = RunDiff(Path(a), Path(b), manifest_differences(man_a, man_b))
    for cell in done_a + [c for c in done_b if c not in done_a]:
        if cell not in done_b:
            result.cells.append(CellDiff(cell, "only in A"))
        elif cell not in done_a:
            result.cells.append(CellDiff(cell, "only in B"))
        else:
            result.cells.append(compare_cells(cell, run_a, run_b))
    return result
