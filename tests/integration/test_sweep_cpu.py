"""End to end on the embedded model, through the CLI: real TP over gloo on 2 cores, the backends,
analysis. Small settings (2 smoke prompts, a few new tokens) keep CI fast; the full grids are `make audit`
and reports/cpu-smoke."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import builtin_engine, cli_json, sweep_args
from typer.testing import CliRunner

from detaudit.builtin.local import cpu_cores
from detaudit.cli import app
from detaudit.config import DecodingParams
from detaudit.inputs.prepare import tokenizer_for
from detaudit.inputs.suites import load_suite, prompt_token_ids

pytestmark = pytest.mark.slow  # the real embedded model and/or worker processes

runner = CliRunner()


def test_real_tp_matches_tp1_on_the_real_model_fp32(smollm):
    """Real TP 2/4/8 (worker processes, gloo) on the smoke suite: greedy tokens equal TP 1's in fp32 with
    the native backend; logprobs within fp32 tolerance."""
    tok = tokenizer_for(smollm.path)
    suite = load_suite("smoke", limit=3)
    ids = [prompt_token_ids(tok, p) for p in suite.prompts]
    pids = [p.id for p in suite.prompts]
    dec = DecodingParams(greedy=True, max_new_tokens=8)
    ref = builtin_engine(smollm, "bf16", 1, dtype="float32").generate(ids, pids, dec, 3)
    for tp in (2, 4, 8):
        eng = builtin_engine(smollm, "bf16", tp, "real", dtype="float32")
        try:
            got = eng.generate(ids, pids, dec, 3)
            assert eng.describe()["threads_per_rank"] == max(1, cpu_cores() // tp)  # cores split over ranks
        finally:
            eng.close()
        assert [g.token_ids for g in got] == [g.token_ids for g in ref], tp
        for a, b in zip(got, ref):
            assert torch.allclose(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), atol=1e-4)


def test_sweep_bio_backends_real_tp(smollm, tmp_path):
    """Through the CLI with real gloo workers: bio+tbik is bitwise invariant over TP 1/4 x batch 1/2 (every
    recorded number of every record), the table says so and the default gate passes; a rerun skips every
    cell. (bf16 sweeps through the CLI: test_vllm.py and the default main job; TP 2 real vs emulated:
    test_tbik_dist.py; real TP 8: test_tbik_dist.py; TP 1/2/4/8 sweeps: reports/.)"""
    out = tmp_path / "run"
    args = ["sweep", *sweep_args(backends="bio,bio+tbik", tp="1,4", batch_sizes="1,2", output_path=out)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["cells"]) == 8
    threads = {k: v["threads_per_rank"] for k, v in manifest["backends"].items()}
    assert threads["bio+tbik@tp4"] == 1 and threads["bio+tbik@tp1"] >= 1
    res = runner.invoke(app, ["analyze", str(out), "--json"])
    rows = {r["backend"]: r for r in cli_json(res)}
    assert rows["bio+tbik"]["bitwise_diff_records"] == 0, rows["bio+tbik"]["bitwise_first_diff"]
    assert rows["bio+tbik"]["unique_mean"] == 1 and rows["bio+tbik"]["maxprob_div_mean"] == 0
    assert rows["bio"]["cells"] == 4
    assert (out / "report.md").exists()
    verdict = runner.invoke(app, ["gate", str(out), "--json"])
    assert verdict.exit_code == 0 and cli_json(verdict)["passed"], verdict.output  # the default policy
    # rerunning the same command skips every completed cell
    again = runner.invoke(app, [*args, "--no-analyze"])
    assert again.exit_code == 0 and "0 cell(s) computed, 8 skipped" in again.output
