"""Issue 49's user sweep, through the CLI, on tiny checkpoints with narrow MLPs: `detaudit sweep --dtype
float32 --greedy --backends bio+tbik --tp 1,2,4,8 --batch-sizes 1,3` (real TP: one gloo worker a rank),
then `detaudit gate`, which must pass: every cell bitwise equal, in fp32, where a shard is as narrow as
one column.

Each checkpoint is a tiny random Qwen3-MoE (hidden 64, 8 heads and 8 KV heads of 16, so TP 8 shards
them; the embedded tokenizer) whose layer 0 has 8 experts (top 2) and layer 1 a dense MLP
(`mlp_only_layers`, the same decoder code as a dense Qwen3's MLP). Over the three checkpoints the dense
and the expert widths each take 8, 24 and 40, i.e. 1, 3 and 5 columns a rank at TP 8 (widths below
32 are where `F.silu`'s scalar tail once broke TP invariance at fp32). Three sweeps instead of six keep
CI time down."""

from __future__ import annotations

import json

import pytest
from helpers import sweep_args, with_embedded_tokenizer
from typer.testing import CliRunner

from detaudit.cli import app

from .test_moe import build

pytestmark = pytest.mark.slow  # worker processes for TP 2, 4 and 8

runner = CliRunner()


@pytest.mark.parametrize("dense,experts", [(8, 40), (24, 8), (40, 24)])
def test_fp32_tbik_sweep_over_narrow_shards_passes_the_gate(tmp_path, dense, experts):
    path = build(
        "qwen3_moe",
        tmp_path / "ckpt",
        vocab_size=49152,
        num_hidden_layers=2,
        intermediate_size=dense,
        moe_intermediate_size=experts,
    )
    with_embedded_tokenizer(path)
    out = tmp_path / "run"
    grid = sweep_args(greedy=True, dtype="float32", backends="bio+tbik", tp="1,2,4,8", batch_sizes="1,3")
    args = ["sweep", "--model", str(path), *grid]
    res = runner.invoke(app, [*args, "--no-analyze", "--output-path", str(out)])
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["cells"]) == 8 and manifest["config"]["dtype"] == "float32"
    gate = runner.invoke(app, ["gate", str(out)])
    assert gate.exit_code == 0, gate.output
    assert "PASSED" in gate.output
