"""The speculative-decoding axis of a run (`detaudit sweep --speculative off,ngram:K,draft:MODEL:K`).

A speculative cell (id `...__ngramK` or `...__draftK-NAME`) is compared with its plain cell: the cell of
the same suite, backend, TP size and batch size with speculation off. Per speculative cell (one row of
`speculative_table`):

- identical: records bitwise equal to the plain cell's in every recorded number (`records.NUMERIC_FIELDS`:
  token ids, chosen-token, top-k and teacher-forced log-probabilities, top-k ids); records_differ: the
  others.
- outputs differ: records whose output token ids differ; first divergence: where they first do (min and
  median over those records).
- max-prob div: the published definition on the pair (top-5 probabilities' largest spread at each position
  both outputs reach, mean over positions), mean over records.
- acceptance: draft tokens accepted / draft tokens proposed, pooled over the cell's records (a draft token
  is accepted when the token the target drew at its position equals it).
- speed-up: the cell's output tokens per second of generation (`generate_s` in the manifest: prefill and
  decode, no engine start and no teacher forcing) over its plain cell's.

Per (suite, backend, setting) `speculative_summary` pools the setting's cells: unique (per prompt and TP x
batch coordinate, the distinct outputs among the plain and the speculative cell, averaged: 1 = speculation
changed no output), the sums of identical / differing records, the median first divergence, the mean max-
prob divergence, the pooled acceptance, and the speed-up of the pooled tokens per second (every cell's
tokens over every cell's seconds, against the plain cells').
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pandas as pd

from detaudit.analysis.analyze import Analysis, first_divergence, maxprob_divergence_by_position, unique_count
from detaudit.config import plain_cell_id, speculative_of
from detaudit.runs.records import record_differences

SPEC_COLUMNS = [
    "suite",
    "backend",
    "tp",
    "batch_size",
    "setting",
    "cell_id",
    "plain_cell",
    "compared",
    "identical",
    "records_differ",
    "outputs_differ",
    "first_div_min",
    "first_div_median",
    "maxprob_div_mean",
    "drafted",
    "accepted",
    "acceptance",
    "tokens_per_s",
    "plain_tokens_per_s",
    "speedup",
]
SPEC_SUMMARY_COLUMNS = [
    "suite",
    "backend",
    "setting",
    "cells",
    "prompts",
    "unique_mean",
    "identical",
    "records_differ",
    "outputs_differ",
    "first_div_median",
    "maxprob_div_mean",
    "acceptance",
    "speedup",
]


def setting_name(analysis: Analysis, cell_id: str) -> str:
    """A cell's speculative setting as given (`ngram:4`, `draft:DIR:4`), from the manifest; its label
    where the manifest has none; "off" for a plain cell."""
    label = speculative_of(cell_id)
    if not label:
        return "off"
    described = analysis.manifest.speculative.get(label) or {}
    setting = described.get("setting")
    return setting if isinstance(setting, str) else label


def tokens_per_s(analysis: Analysis, cell_id: str) -> tuple[float, float]:
    """(output tokens, generation seconds) the manifest records for a cell (NaN when it does not)."""
    meta = analysis.manifest.cells.get(cell_id)
    extra = meta.extra if meta is not None else {}
    tokens, seconds = extra.get("output_tokens"), extra.get("generate_s")
    ok = all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (tokens, seconds))
    return (float(tokens), float(seconds)) if ok else (math.nan, math.nan)


def _totals(analysis: Analysis, cells) -> tuple[float, float]:
    """(output tokens, generation seconds) summed over `cells` (NaN where one does not record them)."""
    pairs = [tokens_per_s(analysis, c) for c in cells]
    return sum(t for t, _ in pairs), sum(s for _, s in pairs)


def _ratio(a: float, b: float) -> float:
    return a / b if b and not (math.isnan(a) or math.isnan(b)) else math.nan


def _nanmean(values: pd.Series) -> float:
    return float(values.mean()) if values.notna().any() else math.nan


def _count(values: Any) -> int:
    return int(sum(int(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))))


def _pairs(analysis: Analysis) -> list[tuple[dict, str, str]]:
    """(per-cell row, speculative cell, plain cell) of every done speculative cell whose plain cell is done."""
    rec = analysis.records
    if rec is None or not len(rec):
        return []
    done = set(rec["cell_id"])
    rows = {r["cell_id"]: r for r in analysis.per_cell.to_dict("records")}
    return [
        (rows[c], c, plain_cell_id(c)) for c in rows if c in done and plain_cell_id(c) != c and plain_cell_id(c) in done
    ]


def _by_prompt(records: list[dict]) -> dict[str, dict]:
    return {str(r["prompt_id"] if r["prompt_id"] is not None else f"#{r['prompt_index']}"): r for r in records}


def speculative_table(analysis: Analysis) -> pd.DataFrame:
    """One row per done speculative cell whose plain cell is done (see the module docstring)."""
    pairs = _pairs(analysis)
    if not pairs:
        return pd.DataFrame(columns=SPEC_COLUMNS)
    groups = {c: sub.to_dict("records") for c, sub in analysis.records.groupby("cell_id", sort=False)}
    tables = analysis.tables or {}
    rows = []
    for row, cell, plain in pairs:
        spec, base = _by_prompt(groups[cell]), _by_prompt(groups[plain])
        common = [k for k in spec if k in base]
        divs, maxprob = [], []
        for k in common:
            a, b = np.asarray(base[k]["output_token_ids"]), np.asarray(spec[k]["output_token_ids"])
            fd = first_divergence([a, b])
            if fd is not None:
                divs.append(fd)
            n = min(len(a), len(b))
            by_pos = maxprob_divergence_by_position([base[k]["top5"][:n], spec[k]["top5"][:n]]) if n else np.zeros(0)
            if by_pos.size:
                maxprob.append(float(by_pos.mean()))
        differ = (
            len(list(record_differences(tables[plain], tables[cell]))) if plain in tables and cell in tables else None
        )
        records = groups[cell]
        drafted = _count(r.get("spec_drafted") for r in records)
        accepted = _count(r.get("spec_accepted") for r in records)
        tps = _ratio(*tokens_per_s(analysis, cell))
        plain_tps = _ratio(*tokens_per_s(analysis, plain))
        divs.sort()
        rows.append(
            dict(
                suite=row["suite"],
                backend=row["backend"],
                tp=row["tp"],
                batch_size=row["batch_size"],
                setting=setting_name(analysis, cell),
                cell_id=cell,
                plain_cell=plain,
                compared=len(common),
                identical=len(common) - differ if differ is not None else None,
                records_differ=differ,
                outputs_differ=len(divs),
                first_div_min=divs[0] if divs else None,
                first_div_median=float(np.median(divs)) if divs else math.nan,
                maxprob_div_mean=float(np.mean(maxprob)) if maxprob else math.nan,
                drafted=drafted,
                accepted=accepted,
                acceptance=accepted / drafted if drafted else math.nan,
                tokens_per_s=tps,
                plain_tokens_per_s=plain_tps,
                speedup=_ratio(tps, plain_tps),
            )
        )
    table = pd.DataFrame(rows, columns=SPEC_COLUMNS)
    for col in ("first_div_min", "identical", "records_differ"):
        table[col] = table[col].astype("Int64")
    return table


def speculative_summary(analysis: Analysis, table: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per (suite, backend, speculative setting): its cells pooled (see the module docstring)."""
    t = speculative_table(analysis) if table is None else table
    if not len(t):
        return pd.DataFrame(columns=SPEC_SUMMARY_COLUMNS)
    groups = {c: sub.to_dict("records") for c, sub in analysis.records.groupby("cell_id", sort=False)}
    rows = []
    for (suite, backend, setting), sub in t.groupby(["suite", "backend", "setting"], sort=False):
        uniques, divs = [], []
        for cell, plain in zip(sub["cell_id"], sub["plain_cell"]):
            spec, base = _by_prompt(groups[cell]), _by_prompt(groups[plain])
            for k in spec.keys() & base.keys():
                seqs = [base[k]["output_token_ids"], spec[k]["output_token_ids"]]
                uniques.append(unique_count(seqs))
                fd = first_divergence(seqs)
                if fd is not None:
                    divs.append(fd)
        tokens, seconds = _totals(analysis, sub["cell_id"])
        plain_tokens, plain_seconds = _totals(analysis, sub["plain_cell"])
        drafted, accepted = int(sub["drafted"].sum()), int(sub["accepted"].sum())
        differ = sub["records_differ"]
        rows.append(
            dict(
                suite=suite,
                backend=backend,
                setting=setting,
                cells=len(sub),
                prompts=int(sub["compared"].max()),
                unique_mean=float(np.mean(uniques)) if uniques else math.nan,
                identical=int(sub["identical"].sum()) if differ.notna().all() else None,
                records_differ=int(differ.sum()) if differ.notna().all() else None,
                outputs_differ=int(sub["outputs_differ"].sum()),
                first_div_median=float(np.median(divs)) if divs else math.nan,
                maxprob_div_mean=float(sub["maxprob_div_mean"].mean())
                if sub["maxprob_div_mean"].notna().any()
                else math.nan,
                acceptance=accepted / drafted if drafted else math.nan,
                speedup=_ratio(_ratio(tokens, seconds), _ratio(plain_tokens, plain_seconds)),
            )
        )
    return pd.DataFrame(rows, columns=SPEC_SUMMARY_COLUMNS)
