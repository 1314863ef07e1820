"""The built-in engine's reading of config.json (`detaudit.builtin.arch`): transformers' defaults and
spellings, and every field it does not implement refused by name."""

from __future__ import annotations

import pytest

from detaudit.builtin.arch import ModelConfig
from detaudit.errors import DetauditError

BASE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "vocab_size": 300,
}
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def cfg(model_type: str, **over) -> ModelConfig:
    return ModelConfig.from_dict({"model_type": model_type, **BASE, **over})


@pytest.mark.parametrize(
    "model_type,over,field",
    [
        ("gpt2", {}, "model_type 'gpt2'"),
        ("llama", {"architectures": ["LlamaForSequenceClassification"]}, "architectures"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type 'yarn'"),
        ("llama", {"rope_parameters": {"rope_type": "longrope"}}, "rope_type 'longrope'"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
            "without low_freq_factor",
        ),
        ("llama", {"rope_parameters": {"rope_type": "linear"}}, "without a factor"),
        ("llama", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("llama", {"rope_parameters": {"full_attention": {"rope_type": "default"}}}, "per-layer-type rope_parameters"),
        ("llama", {"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
        ("llama", {"num_key_value_heads": 3}, "num_key_value_heads 3"),
        ("mistral", {"attention_bias": True}, "attention_bias"),
        ("qwen2", {"attention_bias": True}, "attention_bias"),
        ("qwen2", {"mlp_bias": True}, "mlp_bias"),
        ("qwen3", {"mlp_bias": True}, "mlp_bias"),
        ("mistral", {"layer_types": ["full_attention"] * 4}, "layer_types"),
        ("qwen2", {"layer_types": ["chunked_attention"] * 4}, "layer_types"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 0}, "sliding_window 0"),
        # not on the allow-list: refused by name whatever the value
        ("llama", {"attn_logit_softcapping": 50.0}, "config field attn_logit_softcapping"),
        ("qwen2", {"use_mrope": False, "final_logit_softcapping": 30.0}, "fields final_logit_softcapping, use_mrope"),
        ("llama", {"auto_map": {"AutoModelForCausalLM": "modeling.MyLlama"}}, "config field auto_map"),
        ("qwen2", {"rope_parameters": {"rope_type": "default", "mrope_section": [16, 24, 24]}}, "mrope_section"),
        # harmless at transformers' default value only
        ("llama", {"pretraining_tp": 2}, "pretraining_tp 2"),
        ("llama", {"is_encoder_decoder": True}, "is_encoder_decoder True"),
        ("mistral", {"chunk_size_feed_forward": 64}, "chunk_size_feed_forward 64"),
    ],
)
def test_unimplemented_fields_are_refused_by_name(model_type, over, field):
    with pytest.raises(DetauditError, match="not supported by the built-in engine") as e:
        cfg(model_type, **over)
    assert field in str(e.value) and "\n" not in str(e.value)


def test_config_errors_are_one_line(tmp_path):
    from detaudit.config import ModelRef
    from detaudit.models import read_config

    with pytest.raises(DetauditError, match="cannot read config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(DetauditError, match="cannot read config.json"):
        read_config(tmp_path)
    (tmp_path / "config.json").write_text("[1]")
    with pytest.raises(DetauditError, match="not a JSON object"):
        read_config(tmp_path)
    ref = ModelRef("m", tmp_path, "llama", "", {"model_type": "llama", "hidden_size": 64})
    with pytest.raises(DetauditError, match="missing or malformed field 'num_attention_heads'") as e:
        ModelConfig.of(ref)
    assert "\n" not in str(e.value)


def test_both_rope_spellings_read_alike():
    """transformers 5 writes `rope_parameters` (theta inside); older configs `rope_scaling` + `rope_theta`."""
    old = cfg("llama", rope_theta=500000.0, rope_scaling=dict(LLAMA3))
    new = cfg("llama", rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    assert old.rope == new.rope and new.rope.rope_type == "llama3" and new.rope.theta == 500000.0
    assert cfg("llama", rope_scaling={"type": "linear", "factor": 2.0}).rope.factor == 2.0  # the oldest key


def test_llama3_original_context_as_transformers_picks_it():
    rope = {k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}
    assert (
        cfg("llama", rope_parameters=rope, max_position_embeddings=4096).rope.original_max_position_embeddings == 4096
    )
    top = cfg("llama", rope_parameters=dict(LLAMA3), original_max_position_embeddings=1024)
    assert top.rope.original_max_position_embeddings == 1024


def test_biases_per_architecture():
    assert (cfg("llama").qkv_bias, cfg("llama").o_bias, cfg("llama").mlp_bias) == (False, False, False)
    llama = cfg("llama", attention_bias=True, mlp_bias=True)
    assert (llama.qkv_bias, llama.o_bias, llama.mlp_bias) == (True, True, True)
    qwen2 = cfg("qwen2")
    assert (qwen2.qkv_bias, qwen2.o_bias) == (True, False)
    qwen3 = cfg("qwen3", attention_bias=True)
    assert (qwen3.qkv_bias, qwen3.o_bias, qwen3.qk_norm) == (True, True, True)


def test_sliding_windows_as_transformers_resolves_them():
    # Qwen2.5 as shipped: a window declared but off
    assert cfg("qwen2", use_sliding_window=False, sliding_window=131072, max_window_layers=28).windows == (None,) * 4
    # on from max_window_layers
    assert cfg("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2).windows == (None, None, 64, 64)
    types = ["sliding_attention", "full_attention"] * 2
    assert cfg("qwen3", use_sliding_window=True, sliding_window=16, layer_types=types).windows == (16, None, 16, None)
    # Mistral: every layer, MistralConfig's default 4096 when the key is absent; null turns it off
    assert cfg("mistral").windows == (4096,) * 4
    assert cfg("mistral", sliding_window=None).windows == (None,) * 4
    assert cfg("llama", sliding_window=8).windows == (None,) * 4  # LlamaConfig has none (transformers ignores it)


def test_transformers_defaults_per_architecture():
    base = {k: v for k, v in BASE.items() if k != "num_key_value_heads"}
    qwen3 = ModelConfig.from_dict({"model_type": "qwen3", **base, "num_attention_heads": 32})
    assert qwen3.head_dim == 128 and qwen3.num_kv_heads == 32
    llama = ModelConfig.from_dict({"model_type": "llama", **base})
    assert llama.head_dim == 8 and llama.num_kv_heads == 8


def test_dynamic_rope_length_limit():
    c = cfg("llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0}, max_position_embeddings=128)
    c.check_length(128)
    with pytest.raises(DetauditError, match=r"beyond max_position_embeddings \(128 positions; this run needs 129\)"):
        c.check_length(129)
    cfg("llama").check_length(10**6)  # no limit without dynamic scaling


def test_unimplemented_moe_fields_are_refused_by_name():
    base = {
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "vocab_size": 300,
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
    }
    assert ModelConfig.from_dict(base).moe.num_experts == 8
    for key, value in (
        ("shared_expert_intermediate_size", 128),
        ("scoring_func", "sigmoid"),
        ("n_group", 4),
        ("capacity_factor", 1.25),
    ):
        with pytest.raises(DetauditError, match=key) as e:
            ModelConfig.from_dict({**base, key: value})
        assert "\n" not in str(e.value)
    with pytest.raises(DetauditError, match="num_experts_per_tok"):
        ModelConfig.from_dict({**base, "num_experts_per_tok": 9})


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"])
def test_transformers_config_classes_pass_whole(model_type):
    """Every key transformers' own config class writes (`to_dict()`: defaults included), plus the older
    spellings, is read or known to be harmless: a checkpoint saved by transformers is accepted as is."""
    from transformers import AutoConfig

    raw = AutoConfig.for_model(model_type).to_dict()
    raw.update(torch_dtype="bfloat16", rope_theta=10000.0, pretraining_tp=1, _model_name_or_path="x")
    assert ModelConfig.from_dict(raw).model_type == model_type


def test_detaudit_s_own_checkpoints_pass():
    """The synthetic presets' configs (the embedded model's is read by every engine test)."""
    from detaudit import synthetic

    for preset in synthetic.PRESETS.values():
        ModelConfig.from_dict(preset.config)


def test_tp_beyond_the_kv_heads_replicates_them():
    """TP 8 over `qwen3-30b-a3b-shaped`'s 4 KV heads holds each head on 2 ranks (as vLLM and SGLang do);
    a TP size that neither divides the KV heads nor is a multiple of them is refused by name."""
    from detaudit import synthetic

    moe = ModelConfig.from_dict(synthetic.PRESETS["qwen3-30b-a3b-shaped"].config)
    for tp, replicas in ((1, 1), (2, 1), (4, 1), (8, 2)):
        moe.check_tp(tp)
        assert moe.kv_replicas(tp) == replicas
    three = cfg("llama", num_attention_heads=12, num_key_value_heads=3, head_dim=16)
    three.check_tp(1)
    for tp in (2, 4, 8):
        with pytest.raises(DetauditError, match=rf"TP {tp} neither divides the model's KV heads \(3\)"):
            three.check_tp(tp)
