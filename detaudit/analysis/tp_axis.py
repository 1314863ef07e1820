"""The batch-size and TP axes of a run: which of the two moved a backend's records.

The summary's `bitwise_diff_records` pools a backend's cells against one reference, so a difference says
that some configuration changed the records, not whether the batch size or the TP size did. The question
users ask of a mode (vLLM's batch invariance: is it batch-invariant within TP 2, and does it hold across TP
sizes?) needs the two apart. Per (suite, backend), over its plain done cells (speculative decoding off,
one configuration each; a server audit's axes are its loads, `load_axis`, so it has no rows here):

- a `batch` row per TP size t with two or more done batch sizes: the cells at TP t, each against the one of
  the smallest done batch size (batch invariance at TP t);
- a `TP` row per batch size b with two or more done TP sizes: the cells at batch b, each against the one of
  the smallest done TP size (TP invariance at batch b).

Columns: `cells`; `compared`: the records compared, over each cell's pair with the reference (the prompts
either holds); `records_differ`: those not bitwise equal in every recorded number (`records.NUMERIC_FIELDS`,
as `bitwise_diff_records`; a record one cell lacks counts); `outputs_differ`: those whose output token ids
differ; `unique_mean`: per prompt, the distinct outputs across the row's cells, mean over prompts (1: the
axis changed no output); `first_diff`: the first difference in words (cell, field, prompt, position).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from detaudit.analysis.analyze import Analysis, unique_count
from detaudit.analysis.load_axis import is_server_run
from detaudit.config import plain_cell_id
from detaudit.runs.records import record_differences

AXIS_COLUMNS = [
    "suite",
    "backend",
    "axis",
    "fixed",
    "varied",
    "cells",
    "compared",
    "records_differ",
    "outputs_differ",
    "unique_mean",
    "first_diff",
]


def _plain_cells(analysis: Analysis) -> pd.DataFrame:
    """The done cells that are one configuration each (a cell with repeats is several: `cell#rN`), with
    speculation off; none for a server audit."""
    if is_server_run(analysis.manifest):
        return analysis.per_cell.iloc[:0]
    pc = analysis.per_cell
    tables = analysis.tables or {}
    keep = [c in tables and plain_cell_id(c) == c for c in pc["cell_id"]]  # (`tables`: the done cells')
    return pc[keep]


def _outputs(analysis: Analysis) -> dict[str, dict[str, object]]:
    """cell -> prompt key -> output token ids, of the done cells' records."""
    rec = analysis.records
    out: dict[str, dict[str, object]] = {}
    for cid, pid, pidx, toks in zip(rec["cell_id"], rec["prompt_id"], rec["prompt_index"], rec["output_token_ids"]):
        out.setdefault(cid, {})[str(pid) if isinstance(pid, str) else f"#{pidx}"] = toks
    return out


def _row(analysis: Analysis, outputs: dict, key: tuple, cells: pd.DataFrame, by: str) -> dict:
    suite, backend, axis, fixed = key
    cells = cells.sort_values(by, kind="stable")
    ids = list(cells["cell_id"])
    tables = analysis.tables or {}
    ref = ids[0]
    differ = tokens = compared = 0
    first = ""
    for other in ids[1:]:
        diffs = list(record_differences(tables[ref], tables[other]))
        differ += len(diffs)
        tokens += sum(1 for _ in record_differences(tables[ref], tables[other], ("output_token_ids",)))
        compared += len(outputs.get(ref, {}).keys() | outputs.get(other, {}).keys())
        if diffs and not first:
            first = f"{other} differs from {ref}: {diffs[0]}"
    by_prompt: dict[str, list] = {}
    for cid in ids:
        for k, toks in outputs.get(cid, {}).items():
            by_prompt.setdefault(k, []).append(toks)
    uniques = [unique_count(seqs) for seqs in by_prompt.values()]
    return dict(
        suite=suite,
        backend=backend,
        axis=axis,
        fixed=fixed,
        varied=", ".join(str(int(v)) for v in cells[by]),
        cells=len(ids),
        compared=compared,
        records_differ=differ,
        outputs_differ=tokens,
        unique_mean=float(np.mean(uniques)) if uniques else math.nan,
        first_diff=first,
    )


def axis_table(analysis: Analysis) -> pd.DataFrame:
    """One row per (suite, backend, TP size) over batch sizes and per (suite, backend, batch size) over TP
    sizes, where two or more cells vary along it (see the module docstring); empty for a run with one TP
    size and one batch size."""
    cells = _plain_cells(analysis)
    outputs = _outputs(analysis) if len(cells) else {}
    rows = []
    for (suite, backend), sub in cells.groupby(["suite", "backend"], sort=False):
        for tp, group in sub.groupby("tp", sort=True):
            if group["batch_size"].nunique() == len(group) > 1:
                key = (suite, backend, "batch", f"TP {int(tp)}")
                rows.append(_row(analysis, outputs, key, group, "batch_size"))
        for bs, group in sub.groupby("batch_size", sort=True):
            if group["tp"].nunique() == len(group) > 1:
                rows.append(_row(analysis, outputs, (suite, backend, "TP", f"batch {int(bs)}"), group, "tp"))
    return pd.DataFrame(rows, columns=AXIS_COLUMNS)
