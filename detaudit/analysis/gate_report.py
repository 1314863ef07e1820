"""A gate verdict (`detaudit.analysis.gate.GateResult`) for people and CI: the terminal table (rich), a
markdown summary for a pull request or `$GITHUB_STEP_SUMMARY`, and a JUnit XML file (one test case
per check) for CI test reporters.

The markdown lists every check with its value and threshold, passed ones too; cells that are done are
counted per (suite, backend) in one row, a cell that is not gets a row of its own. The JUnit file holds
every check: a violation is a `<failure>`, a skipped optional rule `<skipped>`, a breach on a
report-only backend a passing case whose `<system-out>` says so.
"""

from __future__ import annotations

import os
import re
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path
from typing import Iterable

from rich.console import RenderableType
from rich.table import Table
from rich.text import Text

from detaudit.analysis.gate import FAIL, PASS, SKIP, WARN, Check, GateResult, fmt_value
from detaudit.errors import DetauditError
from detaudit.render.markdown import md_table

FORMATS = ("text", "markdown", "json")
REPORT_FILES = ("report.md", "report.html", "summary.csv", "per_cell.csv", "per_prompt.csv")
_MARK = {PASS: "✅ pass", FAIL: "❌ FAIL", WARN: "⚠️ warn", SKIP: "➖ skip"}


# ---------------------------------------------------------------- terminal


def violations_table(result: GateResult) -> Table:
    """Violations (red) and report-only warnings (yellow) as a rich table."""
    verdict = "[bold green]PASSED[/]" if result.passed else "[bold red]FAILED[/]"
    table = Table(
        title=f"detaudit gate: {verdict} ({len(result.violations)} violation(s), {result.checks} checks)",
        caption=f"policy: {result.policy.source}" if result.policy else None,
    )
    for col in ("", "suite", "backend", "metric", "value", "threshold", "reason"):
        table.add_column(col, overflow="fold")
    for status, style, rows in (("FAIL", "red", result.violations), ("warn", "yellow", result.warnings)):
        for v in rows:
            table.add_row(status, v.suite, v.backend, v.metric, fmt_value(v.value), v.threshold, v.reason, style=style)
    return table


def render_result(result: GateResult) -> list[RenderableType]:
    """What `detaudit gate` prints in text mode: the table, how the baseline differs, the notes, the verdict."""
    out: list[RenderableType] = [violations_table(result)]
    for m in result.mismatches:
        blocked = m.blocking and any(v.metric == "baseline" for v in result.violations)
        out.append(Text(f"baseline differs: {m}", style="red" if blocked else "yellow"))
    out += [Text(f"note: {n}", style="dim") for n in result.notes]
    out.append(
        Text.from_markup(
            "[green]gate passed[/]" if result.passed else f"[red]gate failed[/]: {len(result.violations)} violation(s)"
        )
    )
    return out


# ---------------------------------------------------------------- markdown


def _rows(results: Iterable[Check]) -> list[list[str]]:
    """One row per check; the done cells of a (suite, backend) folded into one row where they first appear."""
    done = Counter((c.suite, c.backend) for c in results if c.metric == "cell" and c.status == PASS)
    cells = Counter((c.suite, c.backend) for c in results if c.metric == "cell")
    rows, folded = [], set()
    for c in results:
        if c.metric == "cell" and c.status == PASS:
            key = (c.suite, c.backend)
            if key not in folded:
                folded.add(key)
                n = done[key]
                rows.append([_MARK[PASS], c.suite, c.backend, "cells done", f"{n} of {cells[key]}", "done", ""])
            continue
        rows.append([_MARK[c.status], c.suite, c.backend, c.metric, fmt_value(c.value), c.threshold, c.reason])
    return rows


def check_report_url(url: str) -> str:
    """`--report-url` goes into the markdown as a link target: an http(s) URL of printable characters
    without spaces (a line break or a parenthesis would end the link and let the rest be markdown)."""
    from urllib.parse import urlsplit

    shown = repr(_NOT_PRINTABLE.sub("?", url)[:80])
    if _NOT_PRINTABLE.search(url) or any(c in url for c in "()<>`"):
        raise DetauditError(
            f"--report-url {shown}: a URL holds no spaces, control or non-ASCII characters, parentheses, angle "
            "brackets or backticks (percent-encode them)"
        )
    try:
        parts = urlsplit(url)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("http", "https") or not parts.netloc:
        raise DetauditError(f"--report-url {shown}: expected an http(s)://HOST/... URL")
    return url


_NOT_PRINTABLE = re.compile(r"[^\x21-\x7e]|\s")


def _code(s: object) -> str:
    return "`" + str(s).replace("`", "'") + "`"


def gate_markdown(result: GateResult, report_url: str | None = None) -> str:
    """A pull-request summary: the verdict, every check with its value and threshold, how a baseline
    differs, the notes, and links to the report (`report_url`, and the report files of the run)."""
    verdict = "✅ PASSED" if result.passed else "❌ FAILED"
    facts = [f"{len(result.violations)} violation(s) of {result.checks} checks"]
    facts += [f"{len(result.warnings)} warning(s) on report-only backends"] if result.warnings else []
    facts += [f"policy {_code(result.policy.source)}"] if result.policy else []
    facts += [f"run {_code(result.run_dir)}"] if result.run_dir else []
    facts += [f"baseline {_code(result.baseline.run_dir)}"] if result.baseline else []
    out = [f"## detaudit gate: {verdict}", "", " · ".join(facts), ""]
    header = ["status", "suite", "backend", "check", "value", "threshold", "detail"]
    out += [md_table(header, _rows(result.results), text=set(header)), ""]
    if result.mismatches:
        out += ["**Baseline differs**", ""] + [
            f"- {m}" + (" (blocking)" if m.blocking else "") for m in result.mismatches
        ]
        out.append("")
    if result.notes:
        out += ["**Notes**", ""] + [f"- {n}" for n in result.notes] + [""]
    links = [f"[the report]({check_report_url(report_url)})"] if report_url else []
    if result.run_dir:
        links += [_code(Path(result.run_dir) / f) for f in REPORT_FILES if (Path(result.run_dir) / f).is_file()]
    if links:
        out += ["**Report**: " + ", ".join(links), ""]
    return "\n".join(out)


def append_step_summary(markdown: str, environ: dict[str, str] | os._Environ = os.environ) -> Path | None:
    """Append to the file `$GITHUB_STEP_SUMMARY` names (GitHub Actions' job summary), when it is set."""
    target = environ.get("GITHUB_STEP_SUMMARY")
    if not target:
        return None
    try:
        with open(target, "a", encoding="utf-8") as f:
            f.write(markdown.rstrip("\n") + "\n\n")
    except OSError as e:
        raise DetauditError(f"cannot append to $GITHUB_STEP_SUMMARY ({target}): {e.strerror}") from None
    return Path(target)


# ---------------------------------------------------------------- JUnit XML

_NOT_XML = re.compile("[^\u0009\u000a\u000d\u0020-\ud7ff\ue000-\ufffd\U00010000-\U0010ffff]")  # XML 1.0 chars


def _x(s: object) -> str:
    """Text XML 1.0 can hold (a control character from a suite or model name would make the file unreadable)."""
    return _NOT_XML.sub("?", str(s))


def _case_name(c: Check) -> str:
    if c.cell:
        return f"cell {c.cell}"
    return f"{c.metric} (baseline)" if c.threshold.startswith("baseline ") else c.metric


def render_junit(result: GateResult) -> bytes:
    """The checks as JUnit XML: `<testsuites>` holding one `<testsuite>`, one `<testcase>` per check
    (classname suite.backend, name the metric or the cell)."""
    counts = Counter(c.status for c in result.results)
    name = f"detaudit gate {result.run_dir or ''}".strip()
    totals = dict(tests=str(result.checks), failures=str(counts[FAIL]), errors="0")
    root = ET.Element("testsuites", name=_x(name), **totals)
    suite = ET.SubElement(root, "testsuite", name=_x(name), **totals, skipped=str(counts[SKIP]))
    props = ET.SubElement(suite, "properties")
    for key, value in (
        ("policy", result.policy.source if result.policy else None),
        ("run", result.run_dir),
        ("baseline", result.baseline.run_dir if result.baseline else None),
        ("verdict", "passed" if result.passed else "failed"),
    ):
        if value is not None:
            ET.SubElement(props, "property", name=key, value=_x(value))
    for c in result.results:
        case = ET.SubElement(suite, "testcase", classname=_x(f"{c.suite}.{c.backend}"), name=_x(_case_name(c)))
        detail = f"value {fmt_value(c.value)}, threshold {c.threshold}: {c.reason}"
        if c.status == FAIL:
            ET.SubElement(case, "failure", message=_x(c.reason), type="violation").text = _x(detail)
        elif c.status == SKIP:
            ET.SubElement(case, "skipped", message=_x(c.reason))
        elif c.status == WARN:
            ET.SubElement(case, "system-out").text = _x(f"report-only backend, not failing: {detail}")
    if result.notes:
        ET.SubElement(suite, "system-out").text = _x("\n".join(result.notes))
    ET.indent(root)
    return ET.tostring(root, encoding="utf-8", xml_declaration=True)


def write_junit(result: GateResult, path: str | os.PathLike) -> Path:
    """Written atomically (a CI reporter reading it meanwhile, or a full disk, never sees half a file)."""
    from detaudit.runs.rundir import atomic_write_bytes

    out = Path(path)
    if out.is_dir():
        raise DetauditError(f"cannot write --junit {out}: it is a directory")
    atomic_write_bytes(out, render_junit(result), parents=False, label="--junit ")
    return out
