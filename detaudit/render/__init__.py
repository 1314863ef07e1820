"""Reports of an analysis: Markdown, CSV and a self-contained HTML page (one writer each), plus the
rich summary table the CLI prints. The helpers here lay out the tables all writers share."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import pandas as pd
from rich.table import Table
from rich.text import Text

from detaudit.analysis.analyze import Analysis, nothing_to_compare
from detaudit.analysis.load_axis import cell_loads, headlines, load_table, repeats
from detaudit.analysis.metrics import (
    DASH,
    MIN_CELLS,
    fmt_div,
    fmt_num,
    fmt_pct,
    fmt_text,
    is_missing,
    routing_legend,
    spec,
    text_labels,
    visible,
)
from detaudit.analysis.spec_axis import speculative_summary, speculative_table
from detaudit.analysis.tp_axis import axis_table
from detaudit.config import speculative_of
from detaudit.errors import DetauditError
from detaudit.runs.manifest import Manifest
from detaudit.runs.rundir import atomic_write_bytes

FORMATS = ("md", "csv", "html")
EMULATED_NOTE = (
    "Emulated TP computes each row-parallel layer as C shard partials in one process and reduces them "
    "the way the backend's all-reduce would; native emulation cannot reproduce a ring all-reduce's "
    "order, so emulated bf16 / bio cells may understate the divergence of a real multi-GPU run."
)
CELL_TEXT_COLUMNS = {"model", "cell", "TP mode", "state", "configuration", "pattern", "setting"}
CELL_TEXT_COLUMNS |= {"axis", "at", "varied", "first difference"}


def is_text(column: str) -> bool:
    """Text columns are left-aligned, numbers right-aligned."""
    return column in CELL_TEXT_COLUMNS or column in text_labels()


def cell_label(tp: Any, batch_size: Any) -> str:
    return f"tp{fmt_num(tp)}/bs{fmt_num(batch_size)}"


def cell_labels(analysis: Analysis) -> dict[str, str]:
    """A short label per cell, unique within a (suite, backend): `tp1/bs8` (`tp1/bs8/ngram4` with a
    speculative setting); for a server audit its load (`c16/bg16 prefix`: concurrency, background load
    and its pattern)."""
    loads = cell_loads(analysis)
    out = {}
    for r in analysis.per_cell.to_dict("records"):
        cid = r["cell_id"]
        spec = speculative_of(cid)
        out[cid] = loads[cid].label if cid in loads else cell_label(r["tp"], r["batch_size"])
        out[cid] += f"/{spec}" if spec else ""
    return out


# ---------------------------------------------------------------- shared tables

Rows = tuple[list[str], list[list[str]]]


def published_table(analysis: Analysis, suite: str, metric: str) -> Rows:
    """Rows: models; columns: backends (the published layout), one table per suite."""
    render = spec(metric).render
    backends = analysis.backends
    s = analysis.summary[analysis.summary["suite"] == suite]
    rows = []
    for model in dict.fromkeys(s["model"]):
        by_backend = {r["backend"]: r for r in s[s["model"] == model].to_dict("records")}
        rows.append([str(model)] + [render(by_backend[b]) if b in by_backend else "–" for b in backends])
    return ["model", *backends], rows


def published_frame(analysis: Analysis, metric: str, scale: float = 1.0) -> pd.DataFrame:
    """The published layout as numbers: suite, model, one column per backend."""
    s = analysis.summary
    wide = s.pivot_table(index=["suite", "model"], columns="backend", values=metric, aggfunc="first", dropna=False)
    wide = wide.reindex(columns=[b for b in analysis.backends if b in wide.columns]) * scale
    wide.columns.name = None
    return wide.reset_index()


def summary_rows(analysis: Analysis, table: str = "summary") -> Rows:
    """The summary columns `table` shows (see `detaudit.analysis.metrics`; routing only where some row has it),
    one row per (suite, backend)."""
    records = analysis.summary.to_dict("records")
    columns = visible(table, records)
    rows = [[c.render(r) for c in columns] for r in records]
    return [c.label for c in columns], rows


def row_status(row: dict[str, Any]) -> str:
    """'bad': cells failed or pending; 'good': two or more cells, bitwise invariant; else ''."""
    if row["failed_cells"] or row["pending_cells"]:
        return "bad"
    invariant = row["cells"] >= MIN_CELLS and row["unique_mean"] == 1 and row["maxprob_div_mean"] == 0
    return "good" if invariant else ""


def cell_state(state: str, error: Any) -> str:
    if state == "done":
        return "done"
    label = {"failed": "FAILED", "missing": "MISSING"}.get(state, state.upper())
    return f"{label}: {error}" if not is_missing(error) and error else label


def cell_rows(analysis: Analysis) -> Rows:
    """One row per cell; a server audit's cells show their load (concurrency, background load, its
    pattern, repeats) where other runs show the batch size."""
    loads = cell_loads(analysis)
    load_header = ["concurrency", "background", "pattern", "repeats"] if loads else ["batch"]
    header = ["cell", "backend", "TP", *load_header, "TP mode", "state", "prompts", "acc", "mean len"]
    header += ["same as first cell", "wall s"]
    rows = []
    for c in analysis.per_cell.to_dict("records"):
        load = loads.get(c["cell_id"])
        if load is not None:
            coords = [fmt_num(load.concurrency), fmt_num(load.background), load.pattern or DASH]
            coords.append(fmt_num(repeats(analysis.manifest)))
        else:
            coords = [fmt_num(c["batch_size"])]
        rows.append(
            [
                c["cell_id"],
                str(c["backend"]),
                fmt_num(c["tp"]),
                *coords,
                str(c["tp_mode"]),
                cell_state(c["state"], c["error"]),
                fmt_num(c["prompts"]),
                fmt_pct(c["acc"]),
                fmt_num(c["len_mean"], 1),
                fmt_pct(c["agree_ref"]),
                fmt_num(c["wall_s"], 1),
            ]
        )
    return header, rows


LOAD_NOTE = (
    "Each load configuration against the sequential baseline (concurrency 1, no background load; else the "
    "least loaded cell), request by request: a request's completion against the baseline's first send of "
    "the same prompt. distinct: the most distinct completions of one prompt among the configuration's "
    "requests; bitwise as baseline: requests whose tokens, log-probabilities and top-5 probabilities are "
    "the baseline's exactly; differ: requests whose tokens are not; first divergence: the first position "
    "where they leave it (min / median); max-prob div: top-5 probabilities against the baseline's (mean "
    "over positions and requests / largest at any position); max |Δ logprob|: a generated token's "
    "log-probability against the baseline's, before the first divergence."
)


def load_rows(analysis: Analysis, suite: str, table: pd.DataFrame | None = None) -> Rows:
    """The load table of one suite (all backends), one row per configuration."""
    t = load_table(analysis) if table is None else table
    t = t[t["suite"] == suite]
    backends = len(set(t["backend"])) > 1
    header = ["backend"] if backends else []
    header += ["configuration", "concurrency", "background", "pattern", "repeats", "requests"]
    header += ["distinct (max per prompt)", "bitwise as baseline", "differ from baseline"]
    header += ["first divergence (min / median)"]
    header += ["max-prob div ×1e-3 (mean / max)", "max |Δ logprob|"]
    rows = []
    for r in t.to_dict("records"):
        first = DASH if not r["differ"] else f"{fmt_num(r['first_div_min'])} / {fmt_num(r['first_div_median'], 1)}"
        row = [str(r["backend"])] if backends else []
        row += [
            r["label"] + (" (baseline)" if r["baseline"] else ""),
            fmt_num(r["concurrency"]),
            fmt_num(r["background"]),
            fmt_text(r["pattern"]),
            fmt_num(r["repeats"]),
            fmt_num(r["requests"]),
            fmt_num(r["distinct_max"]),
            f"{r['identical']}/{r['compared']}" if r["compared"] else DASH,
            f"{r['differ']}/{r['compared']}" if r["compared"] else DASH,
            first,
            f"{fmt_div(r['maxprob_div_mean'])} / {fmt_div(r['maxprob_div_max'])}",
            DASH if is_missing(r["logprob_diff_max"]) else f"{r['logprob_diff_max']:.3g}",
        ]
        rows.append(row)
    return header, rows


SPECULATIVE_NOTE = (
    "Each speculative cell against the plain cell of the same TP size and batch size (speculation off), "
    "record by record. unique: per prompt and TP x batch, the distinct outputs of the two cells, averaged "
    "(1 = speculation changed no output); bitwise as plain: records whose every recorded number (token ids, "
    "log-probabilities, top-k) is the plain cell's exactly; outputs differ: records whose tokens are not; "
    "first divergence: the median position where they leave the plain output; max-prob div: top-5 "
    "probabilities against the plain cell's (mean over positions, records, cells); acceptance: draft tokens "
    "accepted / proposed; speed-up: output tokens per second of generation against the plain cells'."
)


def _suite_first(t: pd.DataFrame, header: list[str], rows: list[list[str]]) -> Rows:
    """`header` and `rows` (one per row of `t`, in order) with `t`'s suite as their first column where `t`
    spans several suites (one suite: the report's heading names it)."""
    if len(set(t["suite"])) <= 1:
        return header, rows
    return ["suite", *header], [[str(suite), *row] for suite, row in zip(t["suite"], rows)]


def speculative_summary_rows(analysis: Analysis, summary: pd.DataFrame | None = None) -> Rows:
    """One row per (suite, backend, speculative setting): the setting's cells against the plain ones."""
    t = speculative_summary(analysis) if summary is None else summary
    header = ["backend", "setting", "cells", "unique", "bitwise as plain"]
    header += ["outputs differ", "first div (median)", "max-prob div ×1e-3", "acceptance", "speed-up"]
    rows = []
    for r in t.to_dict("records"):
        total = _sum(r["identical"], r["records_differ"])
        rows.append(
            [
                str(r["backend"]),
                str(r["setting"]),
                fmt_num(r["cells"]),
                spec("unique_mean").fmt(r["unique_mean"]),
                DASH if is_missing(r["identical"]) else f"{r['identical']}/{total}",
                fmt_num(r["outputs_differ"]),
                fmt_num(r["first_div_median"], 1),
                fmt_div(r["maxprob_div_mean"]),
                fmt_pct(r["acceptance"]),
                _fmt_speedup(r["speedup"]),
            ]
        )
    return _suite_first(t, header, rows)


AXIS_NOTE = (
    "Which axis moved the records. batch rows: at one TP size, each cell against the cell of the smallest "
    "batch size; TP rows: at one batch size, each cell against the cell of the smallest TP size (done cells "
    "only, speculation off, one configuration each). records differ: records not bitwise equal to the "
    "reference cell's in some recorded number, of those compared; outputs differ: those whose tokens differ; "
    "unique: distinct outputs per prompt across the row's cells, mean over prompts (1 = the axis changed no "
    "output)."
)


def axis_rows(analysis: Analysis, table: pd.DataFrame | None = None) -> Rows:
    """One row per (suite, backend, fixed TP size or batch size) along the other axis."""
    t = axis_table(analysis) if table is None else table
    header = ["backend", "axis", "at", "varied", "cells", "records differ", "outputs differ", "unique"]
    header += ["first difference"]
    rows = []
    for r in t.to_dict("records"):
        compared = r["compared"]
        rows.append(
            [str(r["backend"]), str(r["axis"]), str(r["fixed"]), str(r["varied"]), fmt_num(r["cells"])]
            + [f"{r['records_differ']}/{compared}", f"{r['outputs_differ']}/{compared}"]
            + [spec("unique_mean").fmt(r["unique_mean"]), r["first_diff"] or DASH]
        )
    return _suite_first(t, header, rows)


def axis_lines(analysis: Analysis, table: pd.DataFrame | None = None) -> list[str]:
    """The axes table in a line per (suite, backend), for the terminal: along which axis the records moved
    (`axes.csv` has the rows). Empty for a run with one TP size and one batch size."""
    t = axis_table(analysis) if table is None else table
    suites = len(set(t["suite"])) > 1
    lines = []
    for (suite, backend), sub in t.groupby(["suite", "backend"], sort=False):
        parts = []
        for axis, size, other in (("batch", "batch size", "TP size"), ("TP", "TP size", "batch size")):
            rows = sub[sub["axis"] == axis]
            if not len(rows):
                continue
            moved = rows[rows["records_differ"] > 0]
            if not len(moved):
                parts.append(f"bitwise across {size}s at every {other}")
            else:
                parts.append(f"the {size} moves records at " + ", ".join(moved["fixed"]))
        lines.append(f"{suite + ' ' if suites else ''}{backend}: " + "; ".join(parts))
    return lines


def speculative_rows(analysis: Analysis, table: pd.DataFrame | None = None) -> Rows:
    """One row per speculative cell against its plain cell."""
    t = speculative_table(analysis) if table is None else table
    header = ["cell", "backend", "TP", "batch", "setting", "bitwise as plain", "outputs differ"]
    header += ["first divergence (min / median)", "max-prob div ×1e-3", "drafted", "acceptance"]
    header += ["tokens/s", "plain tokens/s", "speed-up"]
    rows = []
    for r in t.to_dict("records"):
        first = (
            DASH if not r["outputs_differ"] else f"{fmt_num(r['first_div_min'])} / {fmt_num(r['first_div_median'], 1)}"
        )
        rows.append(
            [
                str(r["cell_id"]),
                str(r["backend"]),
                fmt_num(r["tp"]),
                fmt_num(r["batch_size"]),
                str(r["setting"]),
                DASH if is_missing(r["identical"]) else f"{r['identical']}/{r['compared']}",
                f"{r['outputs_differ']}/{r['compared']}",
                first,
                fmt_div(r["maxprob_div_mean"]),
                fmt_num(r["drafted"]),
                fmt_pct(r["acceptance"]),
                fmt_num(r["tokens_per_s"], 1),
                fmt_num(r["plain_tokens_per_s"], 1),
                _fmt_speedup(r["speedup"]),
            ]
        )
    return header, rows


def _sum(*values: Any) -> int:
    return sum(int(v) for v in values if not is_missing(v))


def _fmt_speedup(v: Any) -> str:
    return DASH if is_missing(v) else f"{v:.2f}x"


def headline_lines(analysis: Analysis) -> list[str]:
    """`suite / backend: N requests, K distinct completions ...` per group of a server audit."""
    return [f"{h['suite']} / {h['backend']}: {h['text']}" for h in headlines(analysis)]


def command(manifest: Manifest) -> tuple[str, bool]:
    """The command that produced the run, as recorded (False when the manifest has none)."""
    return (manifest.command, True) if manifest.command else ("(not recorded)", False)


def warnings(analysis: Analysis) -> list[str]:
    """Prominent notes: mixed hardware, incomplete cells, emulated TP, nothing to compare."""
    out = []
    m = analysis.manifest
    if m.mixed_hardware:
        out.append(
            "MIXED HARDWARE: the cells of this run were computed on different machines, so differences "
            "may come from the hardware rather than from TP size, batch size or backend."
        )
    pc = analysis.per_cell
    bad = pc[pc["state"] != "done"]
    if len(bad):
        out.append(
            f"INCOMPLETE: {len(bad)} of {len(pc)} cells are not done "
            f"({', '.join(f'{c} {s}' for c, s in zip(bad['cell_id'], bad['state']))}); "
            "their backends are measured over fewer configurations."
        )
    if (pc["tp_mode"] == "emulated").any():
        out.append("EMULATED TP: " + EMULATED_NOTE)
    uncompared = nothing_to_compare(analysis.summary, pc)
    if uncompared:
        out.append("NOTHING TO COMPARE: " + uncompared)
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
    """Atomic write, with the mode the umask gives (as every run directory file)."""
    path = Path(path)
    atomic_write_bytes(path, text.encode())
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
        from detaudit.render.markdown import write_markdown

        written.append(write_markdown(analysis, out / "report.md"))
    if "csv" in formats:
        from detaudit.render.csv import write_csv

        written += write_csv(analysis, out)
    if "html" in formats:
        from detaudit.render.html import write_html

        written.append(write_html(analysis, out / "report.html"))
    return written


def summary_table(analysis: Analysis) -> Table:
    """The summary as a rich table (for `detaudit analyze`)."""
    table = Table(title=f"detaudit: {analysis.model}", caption="divergences ×1e-3; 0 and 1 are exact")
    header, rows = summary_rows(analysis, "cli")
    for h in header:
        table.add_column(h, justify="left" if is_text(h) else "right", overflow="fold")
    styles = {"bad": "red", "good": "green"}
    for r, row in zip(analysis.summary.to_dict("records"), rows):
        table.add_row(*row, style=styles.get(row_status(r)))
    return table


def render_summary(analysis: Analysis) -> list[Table | Text]:
    """What `detaudit analyze` prints: the summary table, a server audit's headline and load table, a line
    per backend on the batch and TP axes, then a line when a group compares nothing."""
    uncompared = nothing_to_compare(analysis.summary, analysis.per_cell)
    out: list[Table | Text] = [summary_table(analysis)]
    legend = routing_legend(summary_rows(analysis, "cli")[0])  # MoE models: what the routing columns mean
    out += [Text(line, style="dim") for line in legend]
    heads = headline_lines(analysis)
    if heads:
        out += [Text(h, style="bold") for h in heads]
        table = load_table(analysis)
        for suite in analysis.suites:
            header, rows = load_rows(analysis, suite, table)
            t = Table(title=f"load: {suite} (against the sequential baseline)")
            for h in header:
                t.add_column(h, justify="left" if is_text(h) else "right", overflow="fold")
            for row in rows:
                t.add_row(*row)
            out.append(t)
    axes = axis_lines(analysis)
    if axes:
        out.append(Text("batch and TP axes (each cell against the smallest batch / TP size; the report's axes.csv):"))
        out += [Text("  " + line, style="dim") for line in axes]
    spec_summary = speculative_summary(analysis)
    if len(spec_summary):
        header, rows = speculative_summary_rows(analysis, spec_summary)
        t = Table(title="speculative decoding (against the plain cells of the same TP and batch size)")
        for h in header:
            t.add_column(h, justify="left" if is_text(h) else "right", overflow="fold")
        for row in rows:
            t.add_row(*row)
        out.append(t)
    return out + ([Text("nothing to compare: " + uncompared, style="bold yellow")] if uncompared else [])


__all__ = ["write_reports", "summary_table", "render_summary", "FORMATS"]
