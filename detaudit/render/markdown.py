"""Markdown report: the published tables (rows: models, columns: backends, one block per suite),
the full summary, the cells, and how the run was made."""

from __future__ import annotations

from pathlib import Path
from typing import Collection, Sequence

from detaudit.analysis.analyze import Analysis
from detaudit.analysis.load_axis import load_table
from detaudit.analysis.metrics import definitions
from detaudit.analysis.spec_axis import speculative_summary, speculative_table
from detaudit.analysis.tp_axis import axis_table
from detaudit.render import (
    AXIS_NOTE,
    EMULATED_NOTE,
    LOAD_NOTE,
    SPECULATIVE_NOTE,
    axis_rows,
    cell_rows,
    command,
    headline_lines,
    is_text,
    load_rows,
    published_table,
    speculative_rows,
    speculative_summary_rows,
    summary_rows,
    warnings,
    write_file,
    yaml_dump,
)

PUBLISHED = (  # the published tables: (title, what it shows, summary column)
    (
        "Unique outputs per prompt",
        "Mean over prompts of the number of distinct outputs across the cells "
        "(1 = every configuration agreed on every prompt; at most the number of cells).",
        "unique_mean",
    ),
    (
        "Average max probability divergence (×1e-3)",
        "Top-5 probabilities, largest spread across the cells, mean "
        "over positions then prompts. `0` means exactly zero.",
        "maxprob_div_mean",
    ),
)


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]], text: Collection[str] = ()) -> str:
    """A GitHub table; text columns (the report's, and `text`) left-aligned, numbers right-aligned."""
    esc = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    align = ["---" if is_text(h) or h in text else "---:" for h in header]
    lines = ["| " + " | ".join(esc(h) for h in header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def render_markdown(analysis: Analysis) -> str:
    m = analysis.manifest
    cmd, recorded = command(m)
    pc = analysis.per_cell
    done = int((pc["state"] == "done").sum())
    out = [f"# detaudit report: {analysis.model}", ""]
    for w in warnings(analysis):
        head, _, rest = w.partition(": ")
        out += [f"> **{head}**: {rest}", ""]
    out += [
        f"- Run: `{analysis.run_dir}`" + (f", created {m.created}" if m.created else ""),
        f"- Command{'' if recorded else ' (reconstructed from the manifest)'}: `{cmd}`",
        f"- Cells: {done} done of {len(pc)}; suites: {', '.join(analysis.suites)}; "
        f"backends: {', '.join(analysis.backends)}",
        "",
    ]
    out += load_section(analysis)
    for title, blurb, metric in PUBLISHED:
        out += [f"## {title}", "", blurb, ""]
        for suite in analysis.suites:
            out += [f"### {suite}", "", md_table(*published_table(analysis, suite, metric)), ""]
    out += ["## Summary", "", md_table(*summary_rows(analysis)), ""]
    terms = definitions(analysis.summary.to_dict("records"))  # of the columns shown
    out += ["Definitions:", ""] + [f"- **{k}**: {v}" for k, v in terms] + [""]
    out += axis_section(analysis)
    out += speculative_section(analysis)
    out += ["## Cells", "", md_table(*cell_rows(analysis)), ""]
    if (pc["tp_mode"] == "emulated").any():
        out += [f"Cells labelled `emulated`: {EMULATED_NOTE}", ""]
    out += ["## Configuration", "", "```yaml", yaml_dump(m.config), "```", ""]
    if m.model:
        out += ["## Model", "", "```yaml", yaml_dump(m.model), "```", ""]
    out += ["## Environment", "", "```yaml", yaml_dump(m.environment), "```", ""]
    return "\n".join(out)


def load_section(analysis: Analysis) -> list[str]:
    """A server audit's headline and load table (nothing for other runs)."""
    heads = headline_lines(analysis)
    if not heads:
        return []
    out = ["## Load", ""] + [f"**{h}**" + ("  " if i < len(heads) - 1 else "") for i, h in enumerate(heads)]
    out += ["", LOAD_NOTE, ""]
    table = load_table(analysis)
    for suite in analysis.suites:
        out += [f"### {suite}", "", md_table(*load_rows(analysis, suite, table)), ""]
    return out


def axis_section(analysis: Analysis) -> list[str]:
    """The batch and TP axes apart (nothing for a run with one TP size and one batch size)."""
    table = axis_table(analysis)
    if not len(table):
        return []
    rows = md_table(*axis_rows(analysis, table))
    return ["## Batch and TP axes", "", AXIS_NOTE, "", rows, ""]


def speculative_section(analysis: Analysis) -> list[str]:
    """The speculative-decoding axis: per setting, then per cell (nothing for runs without it)."""
    table = speculative_table(analysis)
    if not len(table):
        return []
    out = ["## Speculative decoding", "", SPECULATIVE_NOTE, ""]
    out += [md_table(*speculative_summary_rows(analysis, speculative_summary(analysis, table))), ""]
    out += ["Per cell:", "", md_table(*speculative_rows(analysis, table)), ""]
    return out


def write_markdown(analysis: Analysis, path: str | Path) -> Path:
    return write_file(path, render_markdown(analysis))
