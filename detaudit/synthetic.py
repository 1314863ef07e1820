"""Synthetic models: a published architecture's exact shapes with random weights.

Machines that audit GPU kernels at real sizes often have no model hub, so `qwen3-8b-shaped` is
Qwen3-8B's architecture (36 layers, hidden 4096, 32 query / 8 KV heads of 128, MLP 12288, vocab
151936, QK-norm, untied lm_head) with weights drawn on the device from a fixed seed: every parameter
from its own generator seeded by sha256(seed, parameter name), N(0, 0.02) for matrices and ones for
norms, so every machine and every TP rank builds the same model. Preparing it writes only
`config.json`, the manifest, and the embedded model's tokenizer (ids are only ids here: the text of
a random model means nothing, its numerics are what is audited).

Engines that read files (vLLM) need the weights written: `models prepare NAME --safetensors` draws the
same tensors (the same generators, on the given device: a CUDA generator's stream is not a CPU one's)
and writes them as safetensors shards with their index; the built-in engine then reads those files
too, so both engines compute from the same bytes. The manifest records where they were drawn.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from detaudit.errors import DetauditError

MODEL_MANIFEST = "detaudit-model.json"
SEED = 0
STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    config: dict


PRESETS = {
    "qwen3-8b-shaped": Preset(
        name="qwen3-8b-shaped",
        description="Qwen3-8B's architecture with random weights (seeded, generated on the device; no download)",
        config={
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 4096,
            "intermediate_size": 12288,
            "num_hidden_layers": 36,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 128,
            "vocab_size": 151936,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
            "eos_token_id": 2,
        },
    ),
}


PRESETS["qwen3-30b-a3b-shaped"] = Preset(
    name="qwen3-30b-a3b-shaped",
    description="Qwen3-30B-A3B's architecture (MoE: 128 experts, top 8) with random weights (seeded, on the device)",
    config={
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "vocab_size": 151936,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eos_token_id": 2,
    },
)


def is_synthetic(path: Path) -> bool:
    try:
        return "synthetic" in json.loads((Path(path) / MODEL_MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return False


def prepare(name: str, dest: Path, tokenizer_dir: Path) -> dict:
    """Write the preset's config, the tokenizer and the manifest into `dest` (a fresh directory)."""
    preset = PRESETS[name]
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(preset.config, indent=2) + "\n")
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, dest / f)
    return {
        "name": name,
        "synthetic": {
            "preset": name,
            "seed": SEED,
            "std": STD,
            "init": "N(0, std) matrices, ones for norms, per-parameter seed",
        },
    }


SHARD_BYTES = 4 << 30  # safetensors shards of at most this many bytes (what hub checkpoints use)


def parameter_names(cfg: dict) -> list[str]:
    """Every parameter of a preset's model, in checkpoint order."""
    names = ["model.embed_tokens.weight"]
    dense = [
        "input_layernorm",
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "post_attention_layernorm",
    ]
    for i in range(cfg["num_hidden_layers"]):
        parts = list(dense)
        if cfg.get("num_experts"):
            parts.append("mlp.gate")
            projections = ("gate_proj", "up_proj", "down_proj")
            parts += [f"mlp.experts.{e}.{p}" for e in range(cfg["num_experts"]) for p in projections]
        else:
            parts += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
        names += [f"model.layers.{i}.{p}.weight" for p in parts]
    names.append("model.norm.weight")
    if not cfg.get("tie_word_embeddings"):
        names.append("lm_head.weight")
    return names


def make(cfg: dict, name: str, seed: int, std: float, dtype: torch.dtype, device) -> Tensor:
    """One parameter: ones for norms, else N(0, std) from its own generator seeded by sha256(seed, name)."""
    shape = _shape(cfg, name)
    if len(shape) == 1:
        return torch.ones(shape, dtype=dtype, device=device)
    s = int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & (2**63 - 1)
    g = torch.Generator(device=device).manual_seed(s)
    return (torch.randn(shape, generator=g, device=device) * std).to(dtype)


def write_safetensors(dest: Path, cfg: dict, device, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Draw every parameter on `device` and write them into `dest` as safetensors shards of at most
    SHARD_BYTES plus `model.safetensors.index.json` (hub layout). Returns the manifest's note."""
    from safetensors.torch import save_file

    names = parameter_names(cfg)
    shards: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = torch.Size(_shape(cfg, name)).numel() * torch.finfo(dtype).bits // 8
        if shards[-1] and size + n > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    weight_map = {}
    total = 0
    for k, group in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: make(cfg, name, SEED, STD, dtype, device).cpu() for name in group}
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(dest / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, fname))
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return {"file_format": "safetensors", "generated_on": torch.device(device).type, "dtype": str(dtype)}


def has_weights(path: Path) -> bool:
    """Whether a prepared synthetic model's weights were written as files (`write_safetensors`)."""
    return any(Path(path).glob("*.safetensors"))


def _shape(cfg: dict, name: str) -> tuple[int, ...]:
    h, i, d = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    q, kv, v = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["vocab_size"]
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (v, h)
    if name == "model.norm.weight":
        return (h,)
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
    if m is None or int(m.group(1)) >= cfg["num_hidden_layers"]:
        raise DetauditError(f"synthetic model has no parameter {name}")
    if cfg.get("num_experts"):  # mixture of experts: the router and the experts' MLPs
        e, mi = cfg["num_experts"], cfg["moe_intermediate_size"]
        expert = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)", m.group(2))
        if m.group(2) == "mlp.gate":
            return (e, h)
        if expert is not None and int(expert.group(1)) < e:
            return (h, mi) if expert.group(2) == "down_proj" else (mi, h)
    shapes = {
        "input_layernorm": (h,),
        "post_attention_layernorm": (h,),
        "self_attn.q_norm": (d,),
        "self_attn.k_norm": (d,),
        "self_attn.q_proj": (q, h),
        "self_attn.k_proj": (kv, h),
        "self_attn.v_proj": (kv, h),
        "self_attn.o_proj": (h, q),
        "mlp.gate_proj": (i, h),
        "mlp.up_proj": (i, h),
        "mlp.down_proj": (h, i),
    }
    if m.group(2) not in shapes:
        raise DetauditError(f"synthetic model has no parameter {name}")
    return shapes[m.group(2)]


class RandomWeights:
    """The `ShardLoader` interface over seeded random weights (see the module docstring)."""

    def __init__(self, path: Path, config: dict, ctx, device: torch.device) -> None:
        self.path = Path(path)
        self.ctx, self.device = ctx, device
        self.cfg = config
        spec = json.loads((self.path / MODEL_MANIFEST).read_text())["synthetic"]
        self.seed, self.std = int(spec["seed"]), float(spec["std"])

    def __enter__(self) -> "RandomWeights":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def _make(self, name: str) -> Tensor:
        return make(self.cfg, name, self.seed, self.std, self.ctx.dtype, self.device)

    def full(self, name: str) -> Tensor:
        return self._make(name)

    def skip(self, name: str) -> None:
        """(Nothing is stored: every parameter is made when it is asked for.)"""

    def unused(self) -> list[str]:
        return []

    def shards(self, name: str, dim: int, replicas: int = 1) -> list[Tensor]:
        """As `ShardLoader.shards`: C / `replicas` equal parts along `dim`, rank r holding part r // replicas."""
        full = self._make(name)
        c = self.ctx.size
        if c % replicas or full.shape[dim] % (c // replicas):
            raise DetauditError(f"TP {c} does not divide dim {dim} ({full.shape[dim]}) of {name}")
        parts = full.chunk(c // replicas, dim)
        return [parts[r // replicas].contiguous() for r in self.ctx.local_ranks]
