"""Synthetic models written as safetensors (`models prepare NAME --safetensors`, for engines that read
files): every parameter the built-in engine would draw, bit for bit, in hub-layout shards with their
index, and the built-in loader then reads those files. A small config stands in for the presets' sizes
(the same code writes them)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from detaudit import synthetic

SMALL = {
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "tie_word_embeddings": False,
}


def test_written_weights_are_the_drawn_ones_in_shards_with_an_index(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic, "SHARD_BYTES", 40_000)  # several shards at this size
    note = synthetic.write_safetensors(tmp_path, SMALL, "cpu")
    assert note == {"file_format": "safetensors", "generated_on": "cpu", "dtype": "torch.bfloat16"}
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    names = synthetic.parameter_names(SMALL)
    assert sorted(index["weight_map"]) == sorted(names) and len(names) == 2 + 2 * 11 + 1
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and all((tmp_path / s).exists() for s in shards)
    total = 0
    for shard in shards:
        with safe_open(str(tmp_path / shard), "pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                total += t.numel() * t.element_size()
                want = synthetic.make(SMALL, name, synthetic.SEED, synthetic.STD, torch.bfloat16, "cpu")
                assert torch.equal(t.view(torch.int16), want.view(torch.int16)), name
    assert total == index["metadata"]["total_size"]
    assert synthetic.has_weights(tmp_path)


def test_moe_parameter_names_cover_every_expert():
    cfg = {**SMALL, "num_experts": 3, "moe_intermediate_size": 32, "tie_word_embeddings": True}
    names = synthetic.parameter_names(cfg)
    assert "lm_head.weight" not in names and "model.layers.1.mlp.gate.weight" in names
    assert (
        "model.layers.0.mlp.experts.2.down_proj.weight" in names and "model.layers.0.mlp.down_proj.weight" not in names
    )
    for name in names:  # each has a shape: a name the model does not have would raise
        synthetic._shape(cfg, name)


def test_the_builtin_loader_reads_written_weights(tmp_path, monkeypatch):
    from detaudit.builtin import loader
    from detaudit.config import ModelRef

    (tmp_path / synthetic.MODEL_MANIFEST).write_text(json.dumps({"synthetic": {"seed": 0, "std": 0.02}}))
    ref = ModelRef("m", tmp_path, "Qwen3ForCausalLM", "x", SMALL, "m")
    drawn = []
    monkeypatch.setattr(loader, "ShardLoader", lambda *a: drawn.append("files") or "files")
    monkeypatch.setattr(synthetic, "RandomWeights", lambda *a: drawn.append("random") or "random")
    loader.open_weights(ref, None, torch.device("cpu"))
    synthetic.write_safetensors(tmp_path, SMALL, "cpu")
    loader.open_weights(ref, None, torch.device("cpu"))
    assert drawn == ["random", "files"]


@pytest.mark.slow  # resolves (hashes) the embedded model
def test_models_prepare_safetensors_adds_weights_to_a_prepared_model(tmp_path, monkeypatch, smollm):
    """The CLI path: a config-only preparation is redone with the weights; the manifest says where they
    were drawn, and the files are in its checksums (a small preset stands in for Qwen3-8B's 16 GB)."""
    from typer.testing import CliRunner

    from detaudit import models
    from detaudit.cli import app

    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "smollm2-135m").symlink_to(smollm.path)  # the tokenizer synthetic models borrow
    monkeypatch.setattr(models, "models_dir", lambda: tmp_path / "models")
    monkeypatch.setitem(synthetic.PRESETS, "qwen3-8b-shaped", synthetic.Preset("qwen3-8b-shaped", "small", SMALL))
    runner = CliRunner()
    res = runner.invoke(app, ["models", "prepare", "qwen3-8b-shaped"])
    assert res.exit_code == 0, res.output
    dest = tmp_path / "models" / "qwen3-8b-shaped"
    assert not synthetic.has_weights(dest)
    res = runner.invoke(app, ["models", "prepare", "qwen3-8b-shaped", "--safetensors", "--device", "cpu"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((dest / synthetic.MODEL_MANIFEST).read_text())
    assert manifest["synthetic"]["weights"]["generated_on"] == "cpu"
    assert any(f.endswith(".safetensors") for f in manifest["files"])
    assert models.verify(dest) == models.combined_checksum(manifest["files"])
    res = runner.invoke(app, ["models", "prepare", "smollm2-135m", "--safetensors"])
    assert res.exit_code == 2 and "applies to synthetic models" in res.output
