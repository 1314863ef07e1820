"""Metrics on hand-built record sets with known answers.

`make_run` / `rec` are also used by test_report.py and test_gate.py (imported as `test_analyze`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from detaudit.analysis.analyze import (
    accuracy_std,
    agreement_matrix,
    analyze,
    first_divergence,
    maxprob_divergence_by_position,
    nothing_to_compare,
    teacher_forced_by_position,
    top5_probs,
    unique_count,
)
from detaudit.config import SweepConfig
from detaudit.errors import DetauditError
from detaudit.runs.manifest import Manifest
from detaudit.runs.records import COLUMNS
from detaudit.runs.rundir import RunDir

SUITE = "smoke"
BF16 = {1: "smoke__bf16__tp1__bs1", 2: "smoke__bf16__tp2__bs1"}
TBIK = {1: "smoke__bio-tbik__tp1__bs1", 2: "smoke__bio-tbik__tp2__bs1"}

# default top-k distribution of every position: 6 entries, descending, exact in float32 log space
DEFAULT_TOPK = [0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625]


# ---------------------------------------------------------------- helpers


def rec(prompt: int, ids, topk=None, tf=None, correct=None, tf_ref=None) -> dict:
    """One record. `topk`: per position a list of probabilities (stored as log-probabilities);
    default: DEFAULT_TOPK at every position. `tf`: teacher-forced probabilities."""
    ids = list(ids)
    topk = topk if topk is not None else [DEFAULT_TOPK] * len(ids)
    return dict(
        prompt_index=prompt,
        prompt_id=f"p{prompt}",
        output_token_ids=ids,
        topk_ids=[list(range(len(row))) for row in topk],
        topk_logprobs=[[math.log(p) for p in row] for row in topk],
        token_logprobs=[math.log(row[0]) for row in topk],
        tf_token_logprobs=None if tf is None else [math.log(p) for p in tf],
        tf_reference_cell=tf_ref,
        correct=correct,
    )


def make_run(
    path: Path,
    cells: dict[str, list[dict]],
    *,
    backends=("bf16", "bio+tbik"),
    tp=(1, 2),
    batch_sizes=(1,),
    suites=(SUITE,),
    states: dict[str, tuple[str, str]] | None = None,
    tp_mode: str = "real",
    manifest_extra: dict | None = None,
    identity: dict | None = None,
) -> Path:
    """A run directory: the grid of `SweepConfig(...)`, cells listed in `cells` written as done,
    cells in `states` marked (state, error), the others left pending. `identity` overrides entries of
    the manifest's `comparable` (model checksum, suite checksums, decoding, ...)."""
    cfg = SweepConfig(
        model="tiny",
        suites=tuple(suites),
        backends=tuple(backends),
        tp=tuple(tp),
        batch_sizes=tuple(batch_sizes),
        tp_mode=tp_mode,
    )
    manifest = {
        "comparable": {
            "model_checksum": "tiny-ck",
            "suites": {s: f"{s}-ck" for s in suites},
            "decoding": cfg.decoding.to_dict(),
            "dtype": cfg.engine.dtype,
            "limit": cfg.limit,
            "engine": cfg.engine.name,
            **(identity or {}),
        },
        "code_version": "0.1.0",
        "config": cfg.to_dict(),
        "model": {"name": "tiny"},
        "environment": {"python": "3.11", "torch": "2.13", "hardware": {"cpu": "test"}},
        "command": "detaudit sweep --model tiny --suites smoke",
        "cells": {
            c.id: dict(
                backend=c.backend,
                tp=c.tp,
                batch_size=c.batch_size,
                suite=c.suite,
                tp_mode=tp_mode if c.tp > 1 else "real",
                state="pending",
            )
            for c in cfg.cells()
        },
        **(manifest_extra or {}),
    }
    run = RunDir(path)
    with run.locked():
        run.init_or_check(Manifest.from_dict(json.loads(json.dumps(manifest))))  # as read from disk
        for cid, rows in cells.items():
            meta = manifest["cells"][cid]
            full = []
            for r in rows:
                row = {c: None for c in COLUMNS}
                row.update(
                    cell_id=cid,
                    model=manifest["model"]["name"],  # as the sweep writes it: rows and manifest agree
                    suite=meta["suite"],
                    backend=meta["backend"],
                    tp=meta["tp"],
                    batch_size=meta["batch_size"],
                    tp_mode=meta["tp_mode"],
                    engine="builtin",
                    prompt_hash="h",
                    prompt_tokens=3,
                    output_text="",
                    finish_reason="length",
                )
                row.update(r)
                full.append(row)
            run.write_cell(cid, full, {"wall_s": 1.5})
        for cid, (state, error) in (states or {}).items():
            run.mark(cid, state, error=error)
    return path


def invariant_cells(n_prompts: int = 3, tf: bool = True) -> dict[str, list[dict]]:
    """bio+tbik cells that agree bit for bit."""
    rows = [
        rec(
            p,
            [10 + p, 11, 12],
            tf=[0.5, 0.25, 0.125] if tf else None,
            correct=p % 2 == 0,
            tf_ref=TBIK[1] if tf else None,
        )
        for p in range(n_prompts)
    ]
    return {TBIK[1]: rows, TBIK[2]: [dict(r) for r in rows]}


def p32(p: float) -> float:
    """The probability analyze() sees for p after the float32 round trip of the record."""
    return float(np.exp(np.float64(np.float32(math.log(p)))))


def lp(rows):
    return [[math.log(p) for p in row] for row in rows]


# ---------------------------------------------------------------- pure functions


def test_unique_count():
    assert unique_count([[1, 2], [1, 2], [1, 3], []]) == 3
    assert unique_count([[], []]) == 1
    assert unique_count([np.array([1, 2], dtype=np.int32), [1, 2]]) == 1
    assert unique_count([[1], [1, 0]]) == 2  # a prefix is a different output


def test_first_divergence():
    assert first_divergence([[1, 2, 3], [1, 2, 3]]) is None
    assert first_divergence([[1, 2, 3]]) is None
    assert first_divergence([[1, 2, 3], [1, 2, 4], [1, 2, 3]]) == 2
    assert first_divergence([[5, 2], [6, 2]]) == 0
    assert first_divergence([[1, 2], [1, 2, 3]]) == 2  # a strict prefix diverges where it ends
    assert first_divergence([[], [7]]) == 0
    assert first_divergence([[], []]) is None


def test_top5_probs_sorts_truncates_and_pads():
    m = top5_probs(lp([[0.1, 0.4, 0.2, 0.05, 0.15, 0.1], [0.6, 0.4]]))
    assert m.shape == (2, 5)
    np.testing.assert_allclose(m[0], [0.4, 0.2, 0.15, 0.1, 0.1], rtol=1e-12)
    np.testing.assert_allclose(m[1], [0.6, 0.4, 0, 0, 0], rtol=1e-12)
    assert top5_probs(None).shape == (0, 5)
    assert top5_probs([]).shape == (0, 5)


def test_maxprob_divergence_exact_numbers():
    a = top5_probs(lp([[0.5, 0.2, 0.1, 0.1, 0.05], [0.9, 0.05, 0.02, 0.02, 0.01]]))
    b = top5_probs(lp([[0.4, 0.3, 0.1, 0.1, 0.05], [0.9, 0.05, 0.02, 0.02, 0.01]]))
    c = top5_probs(lp([[0.45, 0.25, 0.1, 0.1, 0.02]]))  # shorter output: 1 position
    d = maxprob_divergence_by_position([a, b])
    assert d == pytest.approx([0.1, 0.0], abs=1e-12)
    d3 = maxprob_divergence_by_position([a, b, c])  # only position 0: max-min over 3 cells per rank
    assert d3 == pytest.approx([0.1], abs=1e-12)
    assert maxprob_divergence_by_position([a, top5_probs([])]).size == 0  # empty output: no position


def test_maxprob_divergence_is_rank_wise_with_ties():
    # the same top-5 probabilities with tied ranks (token ids may be ordered differently): 0
    tie = lp([[0.3, 0.3, 0.2, 0.1, 0.1]])
    assert maxprob_divergence_by_position([top5_probs(tie), top5_probs(tie)]).tolist() == [0.0]
    # rank 2 and 3 tie in one cell, not in the other
    x = top5_probs(lp([[0.4, 0.2, 0.2, 0.1, 0.1]]))
    y = top5_probs(lp([[0.4, 0.25, 0.15, 0.1, 0.1]]))
    assert maxprob_divergence_by_position([x, y]) == pytest.approx([0.05], abs=1e-12)


def test_maxprob_divergence_identical_is_exactly_zero():
    rows = np.log(np.random.default_rng(0).dirichlet(np.ones(8), size=50)).astype(np.float32)
    p = [top5_probs(rows) for _ in range(4)]
    d = maxprob_divergence_by_position(p)
    assert d.shape == (50,) and (d == 0.0).all()


def test_teacher_forced_by_position():
    ref = [math.log(0.5), math.log(0.25)]
    cells = [ref, [math.log(0.4), math.log(0.25)], [math.log(0.5), math.log(0.3)]]
    assert teacher_forced_by_position(cells, ref) == pytest.approx([0.1, 0.05], abs=1e-12)
    assert teacher_forced_by_position([ref, ref], ref).tolist() == [0.0, 0.0]


def test_accuracy_std_is_population_std():
    assert accuracy_std([1.0, 0.5]) == pytest.approx(0.25)
    assert accuracy_std([1.0, 0.5, 0.5, 0.0]) == pytest.approx(math.sqrt(0.125))
    assert accuracy_std([0.7]) == 0.0
    assert math.isnan(accuracy_std([math.nan]))


def test_agreement_matrix():
    m = agreement_matrix(
        {
            "a": {"p0": [1, 2], "p1": [3], "p2": [4]},
            "b": {"p0": [1, 2], "p1": [3, 3], "p2": [4]},
            "c": {"p0": [9], "p1": [3], "p2": [4]},
        }
    )
    assert m.loc["a", "a"] == 1.0
    assert m.loc["a", "b"] == m.loc["b", "a"] == pytest.approx(2 / 3)
    assert m.loc["a", "c"] == pytest.approx(2 / 3)
    assert m.loc["b", "c"] == pytest.approx(1 / 3)


# ---------------------------------------------------------------- analyze() end to end


def diverging_bf16() -> dict[str, list[dict]]:
    """p0: same tokens, different probabilities at position 1; p1: tokens differ at position 2;
    p2: tp2's output is empty (no comparable position)."""
    t = DEFAULT_TOPK
    return {
        BF16[1]: [
            rec(0, [1, 2, 3], topk=[t, t, t], correct=True, tf=[0.5, 0.25], tf_ref=BF16[1]),
            rec(1, [1, 2, 3, 4], topk=[t, t, t, t], correct=True, tf=[0.5, 0.5], tf_ref=BF16[1]),
            rec(2, [7, 7], correct=False, tf=[0.5], tf_ref=BF16[1]),
        ],
        BF16[2]: [
            rec(
                0,
                [1, 2, 3],
                topk=[t, [0.25, 0.25, 0.125, 0.0625, 0.03125], t],
                correct=True,
                tf=[0.5, 0.5],
                tf_ref=BF16[1],
            ),
            rec(1, [1, 2, 5], topk=[t, t, [0.5, 0.5, 0.5, 0.5, 0.5]], correct=False, tf=[0.25, 0.5], tf_ref=BF16[1]),
            rec(2, [], topk=[], correct=False, tf=[0.5], tf_ref=BF16[1]),
        ],
    }


@pytest.fixture
def audit(tmp_path):
    return analyze(make_run(tmp_path / "run", {**diverging_bf16(), **invariant_cells()}))


def test_analyze_summary_known_answers(audit):
    s = audit.summary.set_index("backend")
    assert list(audit.summary["backend"]) == ["bf16", "bio+tbik"]
    bf, tb = s.loc["bf16"], s.loc["bio+tbik"]
    assert bf["cells"] == 2 and bf["prompts"] == 3 and tb["cells"] == 2 and tb["prompts"] == 3

    assert bf["unique_mean"] == pytest.approx(5 / 3)  # 1, 2, 2
    assert tb["unique_mean"] == 1.0 and tb["unique_max"] == 1.0

    # p0: positions 0..2 diverge 0, 0.25, 0 -> 0.25/3 ; p1: 0, 0, 0.5-... rank-wise max -> see below
    d0 = (p32(0.5) - p32(0.25)) / 3
    d1 = (
        max(
            p32(0.5) - p32(0.5),
            p32(0.5) - p32(0.25),
            p32(0.5) - p32(0.125),
            p32(0.5) - p32(0.0625),
            p32(0.5) - p32(0.03125),
        )
        / 3
    )
    assert bf["maxprob_div_mean"] == pytest.approx((d0 + d1) / 2, abs=1e-12)
    assert bf["maxprob_excluded"] == 1  # p2: empty output
    # prefix: p0 identical tokens -> all 3 positions; p1 diverges at 2 -> positions 0, 1 (both 0)
    assert bf["prefix_div_mean"] == pytest.approx((d0 + 0.0) / 2, abs=1e-12)
    assert tb["maxprob_div_mean"] == 0.0 and tb["prefix_div_mean"] == 0.0

    # first divergence: p0 none, p1 at 2, p2 at 0 -> median 1
    assert bf["first_div_median"] == 1.0 and bf["identical_prompts"] == 1
    assert math.isnan(tb["first_div_median"]) and tb["identical_prompts"] == 3

    # teacher forcing against bf16 tp1: p0 max .25 (pos 1), p1 .25 (pos 0), p2 0
    assert bf["teacher_forced_div_max"] == pytest.approx(p32(0.5) - p32(0.25), abs=1e-12)
    assert bf["teacher_forced_div_mean"] == pytest.approx((0.125 + 0.125 + 0) / 3, abs=1e-6)
    assert tb["teacher_forced_div_max"] == 0.0 and tb["teacher_forced_div_mean"] == 0.0

    # accuracy: tp1 2/3, tp2 1/3 -> mean 0.5, population std 1/6
    assert bf["acc_mean"] == pytest.approx(0.5) and bf["acc_std"] == pytest.approx(1 / 6)
    assert tb["acc_std"] == 0.0
    # lengths: p0 (3,3) std 0; p1 (4,3) 0.5; p2 (2,0) 1 -> 0.5
    assert bf["len_std"] == pytest.approx(0.5)
    assert bf["failed_cells"] == 0 and not bf["emulated"]


def test_bitwise_diff_records(audit, tmp_path):
    """Every record of the bf16 cells differs (p0 first in token_logprobs at position 1: 0.25 vs 0.5);
    the bio+tbik cells are bitwise equal. A prompt one cell lacks is a differing record too."""
    s = audit.summary.set_index("backend")
    assert s.loc["bf16", "bitwise_diff_records"] == 3 and s.loc["bio+tbik", "bitwise_diff_records"] == 0
    assert (
        s.loc["bf16", "bitwise_first_diff"]
        == f"{BF16[2]} differs from {BF16[1]}: token_logprobs, prompt p0, position 1"
    )
    assert s.loc["bio+tbik", "bitwise_first_diff"] == ""
    cells = invariant_cells()
    cells[TBIK[2]] = cells[TBIK[2]][:2]
    s = analyze(make_run(tmp_path / "short", cells, backends=("bio+tbik",))).summary.iloc[0]
    assert s["bitwise_diff_records"] == 1 and s["unique_mean"] == 1  # the unique count sees no difference
    assert s["bitwise_first_diff"] == f"{TBIK[2]} differs from {TBIK[1]}: prompt p2 in one cell only"


def test_bitwise_compares_repeats_as_configurations(tmp_path):
    """--repeats: each (cell, repeat) is compared with the first cell's repeat 0."""
    rows = invariant_cells(n_prompts=2)[TBIK[1]]
    again = [dict(r, repeat=1) for r in rows]
    again[1]["topk_ids"] = [list(reversed(k)) for k in again[1]["topk_ids"]]  # swapped top-k ids only
    run = make_run(tmp_path / "r", {TBIK[1]: rows + again}, backends=("bio+tbik",), tp=(1,))
    s = analyze(run).summary.iloc[0]
    assert s["bitwise_diff_records"] == 1 and s["maxprob_div_mean"] == 0
    assert s["bitwise_first_diff"] == f"{TBIK[1]}#r1 differs from {TBIK[1]}#r0: topk_ids, prompt p1, position 0"
    third = [dict(r, repeat=2) for r in rows]  # three configurations: repeats 0 and 1 equal, 2 differs
    third[0]["token_logprobs"] = [third[0]["token_logprobs"][0], -1.0, third[0]["token_logprobs"][2]]
    run = make_run(
        tmp_path / "r3", {TBIK[1]: rows + [dict(r, repeat=1) for r in rows] + third}, backends=("bio+tbik",), tp=(1,)
    )
    s = analyze(run).summary.iloc[0]
    assert s["bitwise_diff_records"] == 1
    assert s["bitwise_first_diff"] == f"{TBIK[1]}#r2 differs from {TBIK[1]}#r0: token_logprobs, prompt p0, position 1"


def test_bitwise_needs_two_cells_and_refuses_a_corrupt_cell(tmp_path):
    cells = invariant_cells()
    a = analyze(make_run(tmp_path / "one", {TBIK[1]: cells[TBIK[1]]}, backends=("bio+tbik",)))
    assert math.isnan(a.summary.iloc[0]["bitwise_diff_records"])  # one cell compares nothing: not 0
    twice = {TBIK[1]: cells[TBIK[1]], TBIK[2]: cells[TBIK[2]] + cells[TBIK[2]][:1]}
    with pytest.raises(DetauditError, match=f"cell {TBIK[2]} is corrupt: a cell holds two records of prompt p0"):
        analyze(make_run(tmp_path / "dup", twice, backends=("bio+tbik",)))


def test_bitwise_compares_every_configuration_with_the_first(tmp_path):
    """Three configurations: a difference in the third alone, in the second alone, and in both, is
    counted per differing configuration and named where it first shows (grid order)."""
    from .record_flips import CELLS3, FLIPS, LAST, TP3, moe_cells3

    def row(changed: tuple[str, ...], name: str):
        cells = moe_cells3()
        for cell in changed:
            FLIPS[9].change(cells[cell][1])  # a routing margin, 1 ulp
        return analyze(make_run(tmp_path / name, cells, backends=("bio+tbik",), tp=TP3)).summary.iloc[0]

    where = "route_margins, prompt p1, position 2"
    for changed, count, first in (
        ((LAST,), 1, LAST),
        ((CELLS3[2],), 1, CELLS3[2]),
        ((CELLS3[2], LAST), 2, CELLS3[2]),
    ):
        s = row(changed, first + str(count))
        assert s["bitwise_diff_records"] == count and s["cells"] == 3, changed
        assert s["bitwise_first_diff"] == f"{first} differs from {CELLS3[1]}: {where}", changed
        assert s["unique_mean"] == 1 and s["routing_div"] == 0 and s["maxprob_div_mean"] == 0


def test_every_metric_sees_a_difference_in_the_third_configuration(tmp_path):
    """Three MoE configurations, the first two equal; the third differs in one place per metric: its
    tokens (p0 at position 2), its answer (p0), its top-k (p1 at position 1), its teacher-forced
    log-probability and one router (p2 at position 0). Every metric compares all three."""
    from .record_flips import CELLS3, LAST, TP3, moe_cells3

    cells = moe_cells3()
    p0, p1, p2 = cells[LAST]
    p0["output_token_ids"][2] += 1
    p0["correct"] = not p0["correct"]
    p1["topk_logprobs"][1] = [math.log(p) for p in [0.25] + DEFAULT_TOPK[1:]]
    p2["tf_token_logprobs"][0] = math.log(0.25)
    p2["route_experts"][0][0] = 4  # layer 0: {1, 4} instead of {1, 3}
    a = analyze(make_run(tmp_path / "r", cells, backends=("bio+tbik",), tp=TP3))
    s = a.summary.iloc[0]
    assert s["cells"] == 3 and s["bitwise_diff_records"] == 3
    assert s["unique_mean"] == pytest.approx(4 / 3) and s["unique_max"] == 2
    assert s["first_div_median"] == 2 and s["identical_prompts"] == 2
    spread = p32(0.5) - p32(0.25)
    assert s["maxprob_div_mean"] == pytest.approx(spread / 3 / 3, abs=1e-12)
    assert s["prefix_div_mean"] == pytest.approx(spread / 3 / 3, abs=1e-12)  # p0 before position 2: 0
    assert s["teacher_forced_div_max"] == pytest.approx(spread, abs=1e-12)
    assert s["routing_div"] == pytest.approx(1 / 27) and s["routed_tokens_div"] == pytest.approx(1 / 9)
    assert s["acc_std"] == pytest.approx(math.sqrt(2) / 9)  # accuracies 2/3, 2/3, 1/3
    cell = a.per_cell.set_index("cell_id")
    assert cell.loc[CELLS3[2], "agree_ref"] == 1 and cell.loc[LAST, "agree_ref"] == pytest.approx(2 / 3)
    assert a.agreement[(SUITE, "bio+tbik")].loc[CELLS3[2], LAST] == pytest.approx(2 / 3)


def test_analyze_per_prompt_per_cell_agreement(audit):
    pp = audit.per_prompt[audit.per_prompt["backend"] == "bf16"].set_index("prompt_id")
    assert pp["unique"].tolist() == [1, 2, 2]
    assert pp.loc["p1", "first_div"] == 2 and pp.loc["p2", "first_div"] == 0
    assert pd.isna(pp.loc["p0", "first_div"])
    assert pp.loc["p1", "prefix_positions"] == 2 and pp.loc["p2", "maxprob_positions"] == 0
    assert math.isnan(pp.loc["p2", "maxprob_div"])

    cells = audit.per_cell.set_index("cell_id")
    assert list(audit.per_cell["cell_id"]) == [BF16[1], BF16[2], TBIK[1], TBIK[2]]
    assert cells.loc[BF16[1], "acc"] == pytest.approx(2 / 3)
    assert cells.loc[BF16[2], "agree_ref"] == pytest.approx(1 / 3)

    m = audit.agreement[(SUITE, "bf16")]
    assert m.loc[BF16[1], BF16[2]] == pytest.approx(1 / 3)
    assert (audit.agreement[(SUITE, "bio+tbik")].to_numpy() == 1.0).all()

    pos = audit.divergence_by_position
    bfp = pos[pos["backend"] == "bf16"].set_index("position")
    assert bfp.loc[0, "diverged_frac"] == pytest.approx(1 / 3)  # p2 diverged at 0
    assert bfp.loc[2, "diverged_frac"] == pytest.approx(2 / 3)
    assert bfp.loc[1, "prompts"] == 2


def test_failed_missing_and_emulated_cells(tmp_path):
    cells = invariant_cells()
    run = make_run(
        tmp_path / "r",
        {**cells, BF16[1]: diverging_bf16()[BF16[1]]},
        states={BF16[2]: ("failed", "worker 1 ran out of memory")},
        tp_mode="emulated",
    )
    a = analyze(run)
    s = a.summary.set_index("backend")
    assert s.loc["bf16", "cells"] == 1 and s.loc["bf16", "failed_cells"] == 1
    assert s.loc["bf16", "failed_cell_ids"] == BF16[2]
    assert s.loc["bf16", "unique_mean"] == 1.0  # one cell: trivially
    assert math.isnan(s.loc["bf16", "maxprob_div_mean"])  # ... but it compares nothing: not 0
    assert math.isnan(s.loc["bf16", "teacher_forced_div_max"])
    assert s.loc["bio+tbik", "emulated"]
    assert a.per_cell.set_index("cell_id").loc[BF16[2], "error"] == "worker 1 ran out of memory"
    # one done bf16 cell compares nothing: the analysis says so (reports and the gate print its notes)
    note = nothing_to_compare(a.summary, a.per_cell)
    assert note.startswith("smoke/bf16: 1 of 2 cells done.") and f"nothing to compare: {note}" in a.notes

    (run / "cells" / f"{TBIK[2]}.parquet").unlink()
    a = analyze(run)
    row = a.per_cell.set_index("cell_id").loc[TBIK[2]]
    assert row["state"] == "missing" and "missing" in row["error"]
    assert a.summary.set_index("backend").loc["bio+tbik", "failed_cells"] == 1


def test_bad_input_is_detaudit_error(tmp_path):
    with pytest.raises(DetauditError, match="does not exist"):
        analyze(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DetauditError, match="not a detaudit run"):
        analyze(tmp_path / "empty")
    run = make_run(tmp_path / "r", invariant_cells())
    (run / "manifest.json").write_text("{not json")
    with pytest.raises(DetauditError, match="corrupt"):
        analyze(run)
    run = make_run(tmp_path / "r2", invariant_cells())
    f = run / "cells" / f"{TBIK[1]}.parquet"
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(DetauditError, match="truncated"):
        analyze(run)


def test_analyze_a_full_grid_of_long_outputs(tmp_path):
    """12 cells x 40 prompts x 400 positions (the vectorised top-5 path); its speed is a benchmark
    matter, not asserted here."""
    rng = np.random.default_rng(1)
    cells = {}
    cfg_tp, cfg_bs = (1, 2, 4, 8), (1, 2, 3)
    base = rng.integers(0, 1000, size=(40, 400))
    topk = np.sort(np.log(rng.dirichlet(np.ones(10), size=400)), axis=1)[:, ::-1].astype(np.float32).tolist()
    for tp in cfg_tp:
        for bs in cfg_bs:
            ids = base.copy()
            ids[:, 200 + tp * 10 + bs :] += 1
            cells[f"smoke__bf16__tp{tp}__bs{bs}"] = [
                dict(
                    prompt_index=p,
                    prompt_id=f"p{p}",
                    output_token_ids=ids[p].tolist(),
                    topk_logprobs=topk,
                    tf_token_logprobs=None,
                    correct=bool(p % 2),
                )
                for p in range(40)
            ]
    run = make_run(tmp_path / "big", cells, backends=("bf16",), tp=cfg_tp, batch_sizes=cfg_bs)
    a = analyze(run)
    row = a.summary.iloc[0]
    assert row["cells"] == 12 and row["prompts"] == 40 and row["unique_mean"] == 12.0
    assert row["first_div_median"] == 211.0 and row["maxprob_div_mean"] == 0.0
