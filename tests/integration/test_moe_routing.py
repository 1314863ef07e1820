"""Routing records through the CLI on a tiny Qwen3-MoE checkpoint written by transformers (with the
embedded model's tokenizer, so the smoke suite tokenizes): `detaudit sweep` over TP 1, 2 (real) x batch 1,
2 records each position's routing, prints and reports the routing metrics, and bio+tbik routes every
token the same way in every cell; `detaudit align` compares the rollout's routers with the trainer's and
replays the rollout's routing in the trainer."""

from __future__ import annotations

import math

import pandas as pd
import pyarrow.parquet as pq
import pytest
from helpers import cli_json, sweep_args, with_embedded_tokenizer
from typer.testing import CliRunner

from detaudit.cli import app

from .test_moe import build

pytestmark = pytest.mark.slow  # engines and TP-2 worker processes on a transformers-made checkpoint

runner = CliRunner()
MOE_LAYERS = 2  # the qwen3_moe checkpoint's layer 1 is a dense MLP
TOP_K = 2


@pytest.fixture(scope="module")
def moe_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe-cli") / "qwen3-moe"
    build("qwen3_moe", path, vocab_size=49152)
    return with_embedded_tokenizer(path)


def test_sweep_reports_routing_and_tbik_routes_invariantly(moe_ckpt, tmp_path):
    out = tmp_path / "run"
    grid = sweep_args(max_new_tokens=6, tp="1,2", batch_sizes="1,2", backends="bf16,bio+tbik", output_path=out)
    args = ["sweep", "--model", str(moe_ckpt), *grid]
    res = runner.invoke(app, args, env={"COLUMNS": "250"})
    assert res.exit_code == 0, res.output
    assert "rerouted" in res.output and "near ties" in res.output  # the printed summary's routing columns
    cells = sorted((out / "cells").glob("*.parquet"))
    assert len(cells) == 8
    for path in cells:  # every generated and teacher-forced position's routing, in every cell of both backends
        for r in pq.read_table(path).to_pylist():
            for prefix, positions in (("", len(r["output_token_ids"])), ("tf_", len(r["tf_token_logprobs"]))):
                experts, gates, margins = (r[f"{prefix}route_{c}"] for c in ("experts", "gates", "margins"))
                assert len(experts) == len(gates) == len(margins) == positions > 0, (path.name, prefix)
                assert all(len(e) == len(g) == MOE_LAYERS * TOP_K for e, g in zip(experts, gates)), path.name
                assert all(len(m) == MOE_LAYERS for m in margins), path.name
                assert all(0 < x <= 1 for g in gates for x in g) and all(x >= 0 for m in margins for x in m)
    rows = {r["backend"]: r for r in cli_json(runner.invoke(app, ["analyze", str(out), "--json"]))}
    tbik = rows["bio+tbik"]
    assert tbik["cells"] == 4 and tbik["unique_mean"] == 1 and tbik["maxprob_div_mean"] == 0
    assert tbik["routing_div"] == 0 and tbik["routed_tokens_div"] == 0 and tbik["routing_pairs"] > 0
    assert 0 <= rows["bf16"]["routing_div"] <= 1 and 0 <= tbik["near_tie_frac"] <= 1
    report = (out / "report.md").read_text()
    assert "| routing div |" in report and "**near ties**" in report
    assert "routing_div" in pd.read_csv(out / "summary.csv").columns
    gate = runner.invoke(app, ["gate", str(out)])
    assert gate.exit_code == 0, gate.output  # the default policy gates bio+tbik's routing divergence


def test_align_compares_routers_and_replays_the_rollout_routing(moe_ckpt, tmp_path):
    out = tmp_path / "align"
    args = ["align", "--model", str(moe_ckpt), "--rollout", "builtin:2", "--trainer", "builtin:1"]
    args += ["--backends", "bf16,bio+tbik", "--limit", "3", "--batch-size", "3", "--max-new-tokens", "8"]
    res = runner.invoke(app, [*args, "--output-path", str(out), "--json"])
    rows = {r["backend"]: r for r in cli_json(res)}
    tbik, bf16 = rows["bio+tbik"], rows["bf16"]
    assert tbik["tokens"] > 0 and tbik["bitwise_equal_frac"] == 1
    assert tbik["router_disagree_frac"] == 0 and tbik["tokens_router_disagree_frac"] == 0
    assert tbik["replay_bitwise_equal_frac"] == 1 and tbik["replay_dp_max"] == 0
    assert all(isinstance(bf16[c], float) for c in ("router_disagree_frac", "replay_bitwise_equal_frac", "replay_kl"))
    df = pd.read_parquet(out / "alignment.parquet")
    assert (df["routers"] == MOE_LAYERS).all() and df["replay_logprob"].notna().all()
    # replaying the rollout's routing changes no bit of a sequence whose routers all agreed with it
    for _, seq in df.groupby(["backend", "prompt_id"]):
        if (seq["routers_disagree"] == 0).all():
            assert (seq["replay_logprob"] == seq["trainer_logprob"]).all()
    assert "router_disagree_frac" in (out / "alignment.md").read_text()
    gate = runner.invoke(app, ["gate", str(out)])
    assert gate.exit_code == 0, gate.output
    assert not math.isnan(tbik["replay_kl"])
