"""Reports: files, the published table rows, failed / emulated / mixed-hardware labels, inline plots."""

from __future__ import annotations

import dataclasses
import re

import pandas as pd
import pytest
from rich.console import Console

from detaudit.analysis.analyze import analyze
from detaudit.analysis.metrics import fmt_div, fmt_unique
from detaudit.errors import DetauditError
from detaudit.render import command, render_summary, summary_rows, summary_table, write_reports
from detaudit.render.html import agreement_figure, divergence_figure
from detaudit.render.markdown import render_markdown

from .test_analyze import BF16, TBIK, diverging_bf16, invariant_cells, make_run, p32


@pytest.fixture(scope="module")
def audit(tmp_path_factory):
    path = tmp_path_factory.mktemp("report") / "run"
    return analyze(make_run(path, {**diverging_bf16(), **invariant_cells()}))


@pytest.fixture(scope="module")
def written(audit, tmp_path_factory):
    out = tmp_path_factory.mktemp("out")
    return out, write_reports(audit, out)


def expected_bf16_div() -> str:
    d0 = (p32(0.5) - p32(0.25)) / 3
    d1 = (p32(0.5) - p32(0.03125)) / 3
    return f"{(d0 + d1) / 2 * 1e3:.2f}"


def test_write_reports_creates_every_file(audit, written, tmp_path):
    out, paths = written
    names = {p.name for p in paths}
    assert {
        "report.md",
        "report.html",
        "summary.csv",
        "per_cell.csv",
        "per_prompt.csv",
        "agreement.csv",
        "divergence_by_position.csv",
        "unique_outputs.csv",
        "maxprob_div_x1e-3.csv",
    } <= names
    assert all(p.exists() and p.stat().st_size > 0 for p in paths)

    unique = pd.read_csv(out / "unique_outputs.csv")
    assert list(unique.columns) == ["suite", "model", "bf16", "bio+tbik"]
    assert unique.loc[0, "bf16"] == pytest.approx(5 / 3) and unique.loc[0, "bio+tbik"] == 1.0
    div = pd.read_csv(out / "maxprob_div_x1e-3.csv")
    assert div.loc[0, "bio+tbik"] == 0.0 and f"{div.loc[0, 'bf16']:.2f}" == expected_bf16_div()

    only_md = write_reports(audit, tmp_path / "md", formats=("md",))
    assert [p.name for p in only_md] == ["report.md"]


def test_markdown_published_tables(audit):
    md = render_markdown(audit)
    assert "## Unique outputs per prompt" in md and "### smoke" in md
    assert "| model | bf16 | bio+tbik |" in md
    assert "| tiny | 1.67 | 1 |" in md
    assert f"| tiny | {expected_bf16_div()} | 0 |" in md
    assert "## Average max probability divergence (×1e-3)" in md
    # full summary, cells, configuration, environment
    assert "| smoke | bf16 | 2 | 3 | 1.67 |" in md
    assert f"| {BF16[1]} | bf16 | 1 | 1 | real | done |" in md
    assert "```yaml" in md and "torch: '2.13'" in md
    assert "detaudit sweep --model tiny --suites smoke" in md
    assert "MIXED HARDWARE" not in md


def test_markdown_failed_emulated_mixed_hardware(tmp_path):
    cells = invariant_cells()
    run = make_run(
        tmp_path / "r",
        {**cells, BF16[1]: diverging_bf16()[BF16[1]]},
        states={BF16[2]: ("failed", "worker 1 ran out of memory")},
        tp_mode="emulated",
        manifest_extra={"mixed_hardware": True},
    )
    md = render_markdown(analyze(run))
    assert re.search(r"^> \*\*MIXED HARDWARE\*\*", md, flags=re.M)
    assert f"| {BF16[2]} | bf16 | 2 | 1 | emulated | FAILED: worker 1 ran out of memory |" in md
    assert f"| {TBIK[2]} | bio+tbik | 2 | 1 | emulated | done |" in md
    assert "cannot reproduce a ring all-reduce's order" in md
    assert "| smoke | bio+tbik (emulated) | 2 |" in md and "| smoke | bf16 | 1 |" in md  # only done cells count


def test_html_is_self_contained_with_plots(written):
    html = (written[0] / "report.html").read_text()
    imgs = re.findall(r'<img alt="([^"]+)" src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert {alt.rsplit(" ", 1)[0] for alt, _ in imgs} == {
        "agreement matrix",
        "divergence by position",
        "first divergence",
        "accuracy per cell",
    }
    assert all(len(data) > 1000 for _, data in imgs)
    assert "http://" not in html and "https://" not in html and "<script" not in html
    assert '<td class="l">tiny</td>' in html


def test_html_without_grades_skips_accuracy_plot(tmp_path):
    rows = [dict(r, correct=None) for r in invariant_cells(tf=False)[TBIK[1]]]
    run = make_run(tmp_path / "r", {TBIK[1]: rows, TBIK[2]: rows}, backends=("bio+tbik",))
    (path,) = write_reports(analyze(run), tmp_path / "o", formats=("html",))
    html = path.read_text()
    assert "No graded answers" in html and 'alt="accuracy per cell' not in html


def _overlapping_panels(fig) -> list[tuple[str, str]]:
    """Pairs of axes (colour bars included) whose drawn extents, tick labels and titles included, meet."""
    import itertools

    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    boxes = [(ax.get_title() or ax.get_label(), ax.get_tightbbox(canvas.get_renderer())) for ax in fig.axes]
    return [(a, b) for (a, ba), (b, bb) in itertools.combinations(boxes, 2) if ba.overlaps(bb)]


def test_no_panel_of_a_figure_overlaps_another(audit):
    """The agreement heatmaps' tick labels ran into the panel beside them (two cells per backend: the
    second panel's row labels over the first's matrix)."""
    from detaudit.render.html import accuracy_figure, first_div_figure

    for make in (agreement_figure, divergence_figure, first_div_figure, accuracy_figure):
        fig = make(audit, "smoke")
        assert fig is not None and _overlapping_panels(fig) == [], make.__name__


def test_no_divergence_is_said_not_plotted(tmp_path):
    """Every prompt agrees in every cell: no empty first-divergence axis, a sentence instead."""
    from detaudit.render.html import first_div_figure

    a = analyze(make_run(tmp_path / "r", invariant_cells(), backends=("bio+tbik",)))
    assert first_div_figure(a, "smoke") is None
    (path,) = write_reports(a, tmp_path / "o", formats=("html",))
    html = path.read_text()
    assert 'alt="first divergence' not in html and 'alt="agreement matrix' in html
    assert "First divergence: none. No prompt diverged: each of the 3 prompts compared" in html
    assert "Nothing to compare in this suite" not in html


def test_unknown_format_is_bad_input(audit, tmp_path):
    with pytest.raises(DetauditError, match="unknown report format 'pdf'"):
        write_reports(audit, tmp_path, formats=("md", "pdf"))


def test_summary_table_renders(audit):
    table = summary_table(audit)
    assert table.row_count == 2
    console = Console(record=True, width=250)
    console.print(table)
    text = console.export_text()
    assert "bio+tbik" in text and "1.67" in text


def test_formatting_never_rounds_to_exact():
    assert fmt_unique(1.0) == "1" and fmt_unique(1.001) == ">1.00" and fmt_unique(12.0) == "12.00"
    assert fmt_div(0.0) == "0" and fmt_div(1e-9) == "<0.01" and fmt_div(0.0153) == "15.30"
    assert fmt_unique(float("nan")) == "–"


def test_command_as_recorded(audit):
    assert command(audit.manifest) == ("detaudit sweep --model tiny --suites smoke", True)
    assert command(dataclasses.replace(audit.manifest, command="")) == ("(not recorded)", False)


def test_analyze_piped_output_keeps_table_columns_whole(audit, monkeypatch):
    """Piped into a CI log (no terminal, no COLUMNS) the summary table is laid out 160 columns wide:
    at rich's default 80 its headers folded into 4-character slivers."""
    import detaudit.cli.common as cli

    monkeypatch.delenv("COLUMNS", raising=False)
    assert not cli.out.is_terminal and cli.out.width == 160 and cli.err.width == 160
    monkeypatch.setenv("COLUMNS", "100")  # read at each use, not when the CLI was imported
    assert cli.out.width == 100 and cli.err.width == 100


# ---------------------------------------------------------------- a grid that compares nothing


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One TP size and one batch size: one cell per backend."""
    path = tmp_path_factory.mktemp("single") / "run"
    return analyze(make_run(path, {BF16[1]: diverging_bf16()[BF16[1]], TBIK[1]: invariant_cells()[TBIK[1]]}, tp=(1,)))


def test_single_cell_grid_says_nothing_to_compare(single, tmp_path):
    # the CLI summary: no "unique 1", a line saying why
    header, rows = summary_rows(single, "cli")
    assert [r[header.index("unique")] for r in rows] == ["–", "–"]
    console = Console(record=True, width=250)
    for r in render_summary(single):
        console.print(r)
    text = console.export_text()
    assert "nothing to compare: the grid has one TP size and one batch size" in text
    # markdown: a warning, and the published tables show no agreement
    md = render_markdown(single)
    assert "> **NOTHING TO COMPARE**: the grid has one TP size and one batch size" in md
    assert "| tiny | – | – |" in md and "| tiny | 1 | 1 |" not in md
    # HTML: the warning, no empty agreement / divergence / first-divergence plots, accuracy still plotted
    (path,) = write_reports(single, tmp_path, formats=("html",))
    html = path.read_text()
    assert "<b>NOTHING TO COMPARE</b>" in html and "Nothing to compare in this suite" in html
    alts = {alt.rsplit(" ", 1)[0] for alt in re.findall(r'<img alt="([^"]+)"', html)}
    assert alts == {"accuracy per cell"}
    assert agreement_figure(single, "smoke") is None and divergence_figure(single, "smoke") is None


def test_a_group_with_one_done_cell_is_named(tmp_path):
    run = make_run(
        tmp_path / "r", {**invariant_cells(), BF16[1]: diverging_bf16()[BF16[1]]}, states={BF16[2]: ("failed", "boom")}
    )
    a = analyze(run)
    header, rows = summary_rows(a)
    unique = {r[header.index("backend")]: r[header.index("unique")] for r in rows}
    assert unique == {"bf16": "–", "bio+tbik": "1"}
    md = render_markdown(a)
    assert "> **NOTHING TO COMPARE**: smoke/bf16: 1 of 2 cells done." in md
    fig = divergence_figure(a, "smoke")  # bio+tbik compared prompts: plotted, bf16 left out
    assert fig is not None and [line.get_label() for line in fig.axes[0].get_lines()] == ["bio+tbik"]


def test_full_grid_has_no_nothing_to_compare_note(audit):
    assert not any("nothing to compare" in n for n in audit.notes)
    assert "NOTHING TO COMPARE" not in render_markdown(audit)
    assert not any("nothing to compare" in str(r) for r in render_summary(audit))
