"""The metric table: every summary column has one spec, and analyze / gate / report read it."""

from __future__ import annotations

import ast
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import detaudit.analysis.analyze as analyze_mod
from detaudit.analysis import metrics
from detaudit.analysis.gate import load_policy, parse_policy
from detaudit.analysis.metrics import MetricSpec, default_tolerances, gateable, shown, spec, summary_columns
from detaudit.errors import DetauditError
from detaudit.render import summary_rows

from .test_analyze import diverging_bf16, invariant_cells, make_run


def test_every_summary_column_is_computed_and_has_a_spec(tmp_path, monkeypatch):
    computed = []
    real = analyze_mod._group

    def spy(*args):
        out = real(*args)
        computed.append(list(out[0]))
        return out

    monkeypatch.setattr(analyze_mod, "_group", spy)
    a = analyze_mod.analyze(make_run(tmp_path / "r", {**diverging_bf16(), **invariant_cells()}))
    assert computed and all(keys == summary_columns() for keys in computed)  # same names, same order
    assert list(a.summary.columns) == summary_columns() == analyze_mod.SUMMARY_COLUMNS


@pytest.mark.parametrize("name", sorted(gateable()))
def test_every_gateable_metric_parses_in_a_policy(name):
    policy = parse_policy({"backends": {"bio+tbik": {name: {"max": 1}}}, "baseline_tolerance": {name: 0.5}})
    assert policy.backends["bio+tbik"].rules[0].metric == name and policy.baseline_tolerance == {name: 0.5}


@pytest.mark.parametrize("name", ["len_mean", "tf_reference", "failed_cells", "model"])
def test_metrics_that_are_not_gateable_are_refused(name):
    with pytest.raises(DetauditError, match=f"unknown metric '{name}'"):
        parse_policy({"backends": {"bio+tbik": {name: {"max": 1}}}})


def test_alignment_metrics_are_align_columns_and_parse():
    from detaudit.align import summarize

    df = pd.DataFrame(
        {
            "backend": "bf16",
            "rollout": "vllm:1",
            "trainer": "builtin:1",
            "rollout_logprob": [-0.5, -1.0],
            "trainer_logprob": [-0.5, -1.1],
        }
    )
    assert set(gateable("align")) <= set(summarize(df).columns)
    rules = {name: {"min": 0} for name in gateable("align")}
    assert len(parse_policy({"backends": {}, "alignment": {"bio+tbik": rules}}).alignment["bio+tbik"].rules) == len(
        rules
    )


def test_default_tolerances_are_the_shipped_policy_s():
    shipped = Path(metrics.__file__).parents[1] / "data" / "default-policy.yaml"
    assert default_tolerances() == yaml.safe_load(shipped.read_text())["baseline_tolerance"]
    assert parse_policy({"backends": {}}).baseline_tolerance == default_tolerances()
    assert load_policy().baseline_tolerance == default_tolerances()


def test_worse_direction():
    assert spec("unique_mean").worsening(1.5, 1.0) == 0.5 and spec("unique_mean").worse_sign == "+"
    assert spec("acc_mean").worsening(0.4, 0.5) == pytest.approx(0.1) and spec("acc_mean").worse_sign == "-"
    assert spec("first_div_median").worsening(12, 10) == -2  # diverging later is better
    with pytest.raises(ValueError, match="no direction"):
        spec("suite").worsening(1, 2)


def test_report_columns_resolve_by_name(tmp_path):
    a = analyze_mod.analyze(make_run(tmp_path / "r", {**diverging_bf16(), **invariant_cells()}))
    header, rows = summary_rows(a, "cli")
    assert header == [
        "suite",
        "backend",
        "cells",
        "prompts",
        "unique",
        "bitwise diffs",
        "max-prob div ×1e-3",
        "prefix div ×1e-3",
        "TF div max",
        "first div (median)",
        "acc",
        "acc std",
        "failed cells",
    ]
    bf16 = dict(zip(header, rows[0]))
    assert bf16["backend"] == "bf16" and bf16["unique"] == "1.67" and bf16["first div (median)"] == "1"
    assert bf16["bitwise diffs"] == "3" and dict(zip(header, rows[1]))["bitwise diffs"] == "0"
    full, _ = summary_rows(a)
    assert set(header) < set(full) and {"TF div mean", "identical prompts", "len std"} <= set(full)
    assert [s.name for s in shown("published")] == ["unique_mean", "maxprob_div_mean"]
    with pytest.raises(DetauditError, match="unknown table 'nope'"):
        shown("nope")
    with pytest.raises(DetauditError, match="unknown metric 'unique'"):
        spec("unique")


def test_comparison_cells_need_two_done_cells():
    row = dict(cells=1, unique_mean=1.0, acc_mean=0.5, identical_prompts=3, prompts=3)
    assert spec("unique_mean").render(row) == "–" and spec("identical_prompts").render(row) == "–"
    assert spec("acc_mean").render(row) == "50.0%"  # a cell's own accuracy needs no second cell
    assert spec("unique_mean").render({**row, "cells": 2}) == "1"
    assert spec("identical_prompts").render({**row, "cells": 2}) == "3/3"


def test_formats_of_missing_and_numpy_values():
    assert all(metrics.is_missing(v) for v in (None, math.nan, np.nan, pd.NA, pd.NaT))
    assert not any(metrics.is_missing(v) for v in (0, 0.0, "", "x", False))
    assert metrics.fmt_num(np.bool_(True)) == "yes" and metrics.fmt_num(np.int64(3)) == "3"
    assert metrics.fmt_num(np.float64(2.5)) == "2.50" and metrics.fmt_pct(pd.NA) == "–"


def test_table_definition_errors_are_caught():
    with pytest.raises(ValueError, match="defined twice"):
        metrics._check((MetricSpec("a", "a"), MetricSpec("a", "b")))
    with pytest.raises(ValueError, match="no direction"):
        metrics._check((MetricSpec("a", "a", gateable=True),))
    with pytest.raises(ValueError, match="unknown table"):
        metrics._check((MetricSpec("a", "a", tables=("html",)),))


def test_metrics_is_a_lower_layer():
    tree = ast.parse(Path(metrics.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names
    }
    assert {m for m in imported if m.split(".")[0] == "detaudit"} == {"detaudit.errors"}
    assert all(m.split(".")[0] in ("__future__", "numbers", "dataclasses", "typing", "detaudit") for m in imported)
