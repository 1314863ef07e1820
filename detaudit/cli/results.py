"""`detaudit analyze`, `report`, `gate`, `merge`, `diff`: reading, combining and comparing run directories."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from detaudit.cli.common import JsonOpt, RunDirArg, err, handle_errors, out, out_path, print_json
from detaudit.errors import DetauditError


def analyze_and_report(run_dir: Path, formats, json_: bool, output_path: Optional[Path] = None, show: bool = True):
    """Print the summary (unless not `show`: a caller printing its own JSON), then write the report files
    into `output_path` (default: the run directory; a read-only one, e.g. a downloaded CI artifact, is only
    printed, and a note says so)."""
    from detaudit.analysis.analyze import analyze as do_analyze
    from detaudit.render import render_summary, write_reports
    from detaudit.runs.rundir import unwritable

    analysis = do_analyze(run_dir)
    if not show:
        pass
    elif json_:
        print_json(analysis.summary.to_dict(orient="records"))
    else:
        for r in render_summary(analysis):  # table + "nothing to compare: ..." lines
            out.print(r)
    why = unwritable(run_dir) if output_path is None else None
    if why:
        err.print(
            f"[yellow]note:[/] report files not written: {run_dir} is read-only ({why}); -o DIR writes them there"
        )
        return analysis
    files = write_reports(analysis, output_path or run_dir, formats=formats)
    err.print("wrote " + ", ".join(str(f) for f in files))
    return analysis


@handle_errors
def analyze(
    run_dir: RunDirArg,
    json_: Annotated[bool, typer.Option("--json", help="Print the summary rows as JSON.")] = False,
    output_path: Annotated[
        Optional[Path],
        typer.Option(
            "--output-path",
            "-o",
            help="Where to write report.md and the CSVs (default: the run directory).",
            parser=out_path,
            metavar="DIR",
        ),
    ] = None,
):
    """Metrics per (model, suite, backend): unique outputs, probability divergence, accuracy, ...
    A read-only run directory is analysed and printed; its report files go to -o, if given."""
    analyze_and_report(run_dir, ("md", "csv"), json_, output_path)


@handle_errors
def report(
    run_dir: RunDirArg,
    format: Annotated[str, typer.Option("--format", help="Comma-separated: md, csv, html.")] = "md,csv,html",
    output_path: Annotated[
        Optional[Path],
        typer.Option(
            "--output-path", "-o", help="Where to write (default: the run directory).", parser=out_path, metavar="DIR"
        ),
    ] = None,
):
    """Write markdown / CSV / HTML reports (tables laid out like the published ones, plots)."""
    from detaudit.analysis.analyze import analyze as do_analyze
    from detaudit.config import parse_str_list
    from detaudit.render import FORMATS, write_reports
    from detaudit.runs.rundir import RunDir, unwritable

    formats = parse_str_list(format, "--format")
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise DetauditError(f"--format {','.join(bad)}: choose among {', '.join(FORMATS)}")
    why = unwritable(run_dir) if output_path is None and RunDir(run_dir).exists() else None
    if why:
        raise DetauditError(f"cannot write the reports into {run_dir} ({why}): pass -o DIR to write them elsewhere")
    for f in write_reports(do_analyze(run_dir), output_path or run_dir, formats=formats):
        out.print(str(f))


@handle_errors
def gate(
    run_dir: RunDirArg,
    policy: Annotated[
        Optional[Path], typer.Option("--policy", help="Policy YAML (default: bio+tbik must be bitwise invariant).")
    ] = None,
    baseline: Annotated[
        Optional[Path],
        typer.Option("--baseline", help="Fail when a metric is worse than this run's by more than its tolerance."),
    ] = None,
    allow_mismatch: Annotated[
        bool,
        typer.Option(
            "--allow-mismatch",
            help="Compare with a --baseline of another model or suite anyway (the differences are still listed).",
        ),
    ] = False,
    format: Annotated[
        str,
        typer.Option(
            "--format",
            help="text (a table), markdown (every check, for a pull request) or json. The markdown summary is "
            "also appended to $GITHUB_STEP_SUMMARY when it is set, whatever the format.",
        ),
    ] = "text",
    junit: Annotated[
        Optional[Path],
        typer.Option(
            "--junit",
            help="Also write the checks as JUnit XML (one test case per check).",
            parser=out_path,
            metavar="FILE",
        ),
    ] = None,
    report_url: Annotated[
        Optional[str],
        typer.Option(
            "--report-url", help="Where the report is published (e.g. the CI run's page): linked from the markdown."
        ),
    ] = None,
    json_: JsonOpt = False,
):
    """Exit 0 when the run meets the policy, 1 when it does not (violations listed), 2 on bad input."""
    from detaudit.analysis.gate import gate as do_gate
    from detaudit.analysis.gate_report import (
        FORMATS,
        append_step_summary,
        check_report_url,
        gate_markdown,
        render_result,
        write_junit,
    )

    if format not in FORMATS:
        raise DetauditError(f"--format {format}: choose among {', '.join(FORMATS)}")
    if json_ and format not in ("text", "json"):
        raise DetauditError(f"--json and --format {format}: choose one")
    if allow_mismatch and baseline is None:
        raise DetauditError("--allow-mismatch applies to a --baseline run: give one, or drop --allow-mismatch")
    if report_url is not None:
        check_report_url(report_url)
    fmt = "json" if json_ else format
    res = do_gate(run_dir, policy_path=policy, baseline_dir=baseline, allow_mismatch=allow_mismatch)
    markdown = gate_markdown(res, report_url)
    # the files first: one that cannot be written is bad input, reported alone
    written = [write_junit(res, junit)] if junit is not None else []
    summary = append_step_summary(markdown)
    if fmt == "json":
        print_json(res.to_dict())
    elif fmt == "markdown":
        sys.stdout.write(markdown + "\n")
    else:
        for r in render_result(res):  # table, "baseline differs: ...", notes, verdict
            out.print(r)
    for f in written:
        err.print(f"wrote {f}")
    if summary is not None:
        err.print(f"appended the summary to {summary}")
    raise typer.Exit(0 if res.passed else 1)


@handle_errors
def merge(
    run_dirs: Annotated[
        Optional[list[Path]], typer.Argument(help="Run directories to combine (e.g. the shards of one grid).")
    ] = None,
    output_path: Annotated[
        Optional[Path],
        typer.Option("--output-path", "-o", help="New run directory to write.", parser=out_path, metavar="DIR"),
    ] = None,
    allow_mixed_hardware: Annotated[
        bool, typer.Option("--allow-mixed-hardware", help="Merge runs from different hardware (the report says so).")
    ] = False,
):
    """Combine run directories; refuses different models, suites, decoding settings, code versions or
    numerics (a backend's cells computed differently)."""
    from detaudit.runs.merge import merge_runs

    if not run_dirs:
        raise DetauditError("merge needs at least one run directory: detaudit merge RUN [RUN ...] -o OUT")
    if output_path is None:
        raise DetauditError("merge needs --output-path / -o: a new directory to write")
    merged = merge_runs(run_dirs, output_path, allow_mixed_hardware)
    done = len(merged.done_cells())
    out.print(f"merged {len(run_dirs)} run(s): {len(merged.cells)} cells ({done} done) -> {output_path}")
    if merged.mixed_hardware:
        err.print("[yellow]warning:[/] mixed hardware: " + " / ".join(merged.hardware_keys))


@handle_errors
def diff(
    run_a: Annotated[Path, typer.Argument(metavar="RUN_A", help="Run directory A (e.g. before an upgrade).")],
    run_b: Annotated[Path, typer.Argument(metavar="RUN_B", help="Run directory B (e.g. after it).")],
    json_: JsonOpt = False,
):
    """Compare two runs cell by cell, bitwise: exit 0 when every cell completed in both is equal, 1 when
    any differs (first differing field, prompt and position listed), 2 on bad input."""
    from detaudit.analysis.diff import diff_runs

    result = diff_runs(run_a, run_b)
    if json_:
        print_json(result.to_dict())
    else:
        sys.stdout.write(render_diff(result))
    raise typer.Exit(0 if result.equal else 1)


def render_diff(result) -> str:
    """The comparison as markdown: manifest differences, then one row per cell, then the verdict."""
    from detaudit.analysis.metrics import DASH, fmt_div, fmt_num
    from detaudit.render.markdown import md_table

    def value(v) -> str:
        s = v if isinstance(v, str) else json.dumps(v, default=str)
        return s if len(s) <= 80 else s[:77] + "..."

    def where(d) -> str:
        return DASH if d is None else str(d)

    lines = [f"A: {result.a}", f"B: {result.b}", "", "## Manifest differences", ""]
    if result.manifest:
        rows = [[f, value(a), value(b)] for f, a, b in result.manifest]
        lines.append(md_table(["field", "A", "B"], rows, text={"field", "A", "B"}))
    else:
        lines.append("None in the compared fields.")
    header = [
        "cell",
        "status",
        "prompts",
        "records differing",
        "outputs differing",
        "first divergence",
        "max-prob div ×1e-3",
        "first difference",
    ]
    rows = [
        [c.cell, c.status]
        + (
            [str(c.prompts), str(c.records_differ), str(c.outputs_differ), fmt_num(c.first_divergence)]
            + [fmt_div(c.maxprob_div), where(c.first_difference)]
            if c.status in ("equal", "differs")
            else [DASH] * 6
        )
        for c in result.cells
    ]
    lines += ["", "## Cells", "", md_table(header, rows, text={"status", "first difference"}), ""]
    compared, differ = result.compared, [c for c in result.compared if c.status == "differs"]
    single = len(result.cells) - len(compared)
    verdict = f"{len(compared) - len(differ)} of {len(compared)} cells completed in both runs are bitwise equal"
    verdict += f", {len(differ)} differ{'s' if len(differ) == 1 else ''}" if differ else ""
    verdict += f"; {single} cell(s) completed in one run only" if single else ""
    return "\n".join(lines + [verdict + ".", ""])
