"""The audit detects what users report: under bf16, switching speculative decoding on changes the output.
A sweep of the embedded model over `--speculative off,ngram:4` on one `quote` prompt (change a constant
in a Python module and reply with the whole code: n-gram drafts are accepted), greedy, batch 1, 48 new
tokens: bf16's verify steps run 1 + k rows through oneDNN's GEMMs and PyTorch's attention where decode
runs one, the log-probabilities move at every position and, on the 2-core AVX-512 Xeon this was found on,
the greedy tokens change at position 32 (`detaudit/analysis/spec_axis.py` reports it); bio+tbik's
speculative cell is bitwise its plain cell."""

from __future__ import annotations

import warnings

import pytest
import yaml
from helpers import sweep_args
from typer.testing import CliRunner

from detaudit import paths
from detaudit.analysis.analyze import analyze
from detaudit.analysis.spec_axis import speculative_table
from detaudit.cli import app
from detaudit.inputs.suites import load_suite

pytestmark = pytest.mark.slow  # the embedded model

runner = CliRunner()


def test_bf16_speculation_changes_the_output_and_the_audit_reports_it(smollm, tmp_path, capsys):
    spec = yaml.safe_load((paths.builtin_suites_dir() / "quote.yaml").read_text())
    spec.update(task="retries", docs=[d for d in spec["docs"] if d["id"] == "retries"])
    suite = tmp_path / "retries.yaml"  # the quote suite's prompt, alone (the same text, so the same tokens)
    suite.write_text(yaml.safe_dump(spec))
    (doc,) = [p for p in load_suite("quote").prompts if p.id == "retries"]
    assert load_suite(str(suite)).prompts[0].text == doc.text
    out = tmp_path / "run"
    grid = sweep_args(suites=suite, limit=None, max_new_tokens=48, backends="bf16,bio+tbik", tp=1, batch_sizes=1)
    args = ["sweep", *grid, "--greedy", "--speculative", "off,ngram:4", "--output-path", str(out)]
    res = runner.invoke(app, [*args, "--no-analyze"])
    assert res.exit_code == 0, res.output
    a = analyze(out)
    summary = a.summary.set_index("backend")
    table = speculative_table(a).set_index("backend")
    assert summary.loc["bio+tbik", "spec_bitwise_diff_records"] == 0
    assert table.loc["bio+tbik", "outputs_differ"] == 0 and table.loc["bio+tbik", "accepted"] > 0
    # bf16: the verify steps' other shapes move the bits, which the audit reports (and the gate, bf16
    # being report-only, passes)
    assert summary.loc["bf16", "spec_bitwise_diff_records"] == 1 and table.loc["bf16", "maxprob_div_mean"] > 0
    assert runner.invoke(app, ["gate", str(out)]).exit_code == 0
    differ, first = table.loc["bf16", "outputs_differ"], table.loc["bf16", "first_div_min"]
    msg = f"bf16 with ngram:4: greedy tokens differ from plain decoding: {differ} of 1 (first at {first})"
    with capsys.disabled():
        print("\n" + msg)
    if not differ:  # the bits moved (asserted above); whether a token flips depends on the CPU's kernels
        warnings.warn(msg + ": no token flipped on this CPU (found on an AVX-512 Xeon at position 32)")
