"""Llama / Qwen3 decoder with Hugging Face parameter names. Plain tensors, inference only; every
numeric reduction goes through the backend held by the TPContext."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from detaudit.engine.layers import (
    ColumnParallelLinear,
    RMSNorm,
    Rotary,
    RowParallelLinear,
    TPContext,
    apply_rotary,
)
from detaudit.engine.loader import open_weights
from detaudit.errors import DetauditError

SUPPORTED = ("llama", "qwen3")


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

    @classmethod
    def from_dir(cls, path: Path) -> "ModelConfig":
        try:
            raw = json.loads((Path(path) / "config.json").read_text())
        except FileNotFoundError:
            raise DetauditError(f"model directory {path} has no config.json") from None
        except json.JSONDecodeError as e:
            raise DetauditError(f"{path}/config.json is malformed: {e}") from None
        mtype = raw.get("model_type")
        if mtype not in SUPPORTED:
            raise DetauditError(f"model_type {mtype!r} in {path} is not supported (supported: {', '.join(SUPPORTED)})")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise DetauditError(f"rope type {rope_type!r} in {path} is not supported by the built-in engine")
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        heads = raw["num_attention_heads"]
        return cls(
            model_type=mtype,
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            vocab_size=raw["vocab_size"],
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )

    def check_tp(self, tp: int) -> None:
        for what, n in (
            ("query heads", self.num_heads),
            ("KV heads", self.num_kv_heads),
            ("intermediate size", self.intermediate_size),
        ):
            if n % tp:
                raise DetauditError(f"TP {tp} does not divide the model's {what} ({n})")


class Block:
    def __init__(self, i: int, cfg: ModelConfig, load: ShardLoader, ctx: TPContext) -> None:
        p = f"model.layers.{i}."
        b = ctx.backend
        self.cfg = cfg
        self.ctx = ctx
        self.input_layernorm = RMSNorm(load.full(p + "input_layernorm.weight"), cfg.rms_norm_eps, b)
        self.post_attention_layernorm = RMSNorm(load.full(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps, b)
        self.q_proj = ColumnParallelLinear(load.shards(p + "self_attn.q_proj.weight", 0), ctx)
        self.k_proj = ColumnParallelLinear(load.shards(p + "self_attn.k_proj.weight", 0), ctx)
        self.v_proj = ColumnParallelLinear(load.shards(p + "self_attn.v_proj.weight", 0), ctx)
        self.o_proj = RowParallelLinear(load.shards(p + "self_attn.o_proj.weight", 1), ctx, p + "self_attn.o_proj")
        self.q_norm = self.k_norm = None
        if cfg.model_type == "qwen3":
            self.q_norm = RMSNorm(load.full(p + "self_attn.q_norm.weight"), cfg.rms_norm_eps, b)
            self.k_norm = RMSNorm(load.full(p + "self_attn.k_norm.weight"), cfg.rms_norm_eps, b)
        self.gate_proj = ColumnParallelLinear(load.shards(p + "mlp.gate_proj.weight", 0), ctx)
        self.up_proj = ColumnParallelLinear(load.shards(p + "mlp.up_proj.weight", 0), ctx)
        self.down_proj = RowParallelLinear(load.shards(p + "mlp.down_proj.weight", 1), ctx, p + "mlp.down_proj")
        local = len(ctx.local_ranks)
        self.n_heads = cfg.num_heads // ctx.size * local
        self.n_kv = cfg.num_kv_heads // ctx.size * local

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, cache: tuple[Tensor, Tensor], kv_len: int) -> Tensor:
        B, T, _ = x.shape
        d = self.cfg.head_dim
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, self.n_heads, d)
        k = self.k_proj(h).view(B, T, self.n_kv, d)
        v = self.v_proj(h).view(B, T, self.n_kv, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rotary(q.transpose(1, 2), cos, sin)
        k = apply_rotary(k.transpose(1, 2), cos, sin)
        k_cache, v_cache = cache
        # the cache is updated before attention, so a token's key sits in the same slot whether it
        # was written in prefill or decode
        rows = torch.arange(B, device=x.device)[:, None].expand(B, T)
        k_cache.transpose(1, 2)[rows, pos] = k.transpose(1, 2)
        v_cache.transpose(1, 2)[rows, pos] = v
        attn = self.ctx.backend.attention(q, k_cache[:, :, :kv_len], v_cache[:, :, :kv_len], pos, d**-0.5)
        x = x + self.o_proj(attn.transpose(1, 2).reshape(B, T, self.n_heads * d))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Decoder:
    def __init__(self, path: Path, ctx: TPContext, device: torch.device) -> None:
        self.cfg = cfg = ModelConfig.from_dir(path)
        cfg.check_tp(ctx.size)
        self.ctx = ctx
        self.device = device
        with open_weights(path, ctx, device) as load:
            self.embed_tokens = load.full("model.embed_tokens.weight")
            self.layers = [Block(i, cfg, load, ctx) for i in range(cfg.num_layers)]
            self.norm = RMSNorm(load.full("model.norm.weight"), cfg.rms_norm_eps, ctx.backend)
            self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else load.full("lm_head.weight")
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, device)
        local = len(ctx.local_ranks)
        self.n_kv_local = cfg.num_kv_heads // ctx.size * local

    def new_cache(self, batch: int, length: int) -> list[tuple[Tensor, Tensor]]:
        shape = (batch, self.n_kv_local, length, self.cfg.head_dim)
        return [
            (torch.zeros(shape, dtype=self.ctx.dtype, device=self.device), torch.zeros(shape, dtype=self.ctx.dtype, device=self.device))
            for _ in self.layers
        ]

    def hidden(self, ids: Tensor, pos: Tensor, cache: list[tuple[Tensor, Tensor]], kv_len: int | None = None) -> Tensor:
        """Final-normed hidden states [B, T, H] of tokens `ids` at positions `pos` (both [B, T]).
        Attention reads the first `kv_len` cache slots (default: up to the furthest position, which needs
        a host sync; a CUDA-graphed decode step passes the whole cache: slots past a query's position
        are masked)."""
        x = F.embedding(ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(pos, self.ctx.dtype)
        if kv_len is None:
            kv_len = int(pos.max()) + 1
        for layer, c in zip(self.layers, cache):
            x = layer(x, cos, sin, pos, c, kv_len)
        return self.norm(x)

    def logits(self, h: Tensor) -> Tensor:
        """fp32 logits of final hidden states (lm_head replicated: identical at every TP size)."""
        return self.ctx.backend.linear(h, self.lm_head).float()
