"""`detaudit gate --format markdown` (also appended to $GITHUB_STEP_SUMMARY) and `--junit PATH`: every
check, passed ones too; the JUnit file validated with a real XML Schema processor (xmlschema)."""

from __future__ import annotations

import copy
import xml.etree.ElementTree as ET

import pytest
import xmlschema
from helpers import one_line_error
from typer.testing import CliRunner

from detaudit.analysis.gate import gate
from detaudit.analysis.gate_report import gate_markdown, render_junit
from detaudit.cli import app
from detaudit.render import write_reports

from .test_analyze import TBIK, diverging_bf16, invariant_cells, make_run

runner = CliRunner()

# The JUnit XML that CI test reporters read (Jenkins' xUnit plugin, GitHub's JUnit report actions), as
# this repository relies on it: a <testsuites> root of <testsuite>s with test, failure, error and skip
# counts, each <testcase> named and classed, holding at most failure / error / skipped and its output.
# Stricter than the reporters in places (counts are integers, a failure has a message): what detaudit
# writes must pass the stricter form.
JUNIT_XSD = """<?xml version="1.0" encoding="UTF-8"?>
<xs:schema xmlns:xs="http://www.w3.org/2001/XMLSchema" elementFormDefault="qualified">
  <xs:complexType name="outcome" mixed="true">
    <xs:attribute name="message" type="xs:string" use="required"/>
    <xs:attribute name="type" type="xs:string"/>
  </xs:complexType>
  <xs:complexType name="skip" mixed="true">
    <xs:attribute name="message" type="xs:string"/>
  </xs:complexType>
  <xs:element name="testsuites">
    <xs:complexType>
      <xs:sequence>
        <xs:element ref="testsuite" minOccurs="0" maxOccurs="unbounded"/>
      </xs:sequence>
      <xs:attribute name="name" type="xs:string"/>
      <xs:attribute name="tests" type="xs:nonNegativeInteger"/>
      <xs:attribute name="failures" type="xs:nonNegativeInteger"/>
      <xs:attribute name="errors" type="xs:nonNegativeInteger"/>
      <xs:attribute name="time" type="xs:decimal"/>
    </xs:complexType>
  </xs:element>
  <xs:element name="testsuite">
    <xs:complexType>
      <xs:sequence>
        <xs:element name="properties" minOccurs="0">
          <xs:complexType>
            <xs:sequence>
              <xs:element name="property" minOccurs="0" maxOccurs="unbounded">
                <xs:complexType>
                  <xs:attribute name="name" type="xs:string" use="required"/>
                  <xs:attribute name="value" type="xs:string" use="required"/>
                </xs:complexType>
              </xs:element>
            </xs:sequence>
          </xs:complexType>
        </xs:element>
        <xs:element name="testcase" minOccurs="0" maxOccurs="unbounded">
          <xs:complexType>
            <xs:sequence>
              <xs:choice minOccurs="0">
                <xs:element name="failure" type="outcome"/>
                <xs:element name="error" type="outcome"/>
                <xs:element name="skipped" type="skip"/>
              </xs:choice>
              <xs:element name="system-out" type="xs:string" minOccurs="0"/>
              <xs:element name="system-err" type="xs:string" minOccurs="0"/>
            </xs:sequence>
            <xs:attribute name="name" type="xs:string" use="required"/>
            <xs:attribute name="classname" type="xs:string" use="required"/>
            <xs:attribute name="time" type="xs:decimal"/>
          </xs:complexType>
        </xs:element>
        <xs:element name="system-out" type="xs:string" minOccurs="0"/>
        <xs:element name="system-err" type="xs:string" minOccurs="0"/>
      </xs:sequence>
      <xs:attribute name="name" type="xs:string" use="required"/>
      <xs:attribute name="tests" type="xs:nonNegativeInteger" use="required"/>
      <xs:attribute name="failures" type="xs:nonNegativeInteger" use="required"/>
      <xs:attribute name="errors" type="xs:nonNegativeInteger" use="required"/>
      <xs:attribute name="skipped" type="xs:nonNegativeInteger"/>
      <xs:attribute name="time" type="xs:decimal"/>
      <xs:attribute name="timestamp" type="xs:dateTime"/>
    </xs:complexType>
  </xs:element>
</xs:schema>
"""


@pytest.fixture(scope="module")
def schema() -> xmlschema.XMLSchema:
    return xmlschema.XMLSchema(JUNIT_XSD)


def failing_run(path):
    """bio+tbik cells that differ in one top-k id of one position (only the bitwise rule sees it)."""
    cells = {c: copy.deepcopy(rows) for c, rows in invariant_cells().items()}
    cells[TBIK[2]][2]["topk_ids"][1][4] = 77
    return make_run(path, {**diverging_bf16(), **cells})


def test_the_schema_check_can_fail(schema):
    ok = (
        b'<testsuites><testsuite name="s" tests="1" failures="0" errors="0">'
        b'<testcase name="a" classname="c"/></testsuite></testsuites>'
    )
    assert schema.is_valid(ok)
    for bad in (
        ok.replace(b' name="a"', b""),  # a test case without a name
        ok.replace(b'failures="0"', b'failures="none"'),
        ok.replace(b'<testcase name="a" classname="c"/>', b'<testcase name="a" classname="c"><failure/></testcase>'),
        ok.replace(b"<testsuites>", b"<testsuitez>").replace(b"</testsuites>", b"</testsuitez>"),
    ):
        assert not schema.is_valid(bad), bad


def test_markdown_lists_every_check_with_value_and_threshold(tmp_path):
    run = make_run(tmp_path / "r", {**diverging_bf16(), **invariant_cells()})
    write_reports(gate(run).analysis, run, formats=("md", "csv"))
    result = gate(run)
    md = gate_markdown(result, report_url="https://ci.example/run/7")
    assert md.startswith("## detaudit gate: ✅ PASSED\n")
    assert f"0 violation(s) of {result.checks} checks" in md and "policy `default (default-policy.yaml)`" in md
    for rule in ("bitwise_diff_records | 0 | <= 0", "unique_mean | 1 | <= 1", "cells | 2 | >= 2"):
        assert f"| ✅ pass | smoke | bio+tbik | {rule} |" in md, md
    assert "| ✅ pass | smoke | bf16 | cells done | 2 of 2 | done |" in md  # report-only: cell states only
    rows = [line for line in md.splitlines() if line.startswith(("| ✅", "| ❌", "| ➖"))]
    rules = len(result.policy.backends["bio+tbik"].rules)
    assert len(rows) == rules + 2  # every rule, and the done cells of each backend in one row
    assert "| ➖ skip | smoke | bio+tbik | routing_div |" in md  # optional, and a dense run has no value
    assert "[the report](https://ci.example/run/7)" in md and f"`{run / 'report.md'}`" in md
    assert "report-only backend bio is not in the run" in md


def test_markdown_of_a_failure_names_where(tmp_path):
    run = failing_run(tmp_path / "r")
    (run / "cells" / "smoke__bf16__tp2__bs1.parquet").unlink()
    md = gate_markdown(gate(run))
    assert md.startswith("## detaudit gate: ❌ FAILED\n") and "2 violation(s)" in md
    assert "| ❌ FAIL | smoke | bio+tbik | bitwise_diff_records | 1 | <= 0 | " in md
    assert f"{TBIK[2]} differs from {TBIK[1]}: topk_ids, prompt p2, position 1" in md
    assert "| ❌ FAIL | smoke | bf16 | cell | missing | done | cell smoke__bf16__tp2__bs1 is missing" in md
    assert "| ✅ pass | smoke | bf16 | cells done | 1 of 2 | done |" in md


def test_junit_one_case_per_check_and_schema_valid(tmp_path, schema):
    run = failing_run(tmp_path / "r")
    result = gate(run)
    xml = render_junit(result)
    schema.validate(xml)
    root = ET.fromstring(xml)
    (suite,) = root.findall("testsuite")
    cases = suite.findall("testcase")
    assert len(cases) == result.checks == int(suite.get("tests")) == int(root.get("tests"))
    failed = [c for c in cases if c.find("failure") is not None]
    assert len(failed) == len(result.violations) == int(suite.get("failures")) == 1
    assert (failed[0].get("classname"), failed[0].get("name")) == ("smoke.bio+tbik", "bitwise_diff_records")
    assert "topk_ids, prompt p2, position 1" in failed[0].find("failure").get("message")
    assert {c.get("name") for c in cases if c.get("classname") == "smoke.bf16"} == {
        "cell smoke__bf16__tp1__bs1",
        "cell smoke__bf16__tp2__bs1",
    }
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["verdict"] == "failed" and props["run"] == str(run)


def test_junit_skips_optional_rules_and_warns_on_report_only_backends(tmp_path, schema):
    policy = tmp_path / "p.yaml"
    policy.write_text(
        "backends:\n  bio+tbik:\n    teacher_forced_div_max: {max: 0, optional: true}\n"
        "  bf16: {report_only: true, unique_mean: {max: 1}}\n"
    )
    run = make_run(tmp_path / "r", {**diverging_bf16(), **invariant_cells(tf=False)})
    result = gate(run, policy)
    assert result.passed
    xml = render_junit(result)
    schema.validate(xml)
    root = ET.fromstring(xml)
    cases = {(c.get("classname"), c.get("name")): c for c in root.iter("testcase")}
    assert cases[("smoke.bio+tbik", "teacher_forced_div_max")].find("skipped") is not None
    warned = cases[("smoke.bf16", "unique_mean")]
    assert warned.find("failure") is None and "report-only" in warned.find("system-out").text
    # a warning is no failure: CI reads these counts (a passed gate with failures="1" reads as failed)
    assert [w.metric for w in result.warnings] == ["unique_mean"] and not result.violations
    (suite,) = root.findall("testsuite")
    assert root.get("failures") == suite.get("failures") == "0" and root.get("errors") == "0"
    assert suite.get("skipped") == str(len([c for c in result.results if c.status == "skip"])) != "0"
    assert int(suite.get("tests")) == len(cases) == result.checks


def test_cli_markdown_junit_and_step_summary(tmp_path, schema, monkeypatch):
    run = failing_run(tmp_path / "r")
    summary = tmp_path / "step-summary.md"
    summary.write_text("earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    junit = tmp_path / "gate.xml"
    res = runner.invoke(app, ["gate", str(run), "--format", "markdown", "--junit", str(junit)])
    assert res.exit_code == 1, res.output
    assert res.stdout.startswith("## detaudit gate: ❌ FAILED")
    schema.validate(junit.read_bytes())
    text = summary.read_text()
    assert text.startswith("earlier step\n## detaudit gate: ❌ FAILED") and res.stdout.strip() in text  # appended
    res = runner.invoke(app, ["gate", str(run), "--json"])  # any format: the summary is appended again
    assert res.exit_code == 1 and summary.read_text().count("## detaudit gate") == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--format", "html"], "--format html: choose among text, markdown, json"),
        (["--format", "markdown", "--json"], "--json and --format markdown: choose one"),
        (["--junit", "/nonexistent-dir/gate.xml"], "cannot write --junit /nonexistent-dir/gate.xml"),
    ],
)
def test_cli_bad_output_options_are_one_line(tmp_path, monkeypatch, args, message):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    run = make_run(tmp_path / "r", {**diverging_bf16(), **invariant_cells()})
    one_line_error(runner.invoke(app, ["gate", str(run), *args]), message)
