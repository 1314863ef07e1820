"""Gate: default policy, custom policies, incomplete runs, bad input, baseline regressions."""

from __future__ import annotations

import json

import pytest
from helpers import one_line_error
from rich.console import Console
from typer.testing import CliRunner

from detaudit.analysis.gate import gate, load_policy
from detaudit.analysis.gate_report import render_result, violations_table
from detaudit.cli import app
from detaudit.errors import DetauditError

from .record_flips import CELLS3, FLIPS, LAST, TP3, moe_cells3
from .test_analyze import BF16, TBIK, diverging_bf16, invariant_cells, make_run


def as_tbik(cells: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """The diverging bf16 records, filed under the bio+tbik cells."""
    return {TBIK[1]: cells[BF16[1]], TBIK[2]: cells[BF16[2]]}


def metrics(result) -> set[tuple[str, str]]:
    return {(v.backend, v.metric) for v in result.violations}


def write(tmp_path, text: str, name: str = "policy.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_default_policy_loads_from_package_data():
    policy = load_policy()
    assert policy.source.startswith("default")
    tbik = policy.backends["bio+tbik"]
    assert not tbik.report_only
    rules = {r.metric: r for r in tbik.rules}
    assert rules["bitwise_diff_records"].max == 0 and not rules["bitwise_diff_records"].optional
    assert rules["unique_mean"].max == 1 and rules["maxprob_div_mean"].max == 0
    assert rules["prefix_div_mean"].max == 0 and rules["teacher_forced_div_max"].optional
    assert policy.backends["bf16"].report_only and policy.backends["bio"].report_only


def test_invariant_run_passes(tmp_path):
    run = make_run(tmp_path / "r", {**diverging_bf16(), **invariant_cells()})
    result = gate(run)
    assert result.passed, result.violations
    assert result.violations == [] and result.checks > 0
    assert any("bio" in n and "not in the run" in n for n in result.notes)  # report-only, absent: a note


def test_divergent_tbik_fails_with_every_metric(tmp_path):
    run = make_run(tmp_path / "r", {**diverging_bf16(), **as_tbik(diverging_bf16())})
    result = gate(run)
    assert not result.passed
    assert metrics(result) == {
        ("bio+tbik", m)
        for m in (
            "bitwise_diff_records",
            "unique_mean",
            "maxprob_div_mean",
            "prefix_div_mean",
            "teacher_forced_div_max",
        )
    }
    v = next(v for v in result.violations if v.metric == "unique_mean")
    assert v.suite == "smoke" and v.value == pytest.approx(5 / 3) and v.threshold == "<= 1"
    assert "breaks" in v.reason


def test_three_agreeing_configurations_pass_routing_included(tmp_path):
    run = make_run(tmp_path / "r", moe_cells3(), backends=("bio+tbik",), tp=TP3)
    result = gate(run)
    assert result.passed, result.violations
    checked = {v.metric: v for v in result.results if v.backend == "bio+tbik"}
    assert checked["bitwise_diff_records"].value == 0 and checked["routing_div"].value == 0
    assert checked["cells"].value == 3


@pytest.mark.parametrize("flip", FLIPS, ids=[f.id for f in FLIPS])
def test_one_changed_number_of_any_field_fails_the_default_policy(tmp_path, flip):
    """bio+tbik must be bitwise invariant: one changed bit pattern in one number of one record of the
    third of three configurations fails the gate, naming the field, the prompt and the position, also
    where no other metric sees it (the chosen token's log-probability, swapped top-k ids, the 6th top-k
    log-probability, routing gates and margins, the teacher-forced routing)."""
    cells = moe_cells3()
    flip.change(cells[LAST][1])
    run = make_run(tmp_path / "r", cells, backends=("bio+tbik",), tp=TP3)
    result = gate(run)
    assert not result.passed
    assert metrics(result) == {("bio+tbik", m) for m in {"bitwise_diff_records", *flip.also}}
    (v,) = [v for v in result.violations if v.metric == "bitwise_diff_records"]
    assert v.value == 1 and v.threshold == "<= 0"
    where = f"{flip.field}, prompt p1, position {flip.position}"
    # a token changed alone leaves its top-k there as it was: the reason says the sampler chose it
    why = " (same top-k there: the sampler chose another token)" if flip.field == "output_token_ids" else ""
    assert v.reason.endswith(f"{LAST} differs from {CELLS3[1]}: {where}{why}"), v.reason
    res = CliRunner().invoke(app, ["gate", str(run)])
    assert res.exit_code == 1 and where in res.output, res.output


def test_teacher_forced_rule_is_optional(tmp_path):
    run = make_run(tmp_path / "r", invariant_cells(tf=False), backends=("bio+tbik",))
    result = gate(run)
    assert result.passed, result.violations
    assert any("teacher_forced_div_max not computed" in n for n in result.notes)


def test_pending_and_missing_cells_fail(tmp_path):
    cells = invariant_cells()
    run = make_run(tmp_path / "r", {TBIK[1]: cells[TBIK[1]], TBIK[2]: cells[TBIK[2]], **diverging_bf16()})
    (run / "cells" / f"{BF16[2]}.parquet").unlink()
    result = gate(run)
    assert not result.passed
    (v,) = result.violations
    assert (v.backend, v.metric, v.value) == ("bf16", "cell", "missing")  # report-only backends too
    assert BF16[2] in v.reason and "file is missing" in v.reason

    manifest = json.loads((run / "manifest.json").read_text())
    del manifest["cells"][TBIK[2]]  # a grid cell the manifest does not know
    (run / "manifest.json").write_text(json.dumps(manifest))
    v = next(v for v in gate(run).violations if v.backend == "bio+tbik")
    assert (v.metric, v.value) == ("cell", "missing") and "not in the manifest" in v.reason

    run = make_run(tmp_path / "p", {TBIK[1]: cells[TBIK[1]]})  # bf16 cells and tbik tp2 pending
    result = gate(run)
    assert {(v.backend, v.value) for v in result.violations if v.metric == "cell"} == {
        ("bf16", "pending"),
        ("bio+tbik", "pending"),
    }
    assert ("bio+tbik", "cells") in metrics(result)  # one done cell compares nothing


def test_failed_cell_fails_with_reason(tmp_path):
    run = make_run(
        tmp_path / "r",
        {TBIK[1]: invariant_cells()[TBIK[1]], **diverging_bf16()},
        states={TBIK[2]: ("failed", "rank 1 hung in all_reduce (timeout 300 s)")},
    )
    result = gate(run)
    assert not result.passed
    v = next(v for v in result.violations if v.metric == "cell")
    assert v.value == "failed" and "rank 1 hung in all_reduce" in v.reason


def test_policy_backend_absent_from_run_fails(tmp_path):
    run = make_run(tmp_path / "r", diverging_bf16(), backends=("bf16",))
    result = gate(run)
    assert not result.passed
    (v,) = result.violations
    assert (v.backend, v.metric, v.value) == ("bio+tbik", "backend", "absent")
    assert "cannot be verified" in v.reason


def test_backend_with_no_done_cell_fails(tmp_path):
    run = make_run(tmp_path / "r", diverging_bf16(), states={TBIK[1]: ("failed", "boom"), TBIK[2]: ("failed", "boom")})
    result = gate(run)
    assert ("bio+tbik", "cells") in metrics(result)
    assert sum(v.metric == "cell" for v in result.violations) == 2


def test_report_only_rules_warn(tmp_path):
    policy = write(tmp_path, "backends:\n  bf16: {report_only: true, unique_mean: {max: 1}}\n")
    run = make_run(tmp_path / "r", {**diverging_bf16(), **invariant_cells()})
    result = gate(run, policy)
    assert result.passed and [(w.backend, w.metric) for w in result.warnings] == [("bf16", "unique_mean")]


@pytest.mark.parametrize(
    "text, match",
    [
        ("backends: [unclosed", "malformed YAML"),
        ("", "is empty"),
        ("- a\n- b\n", "must be a mapping"),
        ("backends:\n  bio+tbik: {unique_meen: {max: 1}}\n", "unknown metric 'unique_meen'"),
        ("backends:\n  bio+tbik: {unique_mean: {maximum: 1}}\n", "unknown key 'maximum'"),
        ("backends:\n  bio+tbik: {unique_mean: {max: one}}\n", "must be a number"),
        ("backends:\n  bio+tbik: {unique_mean: 1}\n", "must be a mapping such as"),
        ("backends:\n  bf16: {report_only: maybe}\n", "report_only must be true or false"),
        ("backend:\n  bf16: {}\n", "unknown key 'backend'"),
        ("backends: {}\nbaseline_tolerance: {acc_mean: -1}\n", "must be a number >= 0"),
        ("version: 2\nbackends: {}\n", "version 2 is not supported"),
    ],
)
def test_bad_policy_is_detaudit_error(tmp_path, text, match):
    run = make_run(tmp_path / "r", invariant_cells())
    with pytest.raises(DetauditError, match=match):
        gate(run, write(tmp_path, text))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda p: p.mkdir(), "is a directory, not a file"),
        (lambda p: p.write_bytes(b"backends:\n  bio+tbik: {unique_mean: {max: 1}}  # caf\xe9\n"), "not UTF-8"),
        (lambda p: p.symlink_to(p), "a symlink loop"),  # an OSError root gets too (a mode-0 file it reads)
    ],
    ids=["directory", "not-utf8", "symlink-loop"],
)
def test_a_policy_that_cannot_be_read_is_one_line_and_exit_2(tmp_path, make, message):
    policy = tmp_path / "policy.yaml"
    make(policy)
    run = make_run(tmp_path / "r", invariant_cells())
    one_line_error(CliRunner().invoke(app, ["gate", str(run), "--policy", str(policy)]), f"policy file {policy}")
    with pytest.raises(DetauditError, match=message):
        load_policy(policy)


def test_bad_run_input_is_detaudit_error(tmp_path):
    with pytest.raises(DetauditError, match="does not exist"):
        gate(tmp_path / "nope")
    with pytest.raises(DetauditError, match="policy file .* does not exist"):
        gate(make_run(tmp_path / "ok", invariant_cells()), tmp_path / "missing.yaml")

    run = make_run(tmp_path / "r", {**diverging_bf16(), **invariant_cells()})
    f = run / "cells" / f"{TBIK[2]}.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])  # truncated parquet
    with pytest.raises(DetauditError, match="unreadable or truncated"):
        gate(run)

    run = make_run(tmp_path / "m", invariant_cells())
    (run / "manifest.json").write_text(json.dumps({"cells": {}}))
    with pytest.raises(DetauditError, match="missing config/cells"):
        gate(run)


def test_baseline_regression(tmp_path):
    policy = write(tmp_path, "backends:\n  bf16: {}\nbaseline_tolerance: {unique_mean: 0.1, maxprob_div_mean: 0.01}\n")
    identical = {BF16[1]: invariant_cells()[TBIK[1]], BF16[2]: invariant_cells()[TBIK[2]]}
    baseline = make_run(tmp_path / "base", identical, backends=("bf16",))
    worse = make_run(tmp_path / "new", diverging_bf16(), backends=("bf16",))

    result = gate(worse, policy, baseline_dir=baseline)
    assert not result.passed
    assert metrics(result) == {("bf16", "unique_mean"), ("bf16", "maxprob_div_mean")}
    v = next(v for v in result.violations if v.metric == "unique_mean")
    assert v.threshold == "baseline 1 + 0.1" and "regressed from 1 to 1.667" in v.reason

    assert gate(baseline, policy, baseline_dir=worse).passed  # better than the baseline passes
    assert gate(worse, policy, baseline_dir=worse).passed
    # the default policy's tolerances only apply to gated backends (bf16 is report-only)
    assert gate(worse, None, baseline_dir=baseline).violations[0].metric == "backend"


def test_a_metric_equal_to_the_baseline_passes_at_tolerance_0(tmp_path):
    """A tolerance of 0 allows no worsening, and a metric equal to the baseline's is no worsening."""
    policy = write(tmp_path, "backends:\n  bf16: {}\nbaseline_tolerance: {unique_mean: 0, maxprob_div_mean: 0}\n")
    identical = {BF16[1]: invariant_cells()[TBIK[1]], BF16[2]: invariant_cells()[TBIK[2]]}
    baseline = make_run(tmp_path / "base", identical, backends=("bf16",))
    worse = make_run(tmp_path / "new", diverging_bf16(), backends=("bf16",))
    same = gate(worse, policy, baseline_dir=worse)
    assert same.passed, same.violations
    assert {c.metric for c in same.results if c.threshold.startswith("baseline ")} == {
        "unique_mean",
        "maxprob_div_mean",
    }
    assert metrics(gate(worse, policy, baseline_dir=baseline)) == {
        ("bf16", "unique_mean"),
        ("bf16", "maxprob_div_mean"),
    }


BF16_POLICY = "backends:\n  bf16: {}\nbaseline_tolerance: {unique_mean: 0.1}\n"


def text_of(result) -> str:
    console = Console(record=True, width=300)
    for r in render_result(result):
        console.print(r)
    return console.export_text()


@pytest.mark.parametrize(
    "kw, field",
    [
        (dict(manifest_extra={"model": {"name": "other"}}, identity={"model_checksum": "other-ck"}), "model"),
        (dict(identity={"suites": {"smoke": "edited-ck"}}), "suite smoke"),  # same name, other prompts
        (dict(suites=("smoke", "amc23")), "suites"),
    ],
)
def test_baseline_of_another_model_or_suite_fails_unless_allowed(tmp_path, kw, field):
    policy = write(tmp_path, BF16_POLICY)
    run = make_run(tmp_path / "new", diverging_bf16(), backends=("bf16",))
    other = make_run(tmp_path / "base", diverging_bf16(), backends=("bf16",), **kw)

    result = gate(run, policy, baseline_dir=other)
    assert not result.passed
    (v,) = result.violations
    assert (v.metric, v.value) == ("baseline", field) and "--allow-mismatch" in v.reason
    assert [(m.field, m.blocking) for m in result.mismatches] == [(field, True)]
    text = text_of(result)
    assert f"baseline differs: {field}: run " in text and "gate failed" in text
    assert result.to_dict()["mismatches"][0]["field"] == field

    allowed = gate(run, policy, baseline_dir=other, allow_mismatch=True)
    assert allowed.passed
    assert [m.field for m in allowed.mismatches] == [field]
    assert f"baseline differs: {field}" in text_of(allowed) and "gate passed" in text_of(allowed)
    worse_than = make_run(
        tmp_path / "b2",
        {BF16[1]: invariant_cells()[TBIK[1]], BF16[2]: invariant_cells()[TBIK[2]]},
        backends=("bf16",),
        **kw,
    )
    assert not gate(run, policy, baseline_dir=worse_than, allow_mismatch=True).passed  # still a regression


def test_baseline_differences_that_do_not_block_are_printed(tmp_path):
    policy = write(tmp_path, BF16_POLICY)
    run = make_run(tmp_path / "new", diverging_bf16(), backends=("bf16",))
    same = gate(run, policy, baseline_dir=run)
    assert same.passed and same.mismatches == []
    other = make_run(
        tmp_path / "base",
        diverging_bf16(),
        backends=("bf16",),
        manifest_extra={"code_version": "0.2.0"},
        identity={"decoding": {"greedy": True}},
    )
    result = gate(run, policy, baseline_dir=other)
    assert result.passed
    assert {(m.field, m.blocking) for m in result.mismatches} == {("decoding", False), ("code version", False)}
    text = text_of(result)
    assert "baseline differs: code version: run 0.1.0, baseline 0.2.0" in text
    assert 'baseline differs: decoding: run {"greedy": false' in text and "gate passed" in text


def test_violations_table_and_json(tmp_path):
    run = make_run(tmp_path / "r", {**diverging_bf16(), **as_tbik(diverging_bf16())})
    result = gate(run)
    console = Console(record=True, width=200)
    console.print(violations_table(result))
    text = console.export_text()
    assert "FAILED" in text and "unique_mean" in text and "policy: default" in text
    d = result.to_dict()
    assert d["passed"] is False and len(d["violations"]) == 5
    json.dumps(d)  # JSON-ready


# ---------------------------------------------------------------- alignment results (`detaudit align`)


def make_alignment(tmp_path, tbik_trainer=(-0.5, -1.25, -0.125), backends=("bf16", "bio+tbik")):
    """An alignment directory as `detaudit align` writes it: 3 sampled tokens per backend, bf16's trainer
    log-probabilities off by a little, bio+tbik's as given."""
    import pandas as pd

    from detaudit.align import summarize, write_alignment

    rollout = (-0.5, -1.25, -0.125)
    trainer = {"bf16": (-0.5001, -1.2502, -0.125), "bio+tbik": tbik_trainer}
    rows = [
        {
            "model": "m",
            "backend": b,
            "rollout": "vllm:4",
            "trainer": "builtin:1",
            "prompt_id": "p",
            "position": i,
            "token_id": 7,
            "rollout_logprob": r,
            "trainer_logprob": t,
        }
        for b in backends
        for i, (r, t) in enumerate(zip(rollout, trainer[b]))
    ]
    df = pd.DataFrame(rows)
    out = tmp_path / "align"
    write_alignment(df, summarize(df), out, {"rollout": "vllm:4", "trainer": "builtin:1", "model": "m"})
    return out


def test_alignment_gate_passes_when_tbik_is_bitwise_aligned(tmp_path):
    result = gate(make_alignment(tmp_path))
    assert result.passed, result.violations
    assert result.checks >= 3 and result.run.endswith("align")
    assert {(w.backend, w.metric) for w in result.warnings} == set()  # bf16 / bio are report-only, no rules


def test_alignment_gate_fails_on_a_gap_and_cli_exit_codes(tmp_path):
    from typer.testing import CliRunner

    from detaudit.cli import app

    bad = make_alignment(tmp_path, tbik_trainer=(-0.5, -1.25, -0.1250001))
    result = gate(bad)
    assert not result.passed
    assert metrics(result) == {("bio+tbik", "bitwise_equal_frac"), ("bio+tbik", "dp_max")}
    v = next(v for v in result.violations if v.metric == "bitwise_equal_frac")
    assert v.suite == "vllm:4 vs builtin:1" and v.value == pytest.approx(2 / 3)
    runner = CliRunner()
    res = runner.invoke(app, ["gate", str(bad), "--json"])
    assert res.exit_code == 1
    assert {v["metric"] for v in json.loads(res.stdout)["violations"]} == {"bitwise_equal_frac", "dp_max"}
    assert runner.invoke(app, ["gate", str(make_alignment(tmp_path / "ok"))]).exit_code == 0
    res = runner.invoke(app, ["gate", str(bad), "--baseline", str(bad)])
    assert res.exit_code == 2 and "alignment" in res.output
    (bad / "alignment.json").write_text("{not json")
    res = runner.invoke(app, ["gate", str(bad)])
    assert res.exit_code == 2 and "corrupt" in res.output and "Traceback" not in res.output


def test_alignment_gate_fails_when_the_gated_backend_is_missing(tmp_path):
    result = gate(make_alignment(tmp_path, backends=("bf16",)))
    assert not result.passed and metrics(result) == {("bio+tbik", "backend")}


def test_alignment_policy_rules_are_validated(tmp_path):
    policy = write(tmp_path, "backends: {}\nalignment:\n  bio+tbik:\n    unique_mean: {max: 1}\n")
    with pytest.raises(DetauditError, match="unknown metric 'unique_mean'"):
        load_policy(policy)
