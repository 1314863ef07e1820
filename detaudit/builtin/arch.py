"""What the built-in engine computes for a checkpoint: config.json read as transformers reads it for the
supported architectures, and every field that would change the computation but is not implemented
refused by name (never ignored).

Supported (transformers' own classes are the reference, defaults included):
- `llama` (LlamaForCausalLM): `attention_bias` (q/k/v/o biases), `mlp_bias` (gate/up/down biases);
- `qwen2` (Qwen2ForCausalLM): q/k/v biases, no o bias; `use_sliding_window` / `sliding_window` /
  `max_window_layers` / `layer_types` as Qwen2Config resolves them;
- `qwen3` (Qwen3ForCausalLM): QK-norm, `attention_bias`, sliding-window semantics as Qwen2;
- `mistral` (MistralForCausalLM): `sliding_window` on every layer (4096 when the key is absent, as
  MistralConfig's default);
- `qwen3_moe` (Qwen3MoeForCausalLM): Qwen3's attention, mixture-of-experts MLPs (`num_experts` /
  `num_local_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`) on the layers
  `decoder_sparse_step` and `mlp_only_layers` select, dense MLPs (`intermediate_size`) on the others;
- `mixtral` (MixtralForCausalLM): Mistral's attention (`sliding_window` where set), mixture-of-experts
  MLPs on every layer with the top-k gates renormalised; `router_jitter_noise` is a training-time
  perturbation (transformers applies it only in training mode), so inference ignores it as transformers
  does.
Mixture-of-experts fields the engine does not implement are refused by name: shared experts, expert
capacity / token dropping, other router scoring functions or grouped top-k.
RoPE (`rope_parameters`, or the older `rope_scaling` + `rope_theta`): `default`, `linear`, `llama3`, and
`dynamic` up to `max_position_embeddings` positions (beyond that transformers rescales by the longest
sequence of the current forward call, which the engine refuses rather than imitates).

The keys of config.json are an allow-list: those the engine reads (`READ`, each checked below), those
that change nothing it computes (`HARMLESS`, with the reason), and those harmless at one value only
(`NEUTRAL`). Any other key is refused by name: a field the engine does not know may change the
computation (`attn_logit_softcapping`, `use_mrope`, ...). The lists come from the config classes of
Llama, Qwen2, Qwen3, Mistral, Qwen3-MoE and Mixtral in transformers 5 (`Config().to_dict()`), the older spellings of the
same fields, and the checkpoints detaudit prepares (the embedded model, the synthetic presets).

Nothing here imports torch: the sweep can run the check before any model work.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from detaudit.config import ModelRef
from detaudit.errors import DetauditError

ARCHITECTURES = {  # model_type -> the transformers class whose computation the engine reproduces
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}
SUPPORTED = tuple(ARCHITECTURES)
ROPE_TYPES = ("default", "linear", "dynamic", "llama3")

READ = frozenset(  # read by `ModelConfig.from_dict`, `_rope` and `_windows`: implemented, or refused by value
    {
        "model_type",
        "architectures",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "rms_norm_eps",
        "hidden_act",
        "max_position_embeddings",
        "tie_word_embeddings",
        "attention_bias",
        "mlp_bias",
        "quantization_config",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "partial_rotary_factor",
        "original_max_position_embeddings",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "layer_types",
        "num_experts",  # mixture of experts: `_moe`
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
    }
)
HARMLESS = {  # keys that change nothing the forward pass computes
    "transformers_version": "the version of transformers that wrote the file",
    "_name_or_path": "where the checkpoint came from",
    "_model_name_or_path": "where the checkpoint came from",
    "dtype": "the weights' storage dtype: the engine computes in --dtype (recorded in the manifest)",
    "torch_dtype": "older name of dtype",
    "bos_token_id": "a token id: the forward pass reads none; stop tokens come from the generation config",
    "eos_token_id": "a token id (as bos_token_id)",
    "pad_token_id": "a token id (as bos_token_id)",
    "unk_token_id": "a token id (as bos_token_id)",
    "initializer_range": "random initialisation of new weights only",
    "attention_dropout": "dropout acts in training only",
    "use_cache": "whether transformers returns its KV cache",
    "output_attentions": "what transformers returns, not what it computes",
    "output_hidden_states": "what transformers returns, not what it computes",
    "return_dict": "what transformers returns, not what it computes",
    "id2label": "labels of a classification head (a causal LM has none)",
    "label2id": "labels of a classification head (a causal LM has none)",
    "problem_type": "the loss of a classification head (a causal LM has none)",
    "router_aux_loss_coef": "the weight of the load-balancing loss: training only",
    "output_router_logits": "what transformers returns, not what it computes",
    "router_jitter_noise": "multiplicative router noise transformers applies in training mode only",
}
NEUTRAL = {  # keys harmless at this value only (transformers' default)
    "pretraining_tp": 1,  # > 1: older transformers split every projection into slices and summed them
    "is_encoder_decoder": False,
    "chunk_size_feed_forward": 0,  # > 0: the feed-forward in sequence chunks
}
ROPE_KEYS = frozenset(  # keys of rope_parameters / rope_scaling that `_rope` reads or transformers ignores
    {"rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor"}
    | {"original_max_position_embeddings", "partial_rotary_factor"}
)

# transformers' config defaults where they differ between the architectures
_DEFAULTS = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "max_position_embeddings": 2048},
    "qwen2": {"num_key_value_heads": 32, "head_dim": None, "max_position_embeddings": 32768},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768},
    "mistral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32},
    "qwen3_moe": {"num_key_value_heads": 4, "head_dim": None, "max_position_embeddings": 32768},
    "mixtral": {"num_key_value_heads": 8, "head_dim": None, "max_position_embeddings": 4096 * 32},
}
# mixture-of-experts keys of other architectures (or other routers) the engine does not compute
_MOE_REFUSED = (
    "shared_expert_intermediate_size",
    "n_shared_experts",
    "moe_layer_freq",
    "first_k_dense_replace",
    "n_group",
    "topk_group",
    "scoring_func",
    "topk_method",
    "routed_scaling_factor",
    "capacity_factor",
    "expert_capacity",
    "moe_capacity_factor",
    "drop_tokens",
)


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts MLP: `num_experts` experts of `intermediate_size`, the top `top_k` by router
    probability per token, their gates renormalised to sum to 1 where `norm_topk_prob`; `layers[i]`:
    whether layer i has it (else a dense MLP); `style`: the checkpoint's parameter names."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    layers: tuple[bool, ...]
    style: (
        str  # "qwen3_moe": mlp.gate, mlp.experts.E.{gate,up,down}_proj; "mixtral": block_sparse_moe.gate, .w1/.w3/.w2
    )


@dataclass(frozen=True)
class RopeSpec:
    rope_type: str = "default"
    theta: float = 10000.0
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    original_max_position_embeddings: int = 0  # llama3
    max_positions: int | None = None  # dynamic: the longest sequence it runs (max_position_embeddings)


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    rope: RopeSpec = field(default_factory=RopeSpec)
    windows: tuple[int | None, ...] = ()  # per layer: sliding-window size, or None for full attention
    moe: MoESpec | None = None

    @classmethod
    def of(cls, model: ModelRef) -> "ModelConfig":
        """The built-in engine's reading of the checkpoint's config.json (`model.config`); DetauditError
        (one line, naming the field) for anything it does not compute exactly as transformers does."""
        where = f"{model.path}/config.json"
        try:
            return cls.from_dict(model.config, where)
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise DetauditError(f"{where}: missing or malformed field {str(e)[:80]}") from None

    @classmethod
    def from_dict(cls, raw: dict, where: str = "config.json") -> "ModelConfig":
        mtype = raw.get("model_type")
        if mtype not in ARCHITECTURES:
            raise DetauditError(
                f"{where}: model_type {mtype!r} is not supported by the built-in engine "
                f"(supported: {', '.join(SUPPORTED)}; `--engine vllm` runs what vLLM supports)"
            )

        def refuse(what: str, note: str = "") -> DetauditError:
            return DetauditError(
                f"{where}: {what} is not supported by the built-in engine ({mtype}{'; ' + note if note else ''})"
            )

        # the routers' keys in _MOE_REFUSED are checked by value in `_moe` (absent or 0 is the plain router)
        known = READ | HARMLESS.keys() | NEUTRAL.keys() | set(_MOE_REFUSED)
        unknown = sorted(k for k in raw if k not in known)
        if unknown:
            fields = ", ".join(unknown[:5]) + (f" (and {len(unknown) - 5} more)" if len(unknown) > 5 else "")
            raise refuse(f"config field{'s' if len(unknown) > 1 else ''} {fields}", "not implemented")
        for key, value in NEUTRAL.items():
            if raw.get(key) is not None and raw[key] != value:
                raise refuse(f"{key} {raw[key]!r}", f"only {value!r}")
        archs = raw.get("architectures") or [ARCHITECTURES[mtype]]
        if list(archs) != [ARCHITECTURES[mtype]]:
            raise refuse(f"architectures {archs}", f"expected [{ARCHITECTURES[mtype]!r}]")
        if raw.get("quantization_config"):
            raise refuse("quantization_config", "quantized checkpoints")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise refuse(f"hidden_act {act!r}", "only 'silu'")
        d = _DEFAULTS[mtype]
        heads = int(raw["num_attention_heads"])
        kv = raw.get("num_key_value_heads", d["num_key_value_heads"]) or heads
        if heads % kv:
            raise refuse(f"num_key_value_heads {kv} not dividing num_attention_heads {heads}")
        head_dim = raw.get("head_dim", d["head_dim"]) or raw["hidden_size"] // heads
        layers = int(raw["num_hidden_layers"])
        max_pos = int(raw.get("max_position_embeddings", d["max_position_embeddings"]))

        attention_bias = bool(raw.get("attention_bias", False))
        mlp_bias = bool(raw.get("mlp_bias", False))
        if mlp_bias and mtype != "llama":
            raise refuse("mlp_bias")
        if attention_bias and mtype in ("qwen2", "mistral"):
            raise refuse("attention_bias", "transformers' class has no such option and would ignore the biases")
        qkv_bias = attention_bias or mtype == "qwen2"
        o_bias = attention_bias
        rope = _rope(raw, max_pos, refuse)
        moe = _moe(raw, mtype, layers, refuse)

        return cls(
            model_type=mtype,
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw.get("intermediate_size") or 0),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(kv),
            head_dim=int(head_dim),
            vocab_size=int(raw["vocab_size"]),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            qk_norm=mtype in ("qwen3", "qwen3_moe"),
            rope=rope,
            windows=_windows(raw, mtype, layers, refuse),
            moe=moe,
        )

    def check_tp(self, tp: int) -> None:
        """Refuse a TP size the engine cannot shard the model over. KV heads are split over the ranks
        where TP divides them, else replicated where they divide TP (`kv_replicas`)."""
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise DetauditError(
                f"TP {tp} neither divides the model's KV heads ({self.num_kv_heads}) nor is a multiple of them"
            )
        sizes = [("query heads", self.num_heads)]
        if self.moe is None or not all(self.moe.layers):
            sizes.append(("intermediate size", self.intermediate_size))
        if self.moe is not None:
            sizes.append(("expert intermediate size", self.moe.intermediate_size))
        for what, n in sizes:
            if n % tp:
                raise DetauditError(f"TP {tp} does not divide the model's {what} ({n})")

    def kv_replicas(self, tp: int) -> int:
        """How many ranks hold each KV head at TP `tp`: 1 where TP divides the KV heads (each rank its own
        Hkv / TP heads), else TP / Hkv (as vLLM and SGLang replicate them): rank r holds KV head
        r // replicas, the one its query heads r * Hq / TP .. (r + 1) * Hq / TP - 1 read, since those
        Hq / TP heads lie inside one group of Hq / Hkv query heads. A replica's columns are the head's
        own (column-parallel), so under the invariant backends their bits are those of TP 1."""
        return max(1, tp // self.num_kv_heads)

    def check_length(self, length: int) -> None:
        """Refuse sequences the engine would not compute as transformers does."""
        limit = self.rope.max_positions
        if limit is not None and length > limit:
            raise DetauditError(
                f"rope_type 'dynamic' beyond max_position_embeddings ({limit} positions; this run needs {length}) "
                "is not supported by the built-in engine: transformers rescales the frequencies by the longest "
                "sequence of each forward call (not batch invariant)"
            )


def _rope(raw: dict, max_pos: int, refuse) -> RopeSpec:
    rope = raw.get("rope_parameters")
    if rope is None:
        rope = raw.get("rope_scaling")
    rope = dict(rope or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise refuse("per-layer-type rope_parameters")
    unknown = sorted(k for k in rope if k not in ROPE_KEYS)
    if unknown:
        raise refuse(f"rope_parameters key{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}", "not implemented")
    theta = float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rtype = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rtype not in ROPE_TYPES:
        raise refuse(f"rope_type {rtype!r}", f"supported: {', '.join(ROPE_TYPES)}")
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise refuse(f"partial_rotary_factor {partial}")
    if rtype == "default":
        return RopeSpec("default", theta)
    if "factor" not in rope:
        raise refuse(f"rope_type {rtype!r} without a factor")
    factor = float(rope["factor"])
    if rtype == "linear":
        return RopeSpec("linear", theta, factor)
    if rtype == "dynamic":
        return RopeSpec("dynamic", theta, factor, max_positions=max_pos)
    for key in ("low_freq_factor", "high_freq_factor"):
        if key not in rope:
            raise refuse(f"rope_type 'llama3' without {key}")
    # transformers: a top-level original_max_position_embeddings wins, then the rope dict's, then
    # max_position_embeddings
    original = raw.get("original_max_position_embeddings", rope.get("original_max_position_embeddings", max_pos))
    return RopeSpec(
        "llama3", theta, factor, float(rope["low_freq_factor"]), float(rope["high_freq_factor"]), int(original)
    )


def _windows(raw: dict, mtype: str, layers: int, refuse) -> tuple[int | None, ...]:
    """Per layer, the sliding-window size (a key j is visible to a query at position p iff
    p - window < j <= p) or None, as transformers' config resolves it."""
    if mtype == "llama":  # LlamaConfig has no sliding window (a stray key is ignored by transformers too)
        return (None,) * layers
    if mtype in ("mistral", "mixtral"):
        if "layer_types" in raw:
            raise refuse("layer_types", "alternating attention, as in Ministral")
        window = raw.get("sliding_window", 4096 if mtype == "mistral" else None)
        return (_window_size(window, refuse),) * layers
    # qwen2 / qwen3: the window only when use_sliding_window, on the layers layer_types marks sliding
    # (by default the layers from max_window_layers on)
    window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
    window = _window_size(window, refuse)
    types = raw.get("layer_types")
    if types is None:
        first = int(raw.get("max_window_layers") or 28) if window is not None else layers
        types = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)]
    if len(types) != layers or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise refuse(f"layer_types {types}", f"expected {layers} of 'full_attention' / 'sliding_attention'")
    return tuple(window if t == "sliding_attention" else None for t in types)


def _moe(raw: dict, mtype: str, layers: int, refuse) -> MoESpec | None:
    for key in _MOE_REFUSED:
        value = raw.get(key)
        if value in (None, 0, False, []) or (key == "scoring_func" and value == "softmax"):
            continue  # absent, or the plain router's value
        raise refuse(f"{key} {str(value)[:40]!r}", "the engine implements plain top-k softmax routing")
    if mtype not in ("qwen3_moe", "mixtral"):
        return None
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    top_k = raw.get("num_experts_per_tok")
    if not isinstance(experts, int) or experts < 1 or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise refuse(f"num_experts {experts!r} / num_experts_per_tok {top_k!r}")
    if mtype == "mixtral":
        return MoESpec(experts, top_k, int(raw["intermediate_size"]), True, (True,) * layers, "mixtral")
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    which = tuple(i not in dense and (i + 1) % step == 0 for i in range(layers))
    size = int(raw.get("moe_intermediate_size") or 768)
    return MoESpec(experts, top_k, size, bool(raw.get("norm_topk_prob", False)), which, "qwen3_moe")


def _window_size(window, refuse) -> int | None:
    if window is None:
        return None
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise refuse(f"sliding_window {window!r}")
    return window
