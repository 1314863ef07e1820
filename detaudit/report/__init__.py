"""Reports of an analysis: Markdown, CSV and a self-contained HTML page (one writer each), plus the
rich summary table the CLI prints. The helpers here lay out the tables all writers share."""

from __future__ import annotations

import math
import numbers
import shlex
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd
from rich.table import Table

from detaudit.analyze import Analysis
from detaudit.errors import DetauditError
from detaudit.store import atomic_write_bytes

FORMATS = ("md", "csv", "html")
EMULATED_NOTE = (
    "Emulated TP computes each row-parallel layer as C shard partials in one process and reduces them "
    "the way the backend's all-reduce would; native emulation cannot reproduce a ring all-reduce's "
    "order, so emulated bf16 / bio cells may understate the divergence of a real multi-GPU run."
)
DEFINITIONS = [
    ("unique", "distinct output token sequences across the cells, per prompt, averaged over prompts "
               "(1 = every cell agreed on every prompt)"),
    ("max-prob div", "per output position, the largest spread (max - min over cells) of the top-5 "
                     "probabilities, rank by rank; mean over positions up to the shortest output, then "
                     "over prompts (prompts without a comparable position are left out); x1e-3"),
    ("prefix div", "the same, only before the first divergence"),
    ("TF div", "teacher forced: every cell scores one reference continuation; largest |p_cell - p_ref| "
               "(max) and its mean over positions, then prompts"),
    ("first div", "median first output index at which two cells differ, over the prompts that diverge"),
    ("acc std", "population standard deviation (ddof=0) of the cells' accuracies (Std@Acc)"),
    ("len std", "standard deviation of the output length across cells, averaged over prompts"),
]


# ---------------------------------------------------------------- formatting


def _nan(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v)) or v is pd.NA


def fmt_unique(v: Any) -> str:
    """'1' only when exactly 1; a value that rounds to 1.00 but is not 1 shows as '>1.00'."""
    if _nan(v):
        return "–"
    if v == 1:
        return "1"
    s = f"{v:.2f}"
    return ">1.00" if s == "1.00" else s


def fmt_div(v: Any, scale: float = 1e3) -> str:
    """'0' only when exactly 0; a tiny non-zero value shows as '<0.01', never as 0."""
    if _nan(v):
        return "–"
    if v == 0:
        return "0"
    s = f"{v * scale:.2f}"
    return "<0.01" if s == "0.00" else s


def fmt_prob(v: Any) -> str:
    if _nan(v):
        return "–"
    return "0" if v == 0 else f"{v:.3g}"


def fmt_num(v: Any, digits: int = 2) -> str:
    if _nan(v):
        return "–"
    if isinstance(v, (bool, np.bool_)):
        return "yes" if v else "no"
    if isinstance(v, numbers.Integral) or (isinstance(v, numbers.Real) and float(v).is_integer()):
        return str(int(v))
    if isinstance(v, numbers.Real):
        return f"{v:.{digits}f}"
    return str(v)


def fmt_pct(v: Any) -> str:
    return "–" if _nan(v) else f"{100 * v:.1f}%"


TEXT_COLUMNS = {"model", "suite", "backend", "cell", "TP mode", "state", "failed cells"}


def is_text(column: str) -> bool:
    """Text columns are left-aligned, numbers right-aligned."""
    return column in TEXT_COLUMNS


def cell_label(tp: Any, batch_size: Any) -> str:
    return f"tp{fmt_num(tp)}/bs{fmt_num(batch_size)}"


# ---------------------------------------------------------------- shared tables

Rows = tuple[list[str], list[list[str]]]


def published_table(analysis: Analysis, suite: str, metric: str) -> Rows:
    """Rows: models; columns: backends (the published layout), one table per suite."""
    fmt = fmt_unique if metric == "unique_mean" else fmt_div
    backends = analysis.backends
    s = analysis.summary[analysis.summary["suite"] == suite]
    rows = []
    for model in dict.fromkeys(s["model"]):
        by_backend = s[s["model"] == model].set_index("backend")
        rows.append([str(model)] + [fmt(by_backend.loc[b, metric]) if b in by_backend.index else "–"
                                    for b in backends])
    return ["model", *backends], rows


def published_frame(analysis: Analysis, metric: str, scale: float = 1.0) -> pd.DataFrame:
    """The published layout as numbers: suite, model, one column per backend."""
    s = analysis.summary
    wide = s.pivot_table(index=["suite", "model"], columns="backend", values=metric, aggfunc="first", dropna=False)
    wide = wide.reindex(columns=[b for b in analysis.backends if b in wide.columns]) * scale
    wide.columns.name = None
    return wide.reset_index()


def summary_rows(analysis: Analysis) -> Rows:
    header = ["suite", "backend", "cells", "prompts", "unique", "max-prob div ×1e-3", "prefix div ×1e-3",
              "TF div max", "TF div mean", "first div (median)", "identical prompts", "acc", "acc std",
              "len std", "failed cells"]
    rows = []
    for r in analysis.summary.to_dict("records"):
        parts = [f"{r['failed_cells']} ({r['failed_cell_ids']})"] if r["failed_cells"] else []
        parts += [f"{r['pending_cells']} pending"] if r["pending_cells"] else []
        failed = ", ".join(parts) or "0"
        rows.append([
            r["suite"], r["backend"] + (" (emulated)" if r["emulated"] else ""), fmt_num(r["cells"]),
            fmt_num(r["prompts"]), fmt_unique(r["unique_mean"]), fmt_div(r["maxprob_div_mean"]),
            fmt_div(r["prefix_div_mean"]), fmt_prob(r["teacher_forced_div_max"]),
            fmt_prob(r["teacher_forced_div_mean"]), fmt_num(r["first_div_median"], 1),
            f"{r['identical_prompts']}/{r['prompts']}", fmt_pct(r["acc_mean"]), fmt_pct(r["acc_std"]),
            fmt_num(r["len_std"]), failed,
        ])
    return header, rows


def cell_state(state: str, error: Any) -> str:
    if state == "done":
        return "done"
    label = {"failed": "FAILED", "missing": "MISSING"}.get(state, state.upper())
    return f"{label}: {error}" if not _nan(error) and error else label


def cell_rows(analysis: Analysis) -> Rows:
    header = ["cell", "backend", "TP", "batch", "TP mode", "state", "prompts", "acc", "mean len",
              "same as first cell", "wall s"]
    rows = []
    for c in analysis.per_cell.to_dict("records"):
        rows.append([
            c["cell_id"], str(c["backend"]), fmt_num(c["tp"]), fmt_num(c["batch_size"]), str(c["tp_mode"]),
            cell_state(c["state"], c["error"]), fmt_num(c["prompts"]), fmt_pct(c["acc"]),
            fmt_num(c["len_mean"], 1), fmt_pct(c["agree_ref"]), fmt_num(c["wall_s"], 1),
        ])
    return header, rows


def command(manifest: dict[str, Any]) -> tuple[str, bool]:
    """The command that produced the run (recorded, or reconstructed from the config: flag False)."""
    cmd = manifest.get("command")
    if isinstance(cmd, (list, tuple)) and cmd:
        return shlex.join(str(x) for x in cmd), True
    if isinstance(cmd, str) and cmd:
        return cmd, True
    c = manifest.get("config") or {}
    d = c.get("decoding") or {}
    join = lambda xs: ",".join(str(x) for x in xs)  # noqa: E731
    parts = ["detaudit", "sweep", "--model", str(c.get("model", "?"))]
    lists = (("--suites", "suites"), ("--backends", "backends"), ("--tp", "tp"), ("--batch-sizes", "batch_sizes"))
    for flag, key in lists:
        if c.get(key):
            parts += [flag, join(c[key])]
    scalars = (("--engine", "engine"), ("--device", "device"), ("--dtype", "dtype"), ("--tp-mode", "tp_mode"),
               ("--limit", "limit"))
    for flag, key in scalars:
        if c.get(key) is not None:
            parts += [flag, str(c[key])]
    if d.get("greedy"):
        parts.append("--greedy")
    else:
        for flag, key in (("--temperature", "temperature"), ("--top-p", "top_p"), ("--top-k", "top_k")):
            if key in d:
                parts += [flag, str(d[key])]
    for flag, key in (("--max-new-tokens", "max_new_tokens"), ("--seed", "seed")):
        if key in d:
            parts += [flag, str(d[key])]
    return shlex.join(parts), False


def warnings(analysis: Analysis) -> list[str]:
    """Prominent notes: mixed hardware, incomplete cells, emulated TP."""
    out = []
    m = analysis.manifest
    if m.get("mixed_hardware"):
        out.append("MIXED HARDWARE: the cells of this run were computed on different machines, so differences "
                   "may come from the hardware rather than from TP size, batch size or backend.")
    pc = analysis.per_cell
    bad = pc[pc["state"] != "done"]
    if len(bad):
        out.append(f"INCOMPLETE: {len(bad)} of {len(pc)} cells are not done "
                   f"({', '.join(f'{c} {s}' for c, s in zip(bad['cell_id'], bad['state']))}); "
                   "their backends are measured over fewer configurations.")
    if (pc["tp_mode"] == "emulated").any():
        out.append("EMULATED TP: " + EMULATED_NOTE)
    return out


def yaml_dump(obj: Any) -> str:
    import yaml

    return yaml.safe_dump(_plain(obj), sort_keys=False, default_flow_style=False, width=100).strip()


def _plain(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    return str(obj)


# ---------------------------------------------------------------- entry points


def write_file(path: str | Path, text: str) -> Path:
    """Atomic write, world-readable like any report file (the temporary file is created 0600)."""
    path = Path(path)
    atomic_write_bytes(path, text.encode())
    path.chmod(0o644)
    return path



def write_reports(analysis: Analysis, out_dir: str | Path, formats: Sequence[str] = FORMATS) -> list[Path]:
    """Write the requested formats into out_dir; returns the files written."""
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise DetauditError(f"unknown report format {unknown[0]!r}; known: {', '.join(FORMATS)}")
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise DetauditError(f"cannot create report directory {out}: {e.strerror}") from None
    written: list[Path] = []
    if "md" in formats:
        from detaudit.report.markdown import write_markdown

        written.append(write_markdown(analysis, out / "report.md"))
    if "csv" in formats:
        from detaudit.report.csv import write_csv

        written += write_csv(analysis, out)
    if "html" in formats:
        from detaudit.report.html import write_html

        written.append(write_html(analysis, out / "report.html"))
    return written


def summary_table(analysis: Analysis) -> Table:
    """The summary as a rich table (for `detaudit analyze`)."""
    table = Table(title=f"detaudit: {analysis.model}", caption="divergences ×1e-3; 0 and 1 are exact")
    header, rows = summary_rows(analysis)
    keep = [0, 1, 2, 3, 4, 5, 6, 7, 9, 11, 12, 14]
    for i in keep:
        table.add_column(header[i], justify="left" if is_text(header[i]) else "right", overflow="fold")
    for r, row in zip(analysis.summary.to_dict("records"), rows):
        invariant = r["cells"] >= 2 and r["unique_mean"] == 1 and r["maxprob_div_mean"] == 0
        style = "red" if r["failed_cells"] or r["pending_cells"] else ("green" if invariant else None)
        table.add_row(*[row[i] for i in keep], style=style)
    return table


__all__ = ["write_reports", "summary_table", "FORMATS"]
