"""The batch-size and TP axes of a run: which of the two moved a backend's records.

The summary's `bitwise_diff_records` pools a backend's cells against one reference, so a difference says
that some configuration changed the records, not whether the batch size or the TP size did. The question
users ask of a mode (vLLM's batch invariance: is it batch-invariant within TP 2, and does it hold across TP
sizes?) needs the two apart. Per (suite, backend), over its plain cells (speculative decoding off, no
background load, one configuration each):

- a `batch` row per TP size t with two or more batch sizes: the cells at TP t, each against the one of the
  smallest batch size (batch invariance at TP t);
- a `TP` row per batch size b with two or more TP sizes: the cells at batch b, each against the one of the
  smallest TP size (TP invariance at batch b).

Columns: `cells`; `prompts` (the reference cell's records); `records_differ`: records not bitwise equal to the
reference's in every recorded number (`records.NUMERIC_FIELDS`, as `bitwise_diff_records`; a record one cell
lacks counts); `outputs_differ`: those whose output token ids differ; `unique_mean`: per prompt, the distinct
outputs across the row's cells, mean over prompts (1: the axis changed no output); `first_diff`: the first
difference in words (cell, field, prompt, position).
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd

from detaudit.analysis.analyze import Analysis, unique_count
from detaudit.config import background_of, plain_cell_id
from detaudit.runs.records import record_differences

AXIS_COLUMNS = [
    "suite",
    "backend",
    "axis",
    "fixed",
    "varied",
    "cells",
    "prompts",
    "records_differ",
    "outputs_differ",
    "unique_mean",
    "first_diff",
]


def _plain_cells(analysis: Analysis) -> pd.DataFrame:
    """The done cells that are one configuration each, with speculation off and no background load."""
    pc = analysis.per_cell
    tables = analysis.tables or {}
    keep = [
        r["state"] == "done" and c in tables and plain_cell_id(c) == c and not background_of(c)
        for c, r in zip(pc["cell_id"], pc.to_dict("records"))
    ]
    return pc[keep]


def _row(analysis: Analysis, suite: str, backend: str, axis: str, fixed: str, cells: pd.DataFrame, by: str) -> dict:
    cells = cells.sort_values(by, kind="stable")
    ids = list(cells["cell_id"])
    tables = analysis.tables or {}
    ref = ids[0]
    differ = outputs = 0
    first = ""
    for other in ids[1:]:
        diffs = list(record_differences(tables[ref], tables[other]))
        differ += len(diffs)
        outputs += sum(1 for _ in record_differences(tables[ref], tables[other], ("output_token_ids",)))
        if diffs and not first:
            first = f"{other} differs from {ref}: {diffs[0]}"
    rec = analysis.records
    ids_by_prompt: dict[str, list] = {}
    for cid, pid, pidx, toks in zip(rec["cell_id"], rec["prompt_id"], rec["prompt_index"], rec["output_token_ids"]):
        if cid in ids:
            key = str(pid) if isinstance(pid, str) else f"#{pidx}"
            ids_by_prompt.setdefault(key, []).append(toks)
    uniques = [unique_count(seqs) for seqs in ids_by_prompt.values()]
    return dict(
        suite=suite,
        backend=backend,
        axis=axis,
        fixed=fixed,
        varied=", ".join(str(int(v)) for v in cells[by]),
        cells=len(ids),
        prompts=tables[ref].num_rows,
        records_differ=differ,
        outputs_differ=outputs,
        unique_mean=float(np.mean(uniques)) if uniques else math.nan,
        first_diff=first,
    )


def axis_table(analysis: Analysis) -> pd.DataFrame:
    """One row per (suite, backend, TP size) over batch sizes and per (suite, backend, batch size) over TP
    sizes, where two or more cells vary along it (see the module docstring); empty for a run with one TP
    size and one batch size."""
    cells = _plain_cells(analysis)
    rows = []
    for (suite, backend), sub in cells.groupby(["suite", "backend"], sort=False):
        for tp, group in sub.groupby("tp", sort=True):
            if group["batch_size"].nunique() == len(group) > 1:
                rows.append(_row(analysis, suite, backend, "batch", f"TP {int(tp)}", group, "batch_size"))
        for bs, group in sub.groupby("batch_size", sort=True):
            if group["tp"].nunique() == len(group) > 1:
                rows.append(_row(analysis, suite, backend, "TP", f"batch {int(bs)}", group, "tp"))
    return pd.DataFrame(rows, columns=AXIS_COLUMNS)
