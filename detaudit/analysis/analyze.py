"""Metrics over a run directory -> pandas tables.

Every metric is computed per (model, suite, backend) over that backend's completed ("done") cells,
with prompts matched across cells by `prompt_id`. The building blocks are pure functions on small
inputs (token id sequences, top-k log-probability matrices); `analyze()` only gathers and groups.

Definitions (the edge cases are part of the definition):

- unique: number of distinct output token sequences across the cells, per prompt.
  `unique_mean` averages it over prompts (1.0: every cell agreed on every prompt).
- first divergence: the first output index at which two cells' token ids differ; where one output
  is a strict prefix of another, the index where the shorter one ends. Prompts whose outputs are all
  identical have no divergence: they are counted (`identical_prompts`) and left out of
  `first_div_median` (NaN when no prompt diverged).
- max probability divergence (published definition): at output position i, each cell's top-5
  probabilities (exp of its recorded top-k log-probabilities, sorted descending, the 5 largest; a
  row with fewer than 5 entries is padded with probability 0); the divergence at i is the largest,
  over the 5 ranks, of (max over cells - min over cells). Only positions at which every cell has a
  token are compared (up to the shortest output; an empty output contributes no position). Per
  prompt: mean over positions; `maxprob_div_mean`: mean over prompts. A prompt with no comparable
  position (an empty output, or only one cell has it) is left out of the mean and counted
  (`maxprob_excluded`); with fewer than two done cells every divergence is NaN, never 0. Identical inputs give 0.0
  exactly (computed in float64 from the stored float32 values).
- prefix divergence: the same, restricted to positions before the first divergence (all compared
  positions when outputs are identical); prompts that diverge at position 0 are left out and
  counted (`prefix_excluded`).
- teacher-forced divergence: every cell scored the same reference continuation
  (`tf_token_logprobs`); per position, the largest |p_cell - p_ref| over cells, p = exp(logprob),
  p_ref from the cell named by `tf_reference_cell` (when that cell has no data: the first cell, in
  grid order, that has). `teacher_forced_div_mean`: mean over positions, then prompts;
  `teacher_forced_div_max`: the largest value at any position of any prompt. NaN without data.
- accuracy: per cell, the mean of `correct` over prompts where it is known; `acc_mean` and
  `acc_std` over cells with an accuracy. `acc_std` is the POPULATION std (ddof=0) of the cells'
  accuracies: the spread of this fixed set of configurations (the paper's Std@Acc), 0 for one cell.
- len_std: per prompt, the population std of output length (tokens) across cells; mean over prompts.
- agreement: for each pair of cells, the fraction of their common prompts with identical outputs.
- routing (MoE models; the records' `route_experts` / `route_margins`, NaN where no cell records
  routing): a router is one (output position, MoE layer) pair; its expert set is the k experts it
  chose, whatever their order. Compared positions: those every routed cell reached after the same
  tokens (up to and including the first divergence, up to the shortest output), since only there did
  the cells route the same input. `routing_div`: share of compared routers whose expert set differs
  across cells, pooled over prompts (`routing_pairs` routers); `routed_tokens_div`: share of compared
  positions with such a router in at least one layer. `near_tie_frac`: share of every cell's routers
  (all recorded positions) whose margin, the k-th minus the (k+1)-th router probability, is below
  `metrics.NEAR_TIE_MARGIN`. Fewer than two routed cells: NaN, never 0.
- speculative decoding: `spec_bitwise_diff_records` counts the records of the speculative cells (cell
  ids `...__ngramK`, `...__draftK-NAME`) not bitwise equal to the plain cell of the same coordinates (in
  the same fields as `bitwise_diff_records`); `spec_first_diff` names the first. NaN without a
  speculative cell whose plain cell is done. `spec_axis` has the per-cell table (acceptance, speed-up).
- bitwise: `bitwise_diff_records` counts the records (prompt x cell) that are not bitwise equal to
  the reference cell's (the first done cell in grid order) in some numeric field: output token ids,
  chosen-token, top-k and teacher-forced log-probabilities, top-k ids, MoE routing (`records.NUMERIC_FIELDS`,
  floats compared by bit pattern); a prompt one cell lacks counts too. 0: bitwise invariant.
  `bitwise_first_diff` names the first differing cell, field, prompt and position. NaN with fewer
  than two done cells (with --repeats: configurations).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import pandas as pd
import pyarrow as pa

from detaudit.analysis.metrics import MIN_CELLS, NEAR_TIE_MARGIN, summary_columns
from detaudit.config import plain_cell_id
from detaudit.errors import DetauditError
from detaudit.runs.manifest import Manifest
from detaudit.runs.records import NUMERIC_FIELDS, ROUTING_COLUMNS, record_differences
from detaudit.runs.rundir import RunDir

TOPK = 5
BACKEND_ORDER = ("bf16", "bio", "bio+tbik")

SUMMARY_COLUMNS = summary_columns()  # one per MetricSpec (detaudit.analysis.metrics)
PER_PROMPT_COLUMNS = [
    "model",
    "suite",
    "backend",
    "prompt_index",
    "prompt_id",
    "cells",
    "unique",
    "first_div",
    "maxprob_div",
    "maxprob_positions",
    "prefix_div",
    "prefix_positions",
    "tf_div_mean",
    "tf_div_max",
    "len_mean",
    "len_std",
    "correct_frac",
    "routing_div",
    "routing_pairs",
]
PER_CELL_COLUMNS = [
    "cell_id",
    "model",
    "suite",
    "backend",
    "tp",
    "batch_size",
    "tp_mode",
    "state",
    "error",
    "wall_s",
    "prompts",
    "acc",
    "len_mean",
    "agree_ref",
]
BY_POSITION_COLUMNS = ["suite", "backend", "position", "maxprob_div_mean", "prompts", "diverged_frac"]


# ---------------------------------------------------------------- pure metric functions


def _ids(seq: Any) -> np.ndarray:
    if seq is None:
        return np.zeros(0, dtype=np.int64)
    return np.asarray(seq, dtype=np.int64).reshape(-1)


def unique_count(seqs: Sequence[Sequence[int]]) -> int:
    """Number of distinct token sequences."""
    return len({_ids(s).tobytes() for s in seqs})


def first_divergence(seqs: Sequence[Sequence[int]]) -> int | None:
    """First index at which the sequences differ (a strict prefix diverges where it ends);
    None when all are identical (or fewer than two)."""
    arrs = [_ids(s) for s in seqs]
    if len(arrs) < 2:
        return None
    n = min(len(a) for a in arrs)
    if n:
        m = np.stack([a[:n] for a in arrs])
        diff = np.flatnonzero((m != m[0]).any(axis=0))
        if diff.size:
            return int(diff[0])
    return n if any(len(a) != n for a in arrs) else None


def top5_probs(topk_logprobs: Any, k: int = TOPK) -> np.ndarray:
    """(positions, k) float64: each row's k largest probabilities, descending; rows with fewer than
    k entries are padded with probability 0."""
    rows = [] if topk_logprobs is None else list(topk_logprobs)
    if not rows:
        return np.zeros((0, k))
    try:
        m = np.stack([np.asarray(r, dtype=np.float64) for r in rows])
        if m.ndim != 2:
            raise ValueError
    except ValueError:  # ragged rows
        width = max(k, max(len(r) for r in rows))
        m = np.full((len(rows), width), -np.inf)
        for i, r in enumerate(rows):
            m[i, : len(r)] = np.asarray(r, dtype=np.float64)
    if m.shape[1] < k:
        m = np.concatenate([m, np.full((m.shape[0], k - m.shape[1]), -np.inf)], axis=1)
    p = np.exp(m)
    return -np.sort(-p, axis=1)[:, :k]


def maxprob_divergence_by_position(probs: Sequence[np.ndarray]) -> np.ndarray:
    """Per position (up to the shortest), the largest over ranks of the spread across cells."""
    if not probs:
        return np.zeros(0)
    n = min(p.shape[0] for p in probs)
    stack = np.stack([p[:n] for p in probs])  # cells, positions, ranks
    return (stack.max(axis=0) - stack.min(axis=0)).max(axis=-1)


def teacher_forced_by_position(tf_logprobs: Sequence[Any], reference: Any) -> np.ndarray:
    """Per position (up to the shortest), the largest |p_cell - p_ref| over cells."""
    ref = np.exp(np.asarray(reference if reference is not None else [], dtype=np.float64).reshape(-1))
    arrs = [np.exp(np.asarray(a, dtype=np.float64).reshape(-1)) for a in tf_logprobs if a is not None]
    n = min([len(ref)] + [len(a) for a in arrs])
    if not arrs:
        return np.zeros(n)
    return np.abs(np.stack([a[:n] for a in arrs]) - ref[:n]).max(axis=0)


def expert_sets(experts: np.ndarray, layers: int) -> np.ndarray:
    """[positions, layers, k]: each router's chosen experts (`experts`: [positions, layers * k], layer-major
    as recorded), sorted, so two routers compare equal when they chose the same set in any order."""
    positions, width = experts.shape
    if layers < 1 or width % layers:
        raise DetauditError(f"routing records of {width} expert ids per position do not split into {layers} layers")
    return np.sort(experts.reshape(positions, layers, width // layers), axis=-1)


def routers_differ(experts: Sequence[np.ndarray], layers: int, positions: int) -> np.ndarray:
    """[positions, layers] bool: whether each router's expert set differs across the cells' routing
    records (`experts`, one [positions, layers * k] array per cell), over the first `positions`."""
    sets = [expert_sets(e[:positions], layers) for e in experts]
    if any(x.shape != sets[0].shape for x in sets):
        raise DetauditError(f"cells record routing of different shapes ({sorted({x.shape for x in sets})})")
    stack = np.stack(sets)
    return (stack != stack[0]).any(axis=(0, 3))


def same_prefix_positions(seqs: Sequence[Sequence[int]]) -> int:
    """How many leading positions every sequence reached after the same tokens: up to and including the
    first divergence (its distribution was computed from the common prefix), up to the shortest."""
    n = min((len(s) for s in seqs), default=0)
    fd = first_divergence(seqs)
    return n if fd is None else min(fd + 1, n)


def near_ties(margins: np.ndarray, threshold: float = NEAR_TIE_MARGIN) -> tuple[int, int]:
    """(routers whose margin is below `threshold`, routers) of one record's [positions, layers] margins."""
    return int((margins < threshold).sum()), int(margins.size)


def mean_or_nan(x: Iterable[float] | np.ndarray) -> float:
    a = np.asarray(list(x) if not isinstance(x, np.ndarray) else x, dtype=np.float64)
    a = a[~np.isnan(a)]
    return float(a.mean()) if a.size else math.nan


def accuracy_std(accs: Iterable[float]) -> float:
    """Population std (ddof=0) of the known accuracies; NaN when none is known."""
    a = np.asarray([x for x in accs if x is not None and not math.isnan(x)], dtype=np.float64)
    return float(a.std(ddof=0)) if a.size else math.nan


def agreement_matrix(outputs: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """outputs: cell -> {prompt -> token ids}. Fraction of common prompts with identical outputs."""
    cells = list(outputs)
    keys = {c: {p: _ids(s).tobytes() for p, s in outputs[c].items()} for c in cells}
    m = np.full((len(cells), len(cells)), np.nan)
    for i, a in enumerate(cells):
        for j in range(i, len(cells)):
            b = cells[j]
            common = keys[a].keys() & keys[b].keys()
            if common:
                m[i, j] = m[j, i] = sum(keys[a][p] == keys[b][p] for p in common) / len(common)
    return pd.DataFrame(m, index=cells, columns=cells)


# ---------------------------------------------------------------- loading


@dataclass
class Analysis:
    summary: pd.DataFrame
    per_prompt: pd.DataFrame
    per_cell: pd.DataFrame
    agreement: dict[tuple[str, str], pd.DataFrame]
    divergence_by_position: pd.DataFrame
    manifest: Manifest
    run_dir: Path | None = None
    notes: list[str] = field(default_factory=list)
    records: pd.DataFrame | None = None  # the done cells' records (`_read_cell`): the load axis reads them
    tables: dict[str, pa.Table] | None = None  # each configuration's numeric fields: the speculative axis reads them

    @property
    def model(self) -> str:
        return self.manifest.model_name

    @property
    def backends(self) -> list[str]:
        return order_backends(self.per_cell["backend"].unique(), self.manifest)

    @property
    def suites(self) -> list[str]:
        return list(dict.fromkeys(self.per_cell["suite"]))


def order_backends(names: Iterable[str], manifest: Manifest | None = None) -> list[str]:
    """Configured order, else the canonical bf16 / bio / bio+tbik, then the others by name."""
    names = list(dict.fromkeys(names))
    configured = list(manifest.config.get("backends") or []) if manifest is not None else []
    order = configured + [b for b in BACKEND_ORDER if b not in configured]
    return sorted(names, key=lambda b: (order.index(b) if b in order else len(order), b))


def _top5_column(column: pa.ChunkedArray) -> list[np.ndarray]:
    """Per record, `top5_probs` of its topk_logprobs, without a Python loop over positions when
    every position holds the same number (>= TOPK) of entries."""
    outer = column.combine_chunks()
    inner = outer.values
    if isinstance(outer, pa.ListArray) and outer.null_count == 0 and inner.null_count == 0 and len(inner):
        widths = np.diff(inner.offsets.to_numpy())
        k = int(widths[0])
        if k >= TOPK and (widths == k).all() and inner.values.null_count == 0:
            start = inner.offsets[0].as_py()
            flat = inner.values.to_numpy(zero_copy_only=False)[start : start + k * len(inner)]
            p = np.exp(flat.astype(np.float64).reshape(-1, k))
            p = -np.sort(-p, axis=1)[:, :TOPK]
            offsets = outer.offsets.to_numpy()
            base = offsets[0]
            return [p[offsets[i] - base : offsets[i + 1] - base] for i in range(len(outer))]
    return [top5_probs(x) for x in outer.to_pylist()]


def _matrix_column(table: pa.Table, name: str, cell_id: str) -> list[np.ndarray | None]:
    """Per record, a list-of-lists column (routing) as one [positions, width] array; None where the value
    is null or the file predates the column. Every position of a cell holds as many values."""
    if name not in table.column_names:
        return [None] * table.num_rows
    outer = table.column(name).combine_chunks()
    inner = outer.flatten()  # the valid records' positions, in order
    widths = inner.value_lengths().fill_null(-1).to_numpy(zero_copy_only=False)
    values = inner.flatten()
    if inner.null_count or values.null_count or (widths != (widths[0] if len(widths) else 0)).any():
        raise DetauditError(f"cell {cell_id}: its {name} records hold positions of different widths (a corrupt file)")
    flat = values.to_numpy(zero_copy_only=False).reshape(len(inner), int(widths[0]) if len(widths) else 0)
    counts = outer.value_lengths().fill_null(0).to_numpy(zero_copy_only=False)
    ends = np.cumsum(counts)
    valid = outer.is_valid().to_numpy(zero_copy_only=False)
    return [flat[e - c : e] if v else None for c, e, v in zip(counts, ends, valid)]


def _config_tables(cell_id: str, table: pa.Table) -> dict[str, pa.Table]:
    """The records' keys and numeric fields per configuration (ids as `config_id` below), without the
    repeat column: the records of two configurations are matched by prompt."""
    numeric = table.select([c for c in ("prompt_id", "prompt_index", *NUMERIC_FIELDS) if c in table.column_names])
    repeat = table.column("repeat").fill_null(0).to_numpy() if "repeat" in table.column_names else None
    if repeat is None or not (repeat > 0).any():
        return {cell_id: numeric}
    return {f"{cell_id}#r{int(r)}": numeric.filter(pa.array(repeat == r)) for r in np.unique(repeat)}


def _read_cell(run: RunDir, cell_id: str) -> tuple[pd.DataFrame, dict[str, pa.Table]]:
    """One cell's records, `topk_logprobs` replaced by `top5` (see `_top5_column`), the routing columns by
    `route_experts` / `route_margins` arrays (see `_matrix_column`), and its configurations' numeric
    fields (`_config_tables`) for the bitwise comparison."""
    table = run.read_table(cell_id)  # validated: columns, its own cell id, this run's identity
    tables = _config_tables(cell_id, table)
    top5 = _top5_column(table.column("topk_logprobs"))
    routing = {c: _matrix_column(table, c, cell_id) for c in ("route_experts", "route_margins")}
    drop = ["topk_logprobs", "topk_ids", *(c for c in ROUTING_COLUMNS if c in table.column_names)]
    df = table.drop_columns(drop).to_pandas()
    df["top5"] = pd.Series(top5, index=df.index, dtype=object)
    for c, arrays in routing.items():
        df[c] = pd.Series(arrays, index=df.index, dtype=object)
    df["cell_id"] = cell_id
    # server engines' --repeats: each (cell, repeat) is one configuration for unique / divergence
    # metrics ("cell#rN"); files without the column (or without repeats) are one configuration
    if "repeat" in df and df["repeat"].notna().any() and (df["repeat"].fillna(0) > 0).any():
        df["config_id"] = [f"{cell_id}#r{int(r) if pd.notna(r) else 0}" for r in df["repeat"]]
    else:
        df["config_id"] = cell_id
    return df, tables


def _cell_row(
    cid: str, model: str, cell, tp_mode: str, state: str, error: str | None, wall_s: Any = None
) -> dict[str, Any]:
    """One per-cell row from a manifest cell or a grid cell (both name suite, backend, TP, batch size)."""
    return dict(
        cell_id=cid,
        model=model,
        suite=cell.suite,
        backend=cell.backend,
        tp=cell.tp,
        batch_size=cell.batch_size,
        tp_mode=tp_mode,
        state=state,
        error=error,
        wall_s=wall_s,
    )


def _load(run_dir: str | os.PathLike) -> tuple[Manifest, pd.DataFrame, pd.DataFrame, dict[str, pa.Table]]:
    """Manifest, records of the done cells, one row per cell (grid cells absent from the manifest, and
    done cells whose file is gone, get state "missing"), and each configuration's numeric fields. A
    cell file that exists but cannot be read, or holds another cell, is bad input (DetauditError)."""
    run = RunDir(run_dir)
    manifest = run.load()
    model = manifest.model_name
    rows, frames, tables = [], [], {}
    for cid, meta in manifest.cells.items():
        state, error = meta.state, meta.error
        if state == "done":
            if not run.cell_path(cid).exists():
                state, error = "missing", "marked done but its cell file is missing"
            else:
                df, numeric = _read_cell(run, cid)
                frames.append(df)
                tables.update(numeric)
        error = error if state != "done" else None
        rows.append(_cell_row(cid, model, meta, meta.tp_mode, state, error, meta.extra.get("wall_s")))
    for cid, cell in manifest.grid().items():  # every manifest cell is in it (Manifest.from_dict)
        if cid not in manifest.cells:
            error = "in the configured grid but not in the manifest"
            rows.append(_cell_row(cid, model, cell, manifest.tp_mode(cell.tp), "missing", error))
    records = (
        pd.concat(frames, ignore_index=True)
        if frames
        else pd.DataFrame(columns=["cell_id", "suite", "backend", "prompt_id", "prompt_index"])
    )
    per_cell = pd.DataFrame(rows, columns=PER_CELL_COLUMNS[:10])
    order = order_backends(per_cell["backend"].dropna(), manifest)
    per_cell["_b"] = per_cell["backend"].map(lambda b: order.index(b) if b in order else len(order))
    per_cell = per_cell.sort_values(["suite", "_b", "tp", "batch_size", "cell_id"], kind="stable")
    per_cell = per_cell.drop(columns="_b").reset_index(drop=True)
    return manifest, records, per_cell, tables


# ---------------------------------------------------------------- analysis


def _prompt_key(row: dict[str, Any]) -> str:
    pid = row.get("prompt_id")
    if pid is None or (isinstance(pid, float) and math.isnan(pid)):
        return f"#{row['prompt_index']}"
    return str(pid)


def bitwise_differences(configs: Sequence[str], tables: dict[str, pa.Table]) -> tuple[float, str]:
    """(records of `configs[1:]` not bitwise equal to `configs[0]`'s, the first difference in words);
    NaN with fewer than MIN_CELLS configurations."""
    if len(configs) < MIN_CELLS:
        return math.nan, ""
    count, first = 0, ""
    for config in configs[1:]:
        try:
            diffs = list(record_differences(tables[configs[0]], tables[config]))
        except DetauditError as e:  # two records of one prompt
            raise DetauditError(f"cell {config.split('#')[0]} is corrupt: {e}") from None
        count += len(diffs)
        if diffs and not first:
            first = f"{config} differs from {configs[0]}: {diffs[0]}"
    return float(count), first


def speculative_differences(cells: Sequence[str], tables: dict[str, pa.Table]) -> tuple[float, str]:
    """(records of the speculative cells among `cells` not bitwise equal to the plain cell of their
    coordinates, the first difference in words); NaN where no speculative cell has its plain cell."""
    pairs = [(c, plain_cell_id(c)) for c in cells if plain_cell_id(c) != c]
    pairs = [(c, p) for c, p in pairs if c in tables and p in tables]
    if not pairs:
        return math.nan, ""
    count, first = 0, ""
    for cell, plain in pairs:
        diffs = list(record_differences(tables[plain], tables[cell]))
        count += len(diffs)
        if diffs and not first:
            first = f"{cell} differs from {plain}: {diffs[0]}"
    return float(count), first


@dataclass
class _Group:
    """One (suite, backend)'s records, read once: per configuration (a cell, or a cell's repeat) each
    prompt's output ids, top-5 probabilities, teacher-forced log-probs, correctness and routing; the
    configurations in grid order; the prompts in suite order."""

    data: dict[str, dict[str, dict[str, Any]]]  # configuration -> prompt key -> its record's fields
    prompt_index: dict[str, int]
    done: list[str]  # done cells, grid order
    configs_of: dict[str, list[str]]  # cell -> its configurations (repeats), in repeat order
    configs: list[str]  # every configuration, cells in grid order
    prompts: list[str]


def _collect(cells: pd.DataFrame, records: pd.DataFrame) -> _Group:
    present = set(records["cell_id"]) if len(records) else set()
    done = [c for c in cells["cell_id"] if c in present]
    data: dict[str, dict[str, dict[str, Any]]] = {}
    prompt_index: dict[str, int] = {}
    key_col = "config_id" if "config_id" in records else "cell_id"  # (cell, repeat) configurations
    repeats: dict[str, list[tuple[int, str]]] = {}  # cell -> its (repeat, configuration id)
    for cid, sub in records.groupby(key_col, sort=False) if len(records) else ():
        rep = sub["repeat"].iat[0] if "repeat" in sub else None
        repeats.setdefault(sub["cell_id"].iat[0], []).append((int(rep) if pd.notna(rep) else 0, cid))
        d = {}
        for r in sub.to_dict("records"):
            key = _prompt_key(r)
            ids = _ids(r["output_token_ids"])
            correct = r["correct"]
            d[key] = dict(
                ids=ids,
                probs=r["top5"][: len(ids)],
                tf=r.get("tf_token_logprobs"),
                ref=r.get("tf_reference_cell"),
                correct=None if correct is None or pd.isna(correct) else bool(correct),
                experts=r.get("route_experts"),
                margins=r.get("route_margins"),
            )
            prompt_index.setdefault(key, int(r["prompt_index"]) if pd.notna(r["prompt_index"]) else len(prompt_index))
        data[cid] = d
    configs_of = {c: [k for _, k in sorted(repeats[c])] for c in done}
    return _Group(
        data=data,
        prompt_index=prompt_index,
        done=done,
        configs_of=configs_of,
        configs=[k for c in done for k in configs_of[c]],
        prompts=sorted(prompt_index, key=lambda k: (prompt_index[k], k)),
    )


@dataclass
class _Prompts:
    """Per-prompt rows and what the summary and the by-position table pool from them."""

    rows: pd.DataFrame
    div_arrays: list[np.ndarray]  # compared prompts' max-prob divergence by position
    first_divs: list[int | None]  # compared prompts' first divergence (None: identical)
    routed: dict[str, int]  # pairs / differ / positions / tokens of the routing comparison
    routing_compared: bool  # some prompt had two or more routed configurations


def _teacher_forced(g: _Group, key: str, have: list[str], recs: list[dict[str, Any]]) -> tuple[float, float]:
    """(mean, max) over positions of the teacher-forced divergence of one prompt's configurations, against
    the reference cell the records name (or the first); NaN with fewer than MIN_CELLS scored."""
    tf_cells = [c for c, r in zip(have, recs) if r["tf"] is not None]
    if len(tf_cells) < MIN_CELLS:
        return math.nan, math.nan
    named = next((r["ref"] for r in recs if isinstance(r["ref"], str) and r["ref"]), None)
    named = named if named in tf_cells or f"{named}#r0" not in tf_cells else f"{named}#r0"  # --repeats
    ref_cell = named if named in tf_cells else tf_cells[0]
    tf = teacher_forced_by_position([g.data[c][key]["tf"] for c in tf_cells], g.data[ref_cell][key]["tf"])
    return (float(tf.mean()), float(tf.max())) if tf.size else (math.nan, math.nan)


def _per_prompt(model: str, suite: str, backend: str, g: _Group) -> _Prompts:
    rows, div_arrays, first_divs = [], [], []
    routed = dict(pairs=0, differ=0, positions=0, tokens=0)
    routing_compared = False
    for key in g.prompts:
        have = [c for c in g.configs if key in g.data[c]]
        recs = [g.data[c][key] for c in have]
        seqs = [r["ids"] for r in recs]
        fd = first_divergence(seqs)
        compared = len(have) >= MIN_CELLS  # a prompt seen by one cell compares nothing: NaN, not 0
        by_pos = maxprob_divergence_by_position([r["probs"] for r in recs]) if compared else np.zeros(0)
        prefix = by_pos[:fd] if fd is not None else by_pos
        tf_mean, tf_max = _teacher_forced(g, key, have, recs)
        differ = _routing_differences([r for r in recs if r["experts"] is not None])
        if differ is not None:
            routing_compared = True
            routed["pairs"] += differ.size
            routed["differ"] += int(differ.sum())
            routed["positions"] += differ.shape[0]
            routed["tokens"] += int(differ.any(axis=1).sum())
        lengths = np.array([len(s) for s in seqs], dtype=np.float64)
        known = [r["correct"] for r in recs if r["correct"] is not None]
        if compared:
            first_divs.append(fd)
            div_arrays.append(by_pos)
        rows.append(
            dict(
                model=model,
                suite=suite,
                backend=backend,
                prompt_index=g.prompt_index[key],
                prompt_id=key,
                cells=len(have),
                unique=unique_count(seqs),
                first_div=fd,
                maxprob_div=float(by_pos.mean()) if by_pos.size else math.nan,
                maxprob_positions=int(by_pos.size),
                prefix_div=float(prefix.mean()) if prefix.size else math.nan,
                prefix_positions=int(prefix.size),
                tf_div_mean=tf_mean,
                tf_div_max=tf_max,
                len_mean=float(lengths.mean()) if lengths.size else math.nan,
                len_std=float(lengths.std(ddof=0)) if lengths.size else math.nan,
                correct_frac=float(np.mean(known)) if known else math.nan,
                routing_div=float(differ.mean()) if differ is not None and differ.size else math.nan,
                routing_pairs=int(differ.size) if differ is not None else math.nan,
            )
        )
    return _Prompts(pd.DataFrame(rows, columns=PER_PROMPT_COLUMNS), div_arrays, first_divs, routed, routing_compared)


def _per_cell(g: _Group) -> tuple[dict[str, dict[str, Any]], pd.DataFrame]:
    """Per done cell (its repeats pooled): prompts, accuracy, mean length, agreement with the reference
    cell; and the agreement matrix (each cell's first repeat, so one row per cell)."""
    extra = {}
    ref_cell = g.configs[0] if g.configs else None
    for cid in g.done:
        ds = [g.data[k] for k in g.configs_of[cid]]
        rs = [r for d in ds for r in d.values()]
        known = [r["correct"] for r in rs if r["correct"] is not None]
        ref = g.data[ref_cell]
        same = [d[k]["ids"].tobytes() == ref[k]["ids"].tobytes() for d in ds for k in d if k in ref]
        extra[cid] = dict(
            prompts=len({k for d in ds for k in d}),
            acc=float(np.mean(known)) if known else math.nan,
            len_mean=float(np.mean([len(r["ids"]) for r in rs])) if rs else math.nan,
            agree_ref=float(np.mean(same)) if same else math.nan,
        )
    agreement = agreement_matrix({c: {k: r["ids"] for k, r in g.data[g.configs_of[c][0]].items()} for c in g.done})
    return extra, agreement


def _by_position(suite: str, backend: str, g: _Group, p: _Prompts) -> pd.DataFrame:
    """The mean max-prob divergence at each output position over the compared prompts that reach it, and
    the share of compared prompts diverged at or before it."""
    width = max((a.size for a in p.div_arrays), default=0)
    max_len = max(width, max(([len(g.data[c][k]["ids"]) for c in g.configs for k in g.data[c]]), default=0))
    sums, counts = np.zeros(max_len), np.zeros(max_len)
    for a in p.div_arrays:
        sums[: a.size] += a
        counts[: a.size] += 1
    fds = np.sort(np.array([f for f in p.first_divs if f is not None], dtype=np.int64))
    positions = np.arange(max_len)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_by_pos = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    if p.first_divs:
        diverged = np.searchsorted(fds, positions, side="right") / len(p.first_divs)
    else:
        diverged = np.full(max_len, np.nan)
    return pd.DataFrame(
        dict(
            suite=suite,
            backend=backend,
            position=positions,
            maxprob_div_mean=mean_by_pos,
            prompts=counts.astype(np.int64),
            diverged_frac=diverged,
        ),
        columns=BY_POSITION_COLUMNS,
    )


def _summary(
    model: str,
    suite: str,
    backend: str,
    cells: pd.DataFrame,
    g: _Group,
    p: _Prompts,
    extra: dict[str, dict[str, Any]],
    tables: dict[str, pa.Table],
) -> dict[str, Any]:
    pp = p.rows
    ties = [near_ties(r["margins"]) for c in g.configs for r in g.data[c].values() if r["margins"] is not None]
    tie_count, tie_total = (sum(x) for x in zip(*ties)) if ties else (0, 0)
    accs = [extra[c]["acc"] for c in g.done]
    failed = cells[cells["state"].isin(["failed", "missing"])]["cell_id"].tolist()
    pending = cells[~cells["state"].isin(["failed", "missing", "done"])]["cell_id"].tolist()
    diverging = [f for f in p.first_divs if f is not None]
    refs = sorted({r["ref"] for c in g.configs for r in g.data[c].values() if isinstance(r["ref"], str) and r["ref"]})
    bitwise, bitwise_first = bitwise_differences(g.configs, tables)
    routed = p.routed
    spec_bitwise, spec_first = speculative_differences(g.done, tables)
    return dict(
        model=model,
        suite=suite,
        backend=backend,
        cells=len(g.done),
        prompts=len(g.prompts),
        unique_mean=mean_or_nan(pp["unique"]),
        unique_max=float(pp["unique"].max()) if len(pp) else math.nan,
        bitwise_diff_records=bitwise,
        bitwise_first_diff=bitwise_first,
        spec_bitwise_diff_records=spec_bitwise,
        spec_first_diff=spec_first,
        identical_prompts=int(sum(f is None for f in p.first_divs)),
        maxprob_div_mean=mean_or_nan(pp["maxprob_div"]),
        maxprob_excluded=int(pp["maxprob_div"].isna().sum()),
        prefix_div_mean=mean_or_nan(pp["prefix_div"]),
        prefix_excluded=int(pp["prefix_div"].isna().sum()),
        teacher_forced_div_max=float(np.nanmax(pp["tf_div_max"])) if pp["tf_div_max"].notna().any() else math.nan,
        teacher_forced_div_mean=mean_or_nan(pp["tf_div_mean"]),
        tf_reference=", ".join(refs),
        first_div_median=float(np.median(diverging)) if diverging else math.nan,
        routing_div=routed["differ"] / routed["pairs"] if routed["pairs"] else math.nan,
        routed_tokens_div=routed["tokens"] / routed["positions"] if routed["positions"] else math.nan,
        routing_pairs=routed["pairs"] if p.routing_compared else math.nan,
        near_tie_frac=tie_count / tie_total if tie_total else math.nan,
        acc_mean=mean_or_nan(accs),
        acc_std=accuracy_std(accs),
        len_mean=mean_or_nan(pp["len_mean"]),
        len_std=mean_or_nan(pp["len_std"]),
        failed_cells=len(failed),
        pending_cells=len(pending),
        failed_cell_ids=", ".join(failed),
        emulated=bool((cells.loc[cells["cell_id"].isin(g.done), "tp_mode"] == "emulated").any()),
    )


def _group(
    model: str, suite: str, backend: str, cells: pd.DataFrame, records: pd.DataFrame, tables: dict[str, pa.Table]
):
    """Metrics of one (suite, backend): (summary row, per-prompt rows, per-cell extras, agreement,
    by-position rows), in steps: the records read once per configuration, then per prompt, per cell,
    by position, and the summary pooling them."""
    g = _collect(cells, records)
    prompts = _per_prompt(model, suite, backend, g)
    extra, agreement = _per_cell(g)
    by_position = _by_position(suite, backend, g, prompts)
    summary = _summary(model, suite, backend, cells, g, prompts, extra, tables)
    return summary, prompts.rows, extra, agreement, by_position


def _routing_differences(recs: list[dict[str, Any]]) -> np.ndarray | None:
    """`routers_differ` over the same-prefix positions of one prompt's routed records (None with fewer
    than MIN_CELLS of them: nothing to compare)."""
    if len(recs) < MIN_CELLS:
        return None
    n = min(same_prefix_positions([r["ids"] for r in recs]), *(len(r["experts"]) for r in recs))
    margins = [r["margins"] for r in recs if r["margins"] is not None and len(r["margins"])]
    if n == 0 or not margins:
        return np.zeros((0, 0), dtype=bool)
    return routers_differ([r["experts"] for r in recs], margins[0].shape[1], n)


def analyze(run_dir: str | os.PathLike) -> Analysis:
    """All metrics of one run directory (see the module docstring for the definitions)."""
    manifest, records, per_cell, tables = _load(run_dir)
    model = manifest.model_name
    summaries, prompt_frames, position_frames = [], [], []
    agreement: dict[tuple[str, str], pd.DataFrame] = {}
    extras: dict[str, dict[str, Any]] = {}
    groups = per_cell[["suite", "backend"]].dropna().drop_duplicates().itertuples(index=False)
    for suite, backend in groups:
        cells = per_cell[(per_cell["suite"] == suite) & (per_cell["backend"] == backend)]
        recs = records[records["cell_id"].isin(cells["cell_id"])] if len(records) else records
        summary, pp, extra, agree, by_pos = _group(model, suite, backend, cells, recs, tables)
        summaries.append(summary)
        prompt_frames.append(pp)
        position_frames.append(by_pos)
        agreement[(suite, backend)] = agree
        extras.update(extra)
    for col in ("prompts", "acc", "len_mean", "agree_ref"):
        per_cell[col] = per_cell["cell_id"].map(lambda c: extras.get(c, {}).get(col, math.nan))
    per_prompt = _concat(prompt_frames, PER_PROMPT_COLUMNS)
    per_prompt["first_div"] = per_prompt["first_div"].astype("Int64")
    summary = pd.DataFrame(summaries, columns=SUMMARY_COLUMNS)
    notes = []
    if manifest.mixed_hardware:
        notes.append("mixed hardware: the cells of this run were computed on different machines")
    uncompared = nothing_to_compare(summary, per_cell)
    if uncompared:
        notes.append(f"nothing to compare: {uncompared}")
    return Analysis(
        summary=summary,
        per_prompt=per_prompt,
        per_cell=per_cell[PER_CELL_COLUMNS],
        agreement=agreement,
        divergence_by_position=_concat(position_frames, BY_POSITION_COLUMNS),
        manifest=manifest,
        run_dir=Path(run_dir),
        notes=notes,
        records=records,
        tables=tables,
    )


def nothing_to_compare(summary: pd.DataFrame, per_cell: pd.DataFrame) -> str | None:
    """Why the (suite, backend) groups with fewer than MIN_CELLS done cells compare nothing (None
    when every group has enough): their unique count is trivially 1 and their divergences are not
    computed, so a report must not present them as agreement."""
    low = summary[summary["cells"] < MIN_CELLS]
    if len(low) and "maxprob_div_mean" in low:  # --repeats: one cell's repeats are compared with each other
        low = low[low["maxprob_div_mean"].isna()]
    if not len(low):
        return None
    grid = per_cell.groupby(["suite", "backend"]).size()
    sizes = [int(grid.get((s, b), 0)) for s, b in zip(low["suite"], low["backend"])]
    if len(low) == len(summary) and max(sizes) < MIN_CELLS:
        where = "the grid has one TP size and one batch size, so each backend has a single cell per suite"
    else:
        where = "; ".join(
            f"{s}/{b}: {d} of {n} cell{'s' if n != 1 else ''} done"
            for s, b, d, n in zip(low["suite"], low["backend"], low["cells"], sizes)
        )
    return (
        f"{where}. Unique outputs and divergences need {MIN_CELLS} or more done cells of a backend "
        "(shown as –, never as agreement); sweep two or more TP sizes or batch sizes, or finish the cells"
    )


def _concat(frames: list[pd.DataFrame], columns: list[str]) -> pd.DataFrame:
    frames = [f for f in frames if len(f)]
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=columns)
