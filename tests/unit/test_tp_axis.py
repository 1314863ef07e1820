"""The batch and TP axes apart (`analysis.tp_axis`) and in the report files, on hand-written run directories
of a TP 1 / 2 x batch 4 / 8 grid (known answers)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from detaudit.analysis.analyze import analyze
from detaudit.analysis.tp_axis import AXIS_COLUMNS, axis_table
from detaudit.config import EngineSettings, SweepConfig
from detaudit.render import write_reports
from detaudit.runs.manifest import Manifest
from detaudit.runs.records import COLUMNS
from detaudit.runs.rundir import RunDir

TOPK = [0.5, 0.25, 0.125, 0.0625, 0.03125]


def rec(prompt: int, ids, first_logprob: float = math.log(0.5)) -> dict:
    probs = [TOPK] * len(ids)
    return dict(
        prompt_index=prompt,
        prompt_id=f"p{prompt}",
        output_token_ids=list(ids),
        topk_ids=[list(range(5))] * len(ids),
        topk_logprobs=[[math.log(p) for p in r] for r in probs],
        token_logprobs=[first_logprob] + [math.log(0.5)] * (len(ids) - 1),
    )


SAME = [rec(0, [1, 2, 3]), rec(1, [4, 5, 6])]


def make_run(
    path: Path,
    cells: dict[tuple[int, int], list[dict]],
    tp=(1, 2),
    batch_sizes=(4, 8),
    *,
    failed=(),
    speculative=("off",),
    engine: str = "builtin",
) -> Path:
    """One backend (bf16), one suite, the grid tp x batch_sizes (x `speculative`); `cells` maps (tp, batch)
    to records, the same for a speculative cell as for its plain one; the cells at `failed` failed."""
    cfg = SweepConfig(
        model="tiny",
        suites=("s",),
        backends=("bf16",),
        tp=tp,
        batch_sizes=batch_sizes,
        speculative=speculative,
        engine=EngineSettings(name=engine),
    )
    manifest = {
        "comparable": {"model_checksum": "ck", "suites": {"s": "ck"}, "decoding": cfg.decoding.to_dict()},
        "config": cfg.to_dict(),
        "model": {"name": "tiny"},
        "cells": {
            c.id: dict(
                backend=c.backend, tp=c.tp, batch_size=c.batch_size, suite=c.suite, state="pending", engine=engine
            )
            for c in cfg.cells()
        },
    }
    run = RunDir(path)
    with run.locked():
        run.init_or_check(Manifest.from_dict(json.loads(json.dumps(manifest))))
        for c in cfg.cells():
            if (c.tp, c.batch_size) in failed:
                run.mark(c.id, "failed", error="out of memory")
                continue
            rows = []
            for r in cells[(c.tp, c.batch_size)]:
                row = {k: None for k in COLUMNS}
                row.update(cell_id=c.id, backend=c.backend, tp=c.tp, batch_size=c.batch_size, suite="s")
                row.update(finish_reason="length", engine=engine, model="tiny", **r)
                rows.append(row)
            run.write_cell(c.id, rows, {})
    return path


def rows_by(table: pd.DataFrame) -> dict[tuple[str, str], dict]:
    return {(r["axis"], r["fixed"]): r for r in table.to_dict("records")}


def test_batch_and_tp_apart(tmp_path):
    # batch-invariant at TP 1; at TP 2 batch 8 takes another token on prompt 1; TP 2 moves a log-prob
    tp2 = [rec(0, [1, 2, 3], math.log(0.25)), rec(1, [4, 5, 6], math.log(0.25))]
    tp2_b8 = [rec(0, [1, 2, 3], math.log(0.25)), rec(1, [4, 9, 6], math.log(0.25))]
    run = make_run(tmp_path / "r", {(1, 4): SAME, (1, 8): SAME, (2, 4): tp2, (2, 8): tp2_b8})
    t = axis_table(analyze(run))
    assert list(t.columns) == AXIS_COLUMNS
    rows = rows_by(t)
    assert set(rows) == {("batch", "TP 1"), ("batch", "TP 2"), ("TP", "batch 4"), ("TP", "batch 8")}
    r = rows[("batch", "TP 1")]
    assert (r["cells"], r["compared"], r["records_differ"], r["outputs_differ"], r["unique_mean"]) == (2, 2, 0, 0, 1.0)
    assert r["varied"] == "4, 8" and r["first_diff"] == ""
    r = rows[("batch", "TP 2")]
    assert (r["records_differ"], r["outputs_differ"], r["unique_mean"]) == (1, 1, 1.5)
    assert (
        "s__bf16__tp2__bs8 differs from s__bf16__tp2__bs4: output_token_ids, prompt p1, position 1" in (r["first_diff"])
    )
    r = rows[("TP", "batch 4")]  # every record's first log-prob moved, no token did
    assert (r["varied"], r["records_differ"], r["outputs_differ"], r["unique_mean"]) == ("1, 2", 2, 0, 1.0)
    assert "token_logprobs" in r["first_diff"]
    r = rows[("TP", "batch 8")]
    assert (r["records_differ"], r["outputs_differ"], r["unique_mean"]) == (2, 1, 1.5)


def test_one_axis_only_and_none(tmp_path):
    run = make_run(tmp_path / "b", {(1, 4): SAME, (1, 8): SAME}, tp=(1,))
    assert [(r["axis"], r["fixed"]) for r in axis_table(analyze(run)).to_dict("records")] == [("batch", "TP 1")]
    run = make_run(tmp_path / "one", {(1, 4): SAME}, tp=(1,), batch_sizes=(4,))
    assert len(axis_table(analyze(run))) == 0


@pytest.mark.parametrize("fmt", ["md", "csv", "html"])
def test_in_the_reports(tmp_path, fmt):
    tp2 = [rec(0, [1, 2, 3]), rec(1, [4, 9, 6])]
    a = analyze(make_run(tmp_path / "r", {(1, 4): SAME, (1, 8): SAME, (2, 4): tp2, (2, 8): tp2}))
    out = tmp_path / "out"
    written = {p.name: p for p in write_reports(a, out, formats=(fmt,))}
    if fmt == "csv":
        axes = pd.read_csv(written["axes.csv"])
        assert axes[axes["fixed"] == "batch 4"]["outputs_differ"].tolist() == [1]
        return
    text = written["report.md" if fmt == "md" else "report.html"].read_text()
    assert "Batch and TP axes" in text
    # the TP row at batch 4: one record of two differs, in its tokens
    row = "| TP | batch 4 | 1, 2 | 2 | 1/2 | 1/2 |" if fmt == "md" else '<td class="">1/2</td><td class="">1/2</td>'
    assert row in text


def test_no_section_without_two_sizes(tmp_path):
    a = analyze(make_run(tmp_path / "one", {(1, 4): SAME}, tp=(1,), batch_sizes=(4,)))
    written = {p.name: p for p in write_reports(a, tmp_path / "out", formats=("md", "csv"))}
    assert "axes.csv" not in written
    assert "Batch and TP axes" not in written["report.md"].read_text()


def test_each_cell_against_the_rows_reference(tmp_path):
    # batch 8 drifts from batch 4 and batch 16 keeps the drift: both differ from the reference (batch 4)
    moved = [rec(0, [1, 2, 3]), rec(1, [4, 9, 6])]
    run = make_run(tmp_path / "r", {(1, 4): SAME, (1, 8): moved, (1, 16): moved}, tp=(1,), batch_sizes=(4, 8, 16))
    (row,) = axis_table(analyze(run)).to_dict("records")
    assert (row["varied"], row["cells"], row["records_differ"], row["outputs_differ"]) == ("4, 8, 16", 3, 2, 2)
    assert row["unique_mean"] == 1.5


def test_failed_speculative_and_server_cells_are_left_out(tmp_path):
    moved = [rec(0, [1, 2, 3]), rec(1, [4, 9, 6])]
    # batch 4 failed: the reference is batch 8, and batch 16 is compared with it alone
    run = make_run(tmp_path / "f", {(1, 8): SAME, (1, 16): moved}, tp=(1,), batch_sizes=(4, 8, 16), failed={(1, 4)})
    (row,) = axis_table(analyze(run)).to_dict("records")
    assert (row["varied"], row["cells"], row["compared"], row["records_differ"]) == ("8, 16", 2, 2, 1)
    # a speculative cell is its own axis (spec_axis), never a TP or batch neighbour of the plain ones
    run = make_run(tmp_path / "s", {(1, 4): SAME, (2, 4): moved}, batch_sizes=(4,), speculative=("off", "ngram:4"))
    (row,) = axis_table(analyze(run)).to_dict("records")
    assert (row["axis"], row["cells"], row["compared"], row["outputs_differ"]) == ("TP", 2, 2, 1)
    # a server audit's axes are its loads
    run = make_run(tmp_path / "v", {(1, 4): SAME, (1, 8): moved}, tp=(1,), engine="vllm-server")
    assert len(axis_table(analyze(run))) == 0


def test_compared_counts_prompts_either_cell_holds(tmp_path):
    run = make_run(tmp_path / "r", {(1, 4): SAME, (1, 8): SAME[:1] + [rec(2, [7])]}, tp=(1,))
    (row,) = axis_table(analyze(run)).to_dict("records")
    assert (row["compared"], row["records_differ"]) == (3, 2)  # p1 only in batch 4, p2 only in batch 8


def test_a_line_per_backend_in_the_terminal(tmp_path):
    from rich.console import Console

    from detaudit.render import render_summary

    tp2 = [rec(0, [1, 2, 3], math.log(0.25)), rec(1, [4, 5, 6], math.log(0.25))]
    a = analyze(make_run(tmp_path / "r", {(1, 4): SAME, (1, 8): SAME, (2, 4): tp2, (2, 8): tp2}))
    console = Console(record=True, width=300)
    for r in render_summary(a):
        console.print(r)
    text = console.export_text()
    assert "bf16: bitwise across batch sizes at every TP size; the TP size moves records at batch 4, batch 8" in text
    one = analyze(make_run(tmp_path / "one", {(1, 4): SAME}, tp=(1,), batch_sizes=(4,)))
    assert not any("axes" in str(r) for r in render_summary(one))  # one TP size, one batch size: no axes


def test_the_suite_column_only_when_the_table_spans_suites():
    from detaudit.render import axis_rows

    row = dict(backend="bf16", axis="TP", fixed="batch 4", varied="1, 2", cells=2, compared=2)
    row.update(records_differ=1, outputs_differ=0, unique_mean=1.0, first_diff="")
    two = pd.DataFrame([dict(row, suite="aime24"), dict(row, suite="amc23")], columns=AXIS_COLUMNS)
    header, rows = axis_rows(None, two)
    assert header[:2] == ["suite", "backend"] and [r[:2] for r in rows] == [["aime24", "bf16"], ["amc23", "bf16"]]
    header, rows = axis_rows(None, two[:1])
    assert header[0] == "backend" and rows[0][:3] == ["bf16", "TP", "batch 4"]
