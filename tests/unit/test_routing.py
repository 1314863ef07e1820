"""Routing metrics of mixture-of-experts runs on hand-made records (3 MoE layers, top 2: more layers than
experts per router, so expert ids grouped k-major could not pass for layer-major, as they could with
layers == top-k): routing divergence, tokens rerouted, near ties; the summary, the reports and the gate;
alignment's routing columns."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from detaudit.align import routing_metrics, shown_columns, summarize
from detaudit.analysis.analyze import analyze, expert_sets, near_ties, routers_differ, same_prefix_positions
from detaudit.analysis.gate import gate
from detaudit.analysis.metrics import NEAR_TIE_MARGIN
from detaudit.errors import DetauditError
from detaudit.render import summary_rows
from detaudit.render.markdown import render_markdown

from .test_analyze import TBIK, invariant_cells, make_run, rec

LAYERS, K = 3, 2
ROUTE = [3, 1, 0, 5, 2, 7]  # layer-major: layer 0 chose {1, 3}, layer 1 {0, 5}, layer 2 {2, 7}
MARGINS = [0.25, 0.5, 0.125]
GATES = [0.625, 0.375, 0.5625, 0.4375, 0.75, 0.25]


def moe_rec(prompt: int, ids, experts=None, margins=None, **kw) -> dict:
    """`rec` with routing: `experts` / `margins` per position (default ROUTE / MARGINS everywhere)."""
    n = len(ids)
    return {
        **rec(prompt, ids, **kw),
        "route_experts": experts if experts is not None else [ROUTE] * n,
        "route_gates": [GATES] * n,
        "route_margins": margins if margins is not None else [MARGINS] * n,
    }


def moe_cells(n_prompts: int = 3) -> dict[str, list[dict]]:
    """bio+tbik MoE cells that agree bit for bit, routing included: 3 prompts x 3 positions."""
    rows = [moe_rec(p, [10 + p, 11, 12], tf=[0.5, 0.25, 0.125], tf_ref=TBIK[1]) for p in range(n_prompts)]
    return {TBIK[1]: rows, TBIK[2]: [dict(r) for r in rows]}


def tbik_row(path) -> dict:
    return analyze(path).summary.set_index("backend").loc["bio+tbik"].to_dict()


# ---------------------------------------------------------------- pure functions


def test_expert_sets_ignore_the_order_of_choice():
    a = np.array([ROUTE])
    b = np.array([[1, 3, 5, 0, 7, 2]])  # each layer's two experts in the other order
    assert np.array_equal(expert_sets(a, LAYERS), expert_sets(b, LAYERS))
    assert expert_sets(a, LAYERS).tolist() == [[[1, 3], [0, 5], [2, 7]]]  # one row per layer, k per row
    assert not routers_differ([a, b], LAYERS, 1).any()
    with pytest.raises(DetauditError, match="do not split"):
        expert_sets(np.zeros((1, 5), dtype=np.int64), LAYERS)


def test_routers_differ_marks_the_router_that_chose_another_set():
    a = np.array([ROUTE, ROUTE, ROUTE])
    b = a.copy()
    b[1, 2] = 7  # position 1, layer 1: {7, 5} instead of {0, 5}
    got = routers_differ([a, a, b], LAYERS, 3)
    assert got.shape == (3, LAYERS)
    assert got.tolist() == [[False, False, False], [False, True, False], [False, False, False]]
    assert not routers_differ([a, b], LAYERS, 1).any()  # only the first position compared


def test_same_prefix_positions_include_the_first_divergence():
    assert same_prefix_positions([[1, 2, 3], [1, 2, 3]]) == 3
    assert same_prefix_positions([[1, 2, 3], [1, 9, 3]]) == 2  # position 1 was routed from the same prefix
    assert same_prefix_positions([[5], [6, 7]]) == 1
    assert same_prefix_positions([[1, 2], [1, 2, 3]]) == 2  # the shorter one ends
    assert same_prefix_positions([[], [1]]) == 0


def test_near_ties_count_margins_below_the_threshold():
    m = np.array([[0.0, NEAR_TIE_MARGIN], [NEAR_TIE_MARGIN / 2, 0.3]], dtype=np.float32)
    assert near_ties(m) == (2, 4)  # exact tie and half the threshold; the threshold itself is not below


# ---------------------------------------------------------------- analyze, report, gate


def test_identical_routing_gives_zero_and_the_gate_passes(tmp_path):
    run = make_run(tmp_path / "r", moe_cells(), backends=("bio+tbik",))
    row = tbik_row(run)
    assert row["routing_div"] == 0 and row["routed_tokens_div"] == 0
    assert row["routing_pairs"] == 3 * 3 * LAYERS and row["near_tie_frac"] == 0
    assert gate(run).passed


def test_one_router_of_one_position_differs_and_the_gate_fails(tmp_path):
    cells = moe_cells()
    other = [list(ROUTE) for _ in range(3)]
    other[2][3] = 6  # prompt 1, position 2, layer 1 chose {0, 6}: tokens and probabilities unchanged
    cells[TBIK[2]][1] = moe_rec(1, [11, 11, 12], experts=other, tf=[0.5, 0.25, 0.125], tf_ref=TBIK[1])
    run = make_run(tmp_path / "r", cells, backends=("bio+tbik",))
    row = tbik_row(run)
    assert row["routing_div"] == pytest.approx(1 / (3 * 3 * LAYERS)) and row["routing_pairs"] == 3 * 3 * LAYERS
    assert row["routed_tokens_div"] == pytest.approx(1 / 9)
    assert row["unique_mean"] == 1 and row["maxprob_div_mean"] == 0  # only the routing tells
    pp = analyze(run).per_prompt.set_index("prompt_id")
    assert pp.loc["p1", "routing_div"] == pytest.approx(1 / (3 * LAYERS)) and pp.loc["p0", "routing_div"] == 0
    result = gate(run)
    assert not result.passed
    # the routing columns are recorded numbers: the bitwise comparison of the records sees them too
    assert {(v.backend, v.metric) for v in result.violations} == {
        ("bio+tbik", "routing_div"),
        ("bio+tbik", "bitwise_diff_records"),
    }


def test_routing_after_the_first_divergence_is_not_compared(tmp_path):
    """The cells' tokens differ at position 1, so position 2 was routed from different prefixes: a
    difference there is not a routing divergence; one at position 1 is."""
    cells = moe_cells(1)
    late = [ROUTE, ROUTE, [2, 4, 0, 5, 2, 7]]
    cells[TBIK[2]] = [moe_rec(0, [10, 99, 12], experts=late)]
    assert tbik_row(make_run(tmp_path / "late", cells, backends=("bio+tbik",)))["routing_div"] == 0
    early = [ROUTE, [2, 4, 0, 5, 2, 7], ROUTE]
    cells[TBIK[2]] = [moe_rec(0, [10, 99, 12], experts=early)]
    row = tbik_row(make_run(tmp_path / "early", cells, backends=("bio+tbik",)))
    assert row["routing_pairs"] == 2 * LAYERS and row["routing_div"] == pytest.approx(1 / (2 * LAYERS))


def test_near_tie_rate_over_every_cell(tmp_path):
    cells = moe_cells(1)
    ties = [[0.0, 0.5, 0.5], MARGINS, [0.25, NEAR_TIE_MARGIN / 10, 0.5]]
    cells[TBIK[2]] = [moe_rec(0, [10, 11, 12], margins=ties)]
    row = tbik_row(make_run(tmp_path / "r", cells, backends=("bio+tbik",)))
    assert row["near_tie_frac"] == pytest.approx(2 / (2 * 3 * LAYERS)) and row["routing_div"] == 0


def test_dense_runs_leave_routing_empty_hidden_and_pass_the_gate(tmp_path):
    dense = make_run(tmp_path / "dense", invariant_cells(), backends=("bio+tbik",))
    a = analyze(dense)
    row = a.summary.iloc[0]
    assert all(math.isnan(row[c]) for c in ("routing_div", "routed_tokens_div", "routing_pairs", "near_tie_frac"))
    assert "routing div" not in summary_rows(a, "cli")[0] and "near ties" not in summary_rows(a)[0]
    assert "| routing div |" not in render_markdown(a) and "**routing div**" not in render_markdown(a)
    result = gate(dense)
    assert result.passed, result.violations
    moe = analyze(make_run(tmp_path / "moe", moe_cells(), backends=("bio+tbik",)))
    header, rows = summary_rows(moe, "cli")
    assert rows[0][header.index("routing div")] == "0" and rows[0][header.index("near ties")] == "0"
    assert "| routing div |" in render_markdown(moe) and "**routing div**" in render_markdown(moe)


def test_routing_of_another_shape_is_one_clear_error(tmp_path):
    cells = moe_cells(1)
    cells[TBIK[2]] = [moe_rec(0, [10, 11, 12], experts=[ROUTE + [1, 4, 6]] * 3)]  # 3 experts per router
    with pytest.raises(DetauditError, match="routing of different shapes"):
        analyze(make_run(tmp_path / "r", cells, backends=("bio+tbik",)))


# ---------------------------------------------------------------- alignment (`detaudit align`)


def align_frame(trainer_experts, replay=(-0.5, -1.25, -0.125)) -> pd.DataFrame:
    """3 sampled tokens of one backend with routing on both sides (3 MoE layers of top 2)."""
    rollout = (-0.5, -1.25, -0.125)
    rows = []
    for i, experts in enumerate(trainer_experts):
        differ = routers_differ([np.array([ROUTE]), np.array([experts])], LAYERS, 1)
        rows.append(
            dict(
                backend="bf16",
                rollout="builtin:2",
                trainer="builtin:1",
                rollout_logprob=rollout[i],
                trainer_logprob=rollout[i] - 0.01 * i,
                rollout_experts=ROUTE,
                trainer_experts=list(experts),
                routers=LAYERS,
                routers_disagree=int(differ.sum()),
                replay_logprob=replay[i],
            )
        )
    return pd.DataFrame(rows)


def test_alignment_routing_columns():
    df = align_frame([ROUTE, [3, 2, 0, 5, 2, 7], [4, 2, 6, 7, 7, 2]])  # 1, then 2 of 3 layers chose another set
    m = routing_metrics(df)
    assert m["router_disagree_frac"] == pytest.approx(3 / (3 * LAYERS))
    assert m["tokens_router_disagree_frac"] == pytest.approx(2 / 3)
    assert m["replay_bitwise_equal_frac"] == 1 and m["replay_dp_max"] == 0
    m = routing_metrics(align_frame([ROUTE] * 3, replay=(-0.5, -1.2, -0.125)))
    assert m["router_disagree_frac"] == 0 and m["replay_bitwise_equal_frac"] == pytest.approx(2 / 3)
    assert m["replay_dp_max"] > 0


def test_alignment_without_routing_leaves_the_columns_empty_and_hidden():
    df = align_frame([ROUTE] * 3).drop(columns=["rollout_experts", "trainer_experts", "routers_disagree"])
    df["routers"], df["replay_logprob"] = None, math.nan  # a dense model, or vLLM on either side
    summary = summarize(df)
    assert summary["router_disagree_frac"].isna().all() and summary["replay_kl"].isna().all()
    assert "router_disagree_frac" not in shown_columns(summary) and "kl" in shown_columns(summary)
    assert "router_disagree_frac" in shown_columns(summarize(align_frame([ROUTE] * 3)))


def test_the_console_tables_give_the_routing_columns_a_legend(tmp_path):
    """`detaudit analyze` (and `align`) print the routing columns only for MoE models; their short labels
    get a legend line each below the table, from the metrics' definitions; a dense run prints none."""
    from rich.console import Console

    from detaudit.analysis.metrics import routing_legend
    from detaudit.render import render_summary

    def printed(analysis) -> str:
        console = Console(record=True, width=2000)
        for r in render_summary(analysis):
            console.print(r)
        return console.export_text()

    moe = printed(analyze(make_run(tmp_path / "moe", moe_cells(), backends=("bio+tbik",))))
    for label in ("routing div", "tokens rerouted", "near ties"):
        assert f"\n{label}: MoE models: " in moe, (label, moe)
    dense = printed(analyze(make_run(tmp_path / "dense", invariant_cells(), backends=("bio+tbik",))))
    assert "MoE models" not in dense
    legend = routing_legend(shown_columns(summarize(align_frame([ROUTE] * 3))))
    assert [line.split(":")[0] for line in legend] == [
        "router_disagree_frac",
        "tokens_router_disagree_frac",
        "replay_bitwise_equal_frac",
        "replay_dp_max",
        "replay_dp_mean",
        "replay_kl",
    ]
