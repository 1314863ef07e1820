"""The speculative axis in analyze, the reports, the gate and diff, on small hand-written run directories
(known answers)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from detaudit.analysis.analyze import analyze
from detaudit.analysis.diff import diff_runs
from detaudit.analysis.gate import gate
from detaudit.analysis.spec_axis import SPEC_COLUMNS, SPEC_SUMMARY_COLUMNS, speculative_summary, speculative_table
from detaudit.config import SweepConfig
from detaudit.errors import DetauditError
from detaudit.render import write_reports
from detaudit.runs.manifest import Manifest
from detaudit.runs.merge import merge_runs
from detaudit.runs.records import COLUMNS
from detaudit.runs.rundir import RunDir

TOPK = [0.5, 0.25, 0.125, 0.0625, 0.03125]


def rec(prompt: int, ids, probs=None, drafted=None, accepted=None) -> dict:
    probs = probs or [TOPK] * len(ids)
    return dict(
        prompt_index=prompt,
        prompt_id=f"p{prompt}",
        output_token_ids=list(ids),
        topk_ids=[list(range(len(r))) for r in probs],
        topk_logprobs=[[math.log(p) for p in r] for r in probs],
        token_logprobs=[math.log(r[0]) for r in probs],
        spec_drafted=drafted,
        spec_accepted=accepted,
    )


def make_run(
    path: Path,
    cells: dict[str, tuple[list[dict], dict]],
    speculative=("off", "ngram:4"),
    backends=("bf16", "bio+tbik"),
    draft_checksum: str = "ck",
) -> Path:
    """A run of the grid `backends` x TP 1 x batch 1 x `speculative`: `cells` maps a cell id to its
    records and its manifest timings (output_tokens, generate_s)."""
    cfg = SweepConfig(
        model="tiny", suites=("s",), backends=backends, tp=(1,), batch_sizes=(1,), speculative=speculative
    )
    manifest = {
        "comparable": {"model_checksum": "ck", "suites": {"s": "ck"}, "decoding": cfg.decoding.to_dict()},
        "config": cfg.to_dict(),
        "model": {"name": "tiny"},
        "speculative": {
            s.label: {**s.describe(), **({"checksum": draft_checksum} if s.kind == "draft" else {})}
            for s in cfg.speculative_settings()
            if s.on
        },
        "cells": {
            c.id: dict(backend=c.backend, tp=c.tp, batch_size=c.batch_size, suite=c.suite, state="pending")
            for c in cfg.cells()
        },
    }
    run = RunDir(path)
    with run.locked():
        run.init_or_check(Manifest.from_dict(json.loads(json.dumps(manifest))))
        for cid, (rows, meta) in cells.items():
            m = manifest["cells"][cid]
            full = []
            for r in rows:
                row = {c: None for c in COLUMNS}
                row.update(cell_id=cid, backend=m["backend"], tp=1, batch_size=1, suite="s", finish_reason="length")
                row.update(engine="builtin", model="tiny")
                row.update(r)
                full.append(row)
            run.write_cell(cid, full, meta)
    return path


PLAIN = [rec(0, [1, 2, 3, 4]), rec(1, [5, 6, 7, 8])]


@pytest.fixture
def run(tmp_path):
    """bio+tbik: the speculative cell is bitwise the plain one; bf16: prompt p1 diverges at position 2 and
    p0 keeps its tokens but one probability moves."""
    bf16_spec = [
        rec(0, [1, 2, 3, 4], probs=[TOPK, TOPK, [0.5, 0.3, 0.1, 0.05, 0.05], TOPK], drafted=6, accepted=3),
        rec(1, [5, 6, 9, 9, 9], drafted=4, accepted=0),
    ]
    tbik_spec = [dict(r, spec_drafted=5, spec_accepted=4) for r in PLAIN]
    return make_run(
        tmp_path / "run",
        {
            "s__bf16__tp1__bs1": (PLAIN, {"output_tokens": 8, "generate_s": 4.0}),
            "s__bf16__tp1__bs1__ngram4": (bf16_spec, {"output_tokens": 9, "generate_s": 3.0}),
            "s__bio-tbik__tp1__bs1": ([dict(r) for r in PLAIN], {"output_tokens": 8, "generate_s": 2.0}),
            "s__bio-tbik__tp1__bs1__ngram4": (tbik_spec, {"output_tokens": 8, "generate_s": 1.0}),
        },
    )


def test_summary_counts_speculative_records_against_their_plain_cells(run):
    s = analyze(run).summary.set_index("backend")
    assert s.loc["bio+tbik", "spec_bitwise_diff_records"] == 0
    assert s.loc["bf16", "spec_bitwise_diff_records"] == 2
    assert "s__bf16__tp1__bs1__ngram4 differs from s__bf16__tp1__bs1" in s.loc["bf16", "spec_first_diff"]
    assert "prompt p0, position 2" in s.loc["bf16", "spec_first_diff"]


def test_speculative_table_known_answers(run):
    t = speculative_table(analyze(run))
    assert list(t.columns) == SPEC_COLUMNS
    t = t.set_index("backend")
    bf16, tbik = t.loc["bf16"], t.loc["bio+tbik"]
    assert (bf16["setting"], bf16["plain_cell"], bf16["compared"]) == ("ngram:4", "s__bf16__tp1__bs1", 2)
    assert (bf16["identical"], bf16["records_differ"], bf16["outputs_differ"]) == (0, 2, 1)
    assert (bf16["first_div_min"], bf16["first_div_median"]) == (2, 2.0)
    # p0: one position of four moves, its largest rank difference 0.3 - 0.25 (float32 round trips: 1e-7);
    # p1: the same probabilities at the 4 positions both reach. Mean over records of per-record means.
    assert bf16["maxprob_div_mean"] == pytest.approx((0.05 / 4 + 0) / 2, abs=1e-7)
    assert (bf16["drafted"], bf16["accepted"], bf16["acceptance"]) == (10, 3, 0.3)
    assert (bf16["tokens_per_s"], bf16["plain_tokens_per_s"], bf16["speedup"]) == (3.0, 2.0, 1.5)
    assert (tbik["identical"], tbik["records_differ"], tbik["outputs_differ"]) == (2, 0, 0)
    assert tbik["maxprob_div_mean"] == 0 and math.isnan(tbik["first_div_median"])
    assert (tbik["acceptance"], tbik["speedup"]) == (0.8, 2.0)


def test_speculative_summary_pools_cells(run):
    s = speculative_summary(analyze(run))
    assert list(s.columns) == SPEC_SUMMARY_COLUMNS
    s = s.set_index("backend")
    assert s.loc["bio+tbik", "unique_mean"] == 1 and s.loc["bio+tbik", "records_differ"] == 0
    assert s.loc["bf16", "unique_mean"] == 1.5  # p0 agrees, p1 has two outputs
    assert (s.loc["bf16", "outputs_differ"], s.loc["bf16", "first_div_median"]) == (1, 2.0)
    assert (s.loc["bf16", "acceptance"], s.loc["bf16", "speedup"]) == (0.3, 1.5)


def test_reports_show_the_axis_and_the_gate_requires_tbik_bitwise(run, tmp_path):
    a = analyze(run)
    files = {p.name: p for p in write_reports(a, tmp_path / "out", ("md", "csv", "html"))}
    md = files["report.md"].read_text()
    assert "## Speculative decoding" in md and "| bio+tbik | ngram:4 | 1 | 1 | 2/2 | 0 |" in md
    assert "| bf16 | ngram:4 | 1 | 1.50 | 0/2 | 1 | 2 |" in md
    assert "spec bitwise diffs" in md
    assert "speculative.csv" in files and "speculative_summary.csv" in files
    assert "Speculative decoding" in files["report.html"].read_text()
    assert gate(run).passed  # bf16 is report-only; bio+tbik's speculative cell is bitwise


def test_gate_fails_when_tbik_speculation_changes_a_bit(tmp_path):
    moved = [rec(0, [1, 2, 3, 4], drafted=1, accepted=1), rec(1, [5, 6, 7, 8], probs=[TOPK, TOPK, TOPK, TOPK[::-1]])]
    path = make_run(
        tmp_path / "run",
        {"s__bio-tbik__tp1__bs1": (PLAIN, {}), "s__bio-tbik__tp1__bs1__ngram4": (moved, {})},
        backends=("bio+tbik",),
    )
    verdict = gate(path)
    assert not verdict.passed
    assert any(v.metric == "spec_bitwise_diff_records" for v in verdict.violations)
    # no timings recorded: speed-up unknown, not invented
    assert math.isnan(speculative_table(analyze(path))["speedup"].iloc[0])


def test_runs_without_the_axis_show_nothing_of_it(tmp_path):
    path = make_run(
        tmp_path / "run",
        {"s__bf16__tp1__bs1": (PLAIN, {}), "s__bio-tbik__tp1__bs1": (PLAIN, {})},
        speculative=("off",),
    )
    a = analyze(path)
    assert a.summary["spec_bitwise_diff_records"].isna().all() and not len(speculative_table(a))
    md = (write_reports(a, tmp_path / "out", ("md",))[0]).read_text()
    assert "Speculative" not in md and "spec bitwise" not in md


def test_diff_matches_speculative_cells_by_id(run, tmp_path):
    d = diff_runs(run, run)
    assert d.equal and "s__bf16__tp1__bs1__ngram4" in {c.cell for c in d.compared}


def test_merge_keeps_the_settings_and_refuses_another_draft_of_one_name(tmp_path):
    cells = {"s__bio-tbik__tp1__bs1": (PLAIN, {}), "s__bio-tbik__tp1__bs1__draft2-d": (PLAIN, {})}
    kw = dict(speculative=("off", "draft:/x/d:2"), backends=("bio+tbik",))
    a = make_run(tmp_path / "a", cells, draft_checksum="aaa", **kw)
    b = make_run(tmp_path / "b", cells, draft_checksum="aaa", **kw)
    merged = merge_runs([a, b], tmp_path / "merged")
    assert merged.speculative["draft2-d"]["checksum"] == "aaa" and set(merged.cells) == set(cells)
    c = make_run(tmp_path / "c", cells, draft_checksum="ccc", **kw)
    with pytest.raises(DetauditError, match="another draft model or n-gram lookup under the same name .draft2-d"):
        merge_runs([a, c], tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
