"""Metric definitions: one `MetricSpec` per summary column (and per alignment column), read by
`analyze` (which columns the summary has), `gate` (which metrics a policy may name, which direction
is worse against a baseline, default tolerances) and `report` (labels, formats, definitions, which
columns each table shows, by name).

Definitions only: the computation lives in `analyze` (pure functions). This module is a lower layer
than analyze / gate / report and imports nothing of theirs (stdlib only).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping

from detaudit.errors import DetauditError

MIN_CELLS = 2  # a comparison needs at least two done cells of one (suite, backend)
DASH = "–"  # not computed / nothing to compare
TABLES = ("summary", "cli", "published")  # summary: markdown / HTML; cli: `detaudit analyze`


# ---------------------------------------------------------------- formats


def is_missing(v: Any) -> bool:
    """None, NaN, NaT or pandas' NA (whose truth value is ambiguous)."""
    if v is None:
        return True
    try:
        return bool(v != v)
    except TypeError:
        return True


def _fmt_exact(v: Any, exact: int, scale: float, near: str) -> str:
    """`exact` printed only when the value is exactly it; a value that merely rounds to it shows `near`."""
    if is_missing(v):
        return DASH
    if v == exact:
        return str(exact)
    s = f"{v * scale:.2f}"
    return near if s == f"{exact:.2f}" else s


def fmt_unique(v: Any) -> str:
    """'1' only when exactly 1; a value that rounds to 1.00 but is not 1 shows as '>1.00'."""
    return _fmt_exact(v, 1, 1.0, ">1.00")


def fmt_div(v: Any, scale: float = 1e3) -> str:
    """x1e-3 by default. '0' only when exactly 0; a tiny non-zero value shows as '<0.01', never as 0."""
    return _fmt_exact(v, 0, scale, "<0.01")


def fmt_prob(v: Any) -> str:
    if is_missing(v):
        return DASH
    return "0" if v == 0 else f"{v:.3g}"


def fmt_num(v: Any, digits: int = 2) -> str:
    if is_missing(v):
        return DASH
    if isinstance(v, bool) or getattr(getattr(v, "dtype", None), "kind", "") == "b":
        return "yes" if v else "no"
    if isinstance(v, numbers.Integral) or (isinstance(v, numbers.Real) and float(v).is_integer()):
        return str(int(v))
    if isinstance(v, numbers.Real):
        return f"{v:.{digits}f}"
    return str(v)


def fmt_num1(v: Any) -> str:
    return fmt_num(v, 1)


def fmt_pct(v: Any) -> str:
    return DASH if is_missing(v) else f"{100 * v:.1f}%"


def fmt_share(v: Any) -> str:
    """A fraction as a percentage. '0' only when exactly 0; a tiny non-zero share shows as '<0.01%'."""
    s = _fmt_exact(v, 0, 100.0, "<0.01")
    return s if s in ("0", DASH) else s + "%"


def fmt_text(v: Any) -> str:
    return DASH if is_missing(v) else str(v)


# cells that read more than their own column


def _backend_cell(row: Mapping[str, Any]) -> str:
    return str(row["backend"]) + (" (emulated)" if row.get("emulated") else "")


def _identical_cell(row: Mapping[str, Any]) -> str:
    return f"{fmt_num(row['identical_prompts'])}/{fmt_num(row['prompts'])}"


def _failed_cell(row: Mapping[str, Any]) -> str:
    parts = [f"{row['failed_cells']} ({row['failed_cell_ids']})"] if row["failed_cells"] else []
    parts += [f"{row['pending_cells']} pending"] if row.get("pending_cells") else []
    return ", ".join(parts) or "0"


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class MetricSpec:
    """One column. `higher_is_better`: True / False for metrics with a direction (what `gate
    --baseline` calls a regression), None for keys and facts. `compares`: the value is a comparison
    across cells, meaningless (shown as DASH) with fewer than MIN_CELLS done cells."""

    name: str
    label: str
    higher_is_better: bool | None = None
    fmt: Callable[[Any], str] = fmt_num
    definition: str = ""
    term: str = ""  # the word the definition explains (default: the label)
    gateable: bool = False
    tables: tuple[str, ...] = ()
    compares: bool = False
    tolerance: float | None = None  # default allowed worsening against a baseline
    text: bool = False  # left-aligned in tables
    cell: Callable[[Mapping[str, Any]], str] | None = None  # a cell built from the whole row
    hide_empty: bool = False  # left out of a table where no row has a value (routing: MoE models only)
    detail: str | None = None  # the summary column that says where a breach of this metric is

    def render(self, row: Mapping[str, Any]) -> str:
        """This column's cell of a summary row."""
        compared = row.get("maxprob_div_mean")  # --repeats: one cell's repeats compared with each other
        repeats = isinstance(compared, (int, float)) and compared == compared
        if self.compares and not row.get("cells", 0) >= MIN_CELLS and not repeats:
            return DASH
        return self.cell(row) if self.cell else self.fmt(row.get(self.name))

    def worsening(self, value: float, reference: float) -> float:
        """How much worse `value` is than `reference` (> 0: worse)."""
        if self.higher_is_better is None:
            raise ValueError(f"metric {self.name} has no direction")
        return reference - value if self.higher_is_better else value - reference

    @property
    def worse_sign(self) -> str:
        return "-" if self.higher_is_better else "+"


def _key(name: str, tables: tuple[str, ...] = (), cell=None) -> MetricSpec:
    return MetricSpec(name, name, fmt=fmt_text, tables=tables, text=True, cell=cell)


def _div(name: str, label: str, **kw: Any) -> MetricSpec:
    return MetricSpec(name, label, higher_is_better=False, gateable=True, compares=True, **kw)


_ALL = ("summary", "cli")
_TF = (
    "teacher forced: every cell scores one reference continuation; largest |p_cell - p_ref| (max) and "
    "its mean over positions, then prompts"
)

# Mixture-of-experts routing (the records' route_* columns; null for dense models and engines that do
# not record routing, so these columns are empty and hidden there). A router is one (position, MoE
# layer) pair; its margin is the k-th minus the (k+1)-th router probability.
NEAR_TIE_MARGIN = 1e-3
_ROUTING_SPECS: tuple[MetricSpec, ...] = (
    _div(
        "routing_div",
        "routing div",
        fmt=fmt_share,
        tables=_ALL,
        hide_empty=True,
        definition="MoE models: share of routers (output position x MoE layer) whose expert set differs "
        "across the cells, over the positions every cell reached with the same tokens before them "
        "(up to and including the first divergence); pooled over prompts",
    ),
    _div(
        "routed_tokens_div",
        "tokens rerouted",
        fmt=fmt_share,
        tables=_ALL,
        hide_empty=True,
        definition="MoE models: share of those positions with a different expert set in at least one layer",
    ),
    MetricSpec("routing_pairs", "routers compared", hide_empty=True),
    MetricSpec(
        "near_tie_frac",
        "near ties",
        fmt=fmt_share,
        tables=_ALL,
        hide_empty=True,
        definition=f"MoE models: share of routers, every position of every cell, whose margin (k-th minus "
        f"(k+1)-th router probability) is below {NEAR_TIE_MARGIN:g}: where rounding can flip the choice",
    ),
)

SUMMARY_SPECS: tuple[MetricSpec, ...] = (
    _key("model"),
    _key("suite", _ALL),
    _key("backend", _ALL, cell=_backend_cell),
    MetricSpec("cells", "cells", True, gateable=True, tables=_ALL),
    MetricSpec("prompts", "prompts", True, gateable=True, tables=_ALL),
    _div(
        "unique_mean",
        "unique",
        fmt=fmt_unique,
        tables=(*_ALL, "published"),
        tolerance=0.25,
        definition="distinct output token sequences across the cells, per prompt, averaged over prompts "
        "(1 = every cell agreed on every prompt)",
    ),
    _div("unique_max", "unique max", fmt=fmt_unique),
    _div(
        "bitwise_diff_records",
        "bitwise diffs",
        tables=_ALL,
        detail="bitwise_first_diff",
        definition="records (prompt x cell) not bitwise equal to the reference cell's (the first done cell in "
        "grid order) in any recorded number: output token ids, chosen-token, top-k and teacher-forced "
        "log-probabilities, top-k ids, floats compared by bit pattern (0 = bitwise invariant)",
    ),
    _key("bitwise_first_diff"),
    _div(
        "spec_bitwise_diff_records",
        "spec bitwise diffs",
        tables=_ALL,
        hide_empty=True,
        detail="spec_first_diff",
        definition="speculative decoding: records of the speculative cells not bitwise equal to the plain cell "
        "of the same TP and batch size, in the same numbers as bitwise diffs (0 = speculation changed no bit)",
    ),
    _key("spec_first_diff"),
    MetricSpec(
        "identical_prompts",
        "identical prompts",
        True,
        gateable=True,
        compares=True,
        tables=("summary",),
        cell=_identical_cell,
    ),
    _div(
        "maxprob_div_mean",
        "max-prob div ×1e-3",
        fmt=fmt_div,
        tables=(*_ALL, "published"),
        tolerance=1e-3,
        term="max-prob div",
        definition="per output position, the largest spread (max - min over cells) of the top-5 probabilities, "
        "rank by rank; mean over positions up to the shortest output, then over prompts (prompts "
        "without a comparable position are left out); x1e-3",
    ),
    MetricSpec("maxprob_excluded", "max-prob excluded", False, gateable=True),
    _div(
        "prefix_div_mean",
        "prefix div ×1e-3",
        fmt=fmt_div,
        tables=_ALL,
        tolerance=1e-3,
        term="prefix div",
        definition="the same, only before the first divergence",
    ),
    MetricSpec("prefix_excluded", "prefix excluded", False, gateable=True),
    _div("teacher_forced_div_max", "TF div max", fmt=fmt_prob, tables=_ALL, term="TF div", definition=_TF),
    _div("teacher_forced_div_mean", "TF div mean", fmt=fmt_prob, tables=("summary",), tolerance=1e-3),
    _key("tf_reference"),
    MetricSpec(
        "first_div_median",
        "first div (median)",
        True,
        fmt=fmt_num1,
        gateable=True,
        compares=True,
        tables=_ALL,
        term="first div",
        definition="median first output index at which two cells differ, over the prompts that diverge",
    ),
    *_ROUTING_SPECS,
    MetricSpec("acc_mean", "acc", True, fmt=fmt_pct, gateable=True, tables=_ALL),
    _div(
        "acc_std",
        "acc std",
        fmt=fmt_pct,
        tables=_ALL,
        tolerance=0.02,
        definition="population standard deviation (ddof=0) of the cells' accuracies (Std@Acc)",
    ),
    MetricSpec("len_mean", "mean len"),
    _div(
        "len_std",
        "len std",
        tables=("summary",),
        definition="standard deviation of the output length across cells, averaged over prompts",
    ),
    MetricSpec("failed_cells", "failed cells", False, tables=_ALL, text=True, cell=_failed_cell),
    MetricSpec("pending_cells", "pending cells", False),
    _key("failed_cell_ids"),
    MetricSpec("emulated", "emulated TP"),
)

# `detaudit align` on MoE models (empty where either side records no routing): the routers of the
# rollout's forward vs the trainer's, and the trainer re-scored with the rollout's expert choices
# forced (routing replay), compared with the rollout like the plain trainer
_ALIGN_ROUTING_SPECS: tuple[MetricSpec, ...] = (
    MetricSpec(
        "router_disagree_frac",
        "routers disagree",
        False,
        fmt=fmt_share,
        gateable=True,
        definition="MoE models: share of routers (sampled token x MoE layer) whose expert set differs "
        "between the rollout's forward and the trainer's",
    ),
    MetricSpec(
        "tokens_router_disagree_frac",
        "tokens with a disagreeing router",
        False,
        fmt=fmt_share,
        gateable=True,
        definition="MoE models: share of sampled tokens with at least one such router",
    ),
    MetricSpec(
        "replay_bitwise_equal_frac",
        "replay bitwise equal",
        True,
        fmt=fmt_pct,
        gateable=True,
        definition="routing replay (the trainer forced to the rollout's expert choices): share of sampled "
        "tokens whose log-probability is bitwise equal to the rollout's",
    ),
    *(
        MetricSpec(
            f"replay_{n}",
            f"replay {n}",
            False,
            fmt=fmt_prob,
            gateable=True,
            definition=f"routing replay: the {how} |p_rollout - p_trainer| of the sampled tokens",
        )
        for n, how in (("dp_max", "largest"), ("dp_mean", "mean"))
    ),
    MetricSpec(
        "replay_kl",
        "replay kl",
        False,
        fmt=fmt_prob,
        gateable=True,
        definition="routing replay: sample estimate of KL(rollout || trainer)",
    ),
)

# `detaudit align` summary columns (one row per backend) that an `alignment:` policy may name
ALIGN_SPECS: tuple[MetricSpec, ...] = (
    MetricSpec("tokens", "tokens", True, gateable=True, definition="sampled tokens compared"),
    MetricSpec(
        "bitwise_equal_frac",
        "bitwise equal",
        True,
        fmt=fmt_pct,
        gateable=True,
        definition="share of sampled tokens whose fp32 log-probability is bitwise equal on both sides",
    ),
    *(MetricSpec(n, n, False, fmt=fmt_prob, gateable=True) for n in ("dp_max", "dp_mean", "dp_std")),
    MetricSpec("pearson", "pearson", True, fmt=fmt_prob, gateable=True),
    MetricSpec(
        "kl",
        "kl",
        False,
        fmt=fmt_prob,
        gateable=True,
        definition="sample estimate of KL(rollout || trainer) = mean(log p_r - log p_t)",
    ),
    *_ALIGN_ROUTING_SPECS,
)

ALIGN_ROUTING_COLUMNS = tuple(s.name for s in _ALIGN_ROUTING_SPECS)


def routing_legend(columns: Iterable[str]) -> list[str]:
    """`column: definition` of each routing column among `columns` (summary labels, or alignment column
    names): a console table shows them only for MoE models, whose short names need saying once."""
    columns = set(columns)
    out = [f"{s.label}: {s.definition}" for s in _ROUTING_SPECS if s.label in columns]
    return out + [f"{s.name}: {s.definition}" for s in _ALIGN_ROUTING_SPECS if s.name in columns]


_SETS = {"summary": SUMMARY_SPECS, "align": ALIGN_SPECS}


def _check(specs: tuple[MetricSpec, ...]) -> None:
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError(f"metric names defined twice: {sorted({n for n in names if names.count(n) > 1})}")
    for s in specs:
        if (s.gateable or s.tolerance is not None) and s.higher_is_better is None:
            raise ValueError(f"metric {s.name} is gateable but has no direction")
        if s.detail is not None and s.detail not in names:
            raise ValueError(f"metric {s.name}: its detail column {s.detail} is not defined")
        if any(t not in TABLES for t in s.tables):
            raise ValueError(f"metric {s.name}: unknown table in {s.tables} (known: {', '.join(TABLES)})")


for _specs in _SETS.values():
    _check(_specs)


# ---------------------------------------------------------------- lookups


def specs(kind: str = "summary") -> tuple[MetricSpec, ...]:
    """The specs of `kind` ("summary": `analyze`'s summary columns; "align": `detaudit align`'s)."""
    try:
        return _SETS[kind]
    except KeyError:
        raise DetauditError(f"unknown metric set {kind!r} (known: {', '.join(_SETS)})") from None


def summary_columns() -> list[str]:
    return [s.name for s in SUMMARY_SPECS]


def spec(name: str, kind: str = "summary") -> MetricSpec:
    for s in specs(kind):
        if s.name == name:
            return s
    raise DetauditError(f"unknown metric {name!r} (known: {', '.join(s.name for s in specs(kind))})")


def gateable(kind: str = "summary") -> dict[str, MetricSpec]:
    """name -> spec of the metrics a policy may name."""
    return {s.name: s for s in specs(kind) if s.gateable}


def default_tolerances() -> dict[str, float]:
    """Allowed worsening per metric against a baseline, when the policy names none."""
    return {s.name: s.tolerance for s in SUMMARY_SPECS if s.tolerance is not None}


def shown(table: str) -> list[MetricSpec]:
    """The summary columns a table shows, in order."""
    if table not in TABLES:
        raise DetauditError(f"unknown table {table!r} (known: {', '.join(TABLES)})")
    return [s for s in SUMMARY_SPECS if table in s.tables]


def visible(table: str, rows: Iterable[Mapping[str, Any]]) -> list[MetricSpec]:
    """The columns `table` shows for these summary rows: `shown`, less the `hide_empty` columns no row
    has a value of."""
    rows = list(rows)
    return [s for s in shown(table) if not s.hide_empty or _has_value(s, rows)]


def _has_value(s: MetricSpec, rows: list[Mapping[str, Any]]) -> bool:
    return any(not is_missing(r.get(s.name)) for r in rows)


def definitions(rows: Iterable[Mapping[str, Any]] | None = None) -> list[tuple[str, str]]:
    """(term, definition) of every summary metric that has one, in table order; given the summary rows,
    less the `hide_empty` metrics no row has a value of."""
    rows = None if rows is None else list(rows)
    return [
        (s.term or s.label, s.definition)
        for s in SUMMARY_SPECS
        if s.definition and (rows is None or not s.hide_empty or _has_value(s, rows))
    ]


def text_labels() -> set[str]:
    return {s.label for s in SUMMARY_SPECS if s.text}
