"""`detaudit analyze`, `report`, `gate`, `merge`: reading and combining run directories."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from detaudit.cli.common import JsonOpt, RunDirArg, err, handle_errors, out, print_json
from detaudit.errors import DetauditError


def analyze_and_report(run_dir: Path, formats, json_: bool):
    from detaudit.analyze import analyze as do_analyze
    from detaudit.render import render_summary, write_reports

    analysis = do_analyze(run_dir)
    if json_:
        print_json(analysis.summary.to_dict(orient="records"))
    else:
        for r in render_summary(analysis):  # table + "nothing to compare: ..." lines
            out.print(r)
    files = write_reports(analysis, run_dir, formats=formats)
    err.print("wrote " + ", ".join(str(f) for f in files))
    return analysis


@handle_errors
def analyze(
    run_dir: RunDirArg, json_: Annotated[bool, typer.Option("--json", help="Print the summary rows as JSON.")] = False
):
    """Metrics per (model, suite, backend): unique outputs, probability divergence, accuracy, ..."""
    analyze_and_report(run_dir, ("md", "csv"), json_)


@handle_errors
def report(
    run_dir: RunDirArg,
    format: Annotated[str, typer.Option("--format", help="Comma-separated: md, csv, html.")] = "md,csv,html",
    output_path: Annotated[
        Optional[Path], typer.Option("--output-path", "-o", help="Where to write (default: the run directory).")
    ] = None,
):
    """Write markdown / CSV / HTML reports (tables laid out like the published ones, plots)."""
    from detaudit.analyze import analyze as do_analyze
    from detaudit.config import parse_str_list
    from detaudit.render import FORMATS, write_reports

    formats = parse_str_list(format, "--format")
    bad = [f for f in formats if f not in FORMATS]
    if bad:
        raise DetauditError(f"--format {','.join(bad)}: choose among {', '.join(FORMATS)}")
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
    json_: JsonOpt = False,
):
    """Exit 0 when the run meets the policy, 1 when it does not (violations listed), 2 on bad input."""
    from detaudit.gate import gate as do_gate
    from detaudit.gate import render_result

    res = do_gate(run_dir, policy_path=policy, baseline_dir=baseline, allow_mismatch=allow_mismatch)
    if json_:
        print_json(res.to_dict())
    else:
        for r in render_result(res):  # table, "baseline differs: ...", notes, verdict
            out.print(r)
    raise typer.Exit(0 if res.passed else 1)


@handle_errors
def merge(
    run_dirs: Annotated[
        Optional[list[Path]], typer.Argument(help="Run directories to combine (e.g. the shards of one grid).")
    ] = None,
    output_path: Annotated[
        Optional[Path], typer.Option("--output-path", "-o", help="New run directory to write.")
    ] = None,
    allow_mixed_hardware: Annotated[
        bool, typer.Option("--allow-mixed-hardware", help="Merge runs from different hardware (the report says so).")
    ] = False,
):
    """Combine run directories; refuses different models, suites, decoding settings, code versions or
    numerics (a backend's cells computed differently)."""
    from detaudit.merge import merge_runs

    if not run_dirs:
        raise DetauditError("merge needs at least one run directory: detaudit merge RUN [RUN ...] -o OUT")
    if output_path is None:
        raise DetauditError("merge needs --output-path / -o: a new directory to write")
    merged = merge_runs(run_dirs, output_path, allow_mixed_hardware)
    done = len(merged.done_cells())
    out.print(f"merged {len(run_dirs)} run(s): {len(merged.cells)} cells ({done} done) -> {output_path}")
    if merged.mixed_hardware:
        err.print("[yellow]warning:[/] mixed hardware: " + " / ".join(merged.hardware_keys))
