"""Llama / Qwen2 / Qwen3 / Mistral decoder with Hugging Face parameter names. Plain tensors, inference
only; every numeric reduction goes through the backend held by the TPContext, and the per-token steps
through the row ops the backend chose at load (`backends/row_ops.py`: PyTorch, or the GPU kernels).
What a checkpoint's config asks for is read (and anything unimplemented refused) by
`arch.ModelConfig.of`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from detaudit.backends.base import TPContext
from detaudit.backends.row_ops import TorchOps
from detaudit.builtin.arch import ModelConfig
from detaudit.builtin.layers import ColumnParallelLinear, RMSNorm, Rotary, RowParallelLinear
from detaudit.builtin.loader import open_weights
from detaudit.builtin.moe import MoE, Routing
from detaudit.config import ModelRef
from detaudit.errors import DetauditError


class Block:
    """One decoder layer, as the math reads: x + attention(norm(x)), then + mlp(norm(x)). The residual
    add of each half is done by the next norm (`ops.add_norm`), which takes the half's output as
    `delta`."""

    def __init__(self, i: int, cfg: ModelConfig, load, ctx: TPContext, ops: TorchOps) -> None:
        p = f"model.layers.{i}."
        self.ops, self.backend = ops, ctx.backend
        self.window = cfg.windows[i] if cfg.windows else None
        self.head_dim = cfg.head_dim

        def column(names: list[str], bias: bool, replicas: tuple[int, ...] | None = None) -> ColumnParallelLinear:
            reps = replicas or (1,) * len(names)
            parts = [load.shards(p + n + ".weight", 0, c) for n, c in zip(names, reps)]
            biases = [load.shards(p + n + ".bias", 0, c) for n, c in zip(names, reps)] if bias else None
            return ColumnParallelLinear(parts, ctx, biases, ops.merge_projections)

        def row(name: str, bias: bool) -> RowParallelLinear:
            bias_t = load.full(p + name + ".bias") if bias else None
            return RowParallelLinear(load.shards(p + name + ".weight", 1), ctx, p + name, bias_t)

        def norm(name: str) -> RMSNorm:
            return RMSNorm(load.full(p + name + ".weight"), cfg.rms_norm_eps)

        self.input_layernorm = norm("input_layernorm")
        # k / v: each rank's KV heads; where TP exceeds the KV heads, the one its query heads read
        kv = cfg.kv_replicas(ctx.size)
        self.qkv_proj = column(["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"], cfg.qkv_bias, (1, kv, kv))
        self.qk_norm = None  # Qwen3: (q weight, k weight, eps) of the per-head RMSNorms
        if cfg.qk_norm:
            q_norm, k_norm = norm("self_attn.q_norm"), norm("self_attn.k_norm")
            self.qk_norm = (q_norm.weight, k_norm.weight, cfg.rms_norm_eps)
        self.o_proj = row("self_attn.o_proj", cfg.o_bias)
        self.post_attention_layernorm = norm("post_attention_layernorm")
        self.moe = MoE(i, cfg, load, ctx) if cfg.moe is not None and cfg.moe.layers[i] else None
        if self.moe is None:
            self.gate_up_proj = column(["mlp.gate_proj", "mlp.up_proj"], cfg.mlp_bias)
            self.down_proj = row("mlp.down_proj", cfg.mlp_bias)

    def __call__(self, x: Tensor, delta: Tensor | None, step: StepPlan, cache: tuple[Tensor, Tensor]):
        """x: the residual stream of the step's tokens, [B*T, H]; delta: what the previous layer adds to
        it (None before the first layer). Returns (x, this layer's delta)."""
        h, x = self.ops.add_norm(x, delta, self.input_layernorm)
        q, k, v = self.qkv_proj(h)
        # the cache is written before attention reads it, so a token's key sits in the same slot whether
        # it was written in prefill or decode
        q = self.ops.rope_store(q, k, v, step, cache, self.qk_norm)
        k_cache, v_cache = step.visible(cache)
        attn = self.backend.attention(
            q, k_cache, v_cache, step.pos, self.head_dim**-0.5, self.window, step.plan(self.window)
        )
        delta = self.o_proj(attn.transpose(1, 2).reshape(step.B * step.T, -1))
        h, x = self.ops.add_norm(x, delta, self.post_attention_layernorm)
        if self.moe is not None:
            return x, self.moe(h, step.routing, decode=step.T == 1)
        gate, up = self.gate_up_proj(h)
        return x, self.down_proj(self.ops.silu_mul(gate, up))


class StepPlan:
    """What every layer of one forward step shares, computed once per step: rotary cos / sin, the
    cache rows the step's keys and values go to, how many cache slots attention reads, and the
    backend's per-step attention inputs (`backend.attention_plan`: bf16's mask, bio's row positions), and the
    routing the MoE layers record."""

    __slots__ = ("B", "T", "head_dim", "pos", "cos", "sin", "kv_len", "slots", "routing", "_backend", "_plans")

    def __init__(
        self, model: Decoder, pos: Tensor, cache: list[tuple[Tensor, Tensor]], kv_len: int, routing: Routing
    ) -> None:
        B, T = pos.shape
        self.routing = routing
        self.B, self.T, self.head_dim, self.pos, self.kv_len = B, T, model.cfg.head_dim, pos, kv_len
        self.cos, self.sin = model.rotary.cos_sin(pos, model.ctx.dtype)
        n_kv, length = cache[0][0].shape[1], cache[0][0].shape[2]
        # flat row of (b, t, h) in a [B, Hkv, L, D] cache viewed as [B*Hkv*L, D]: (b*Hkv + h)*L + pos[b, t]
        heads = torch.arange(n_kv, device=pos.device) * length
        rows = torch.arange(B, device=pos.device)[:, None, None] * (n_kv * length)
        self.slots = (rows + pos[:, :, None] + heads).reshape(-1)
        self._backend = model.ctx.backend
        self._plans: dict = {}

    def visible(self, cache: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """The cache slots attention reads: the first `kv_len` (all of them without a slice, as decode
        on GPU reads the whole cache)."""
        k, v = cache
        if self.kv_len == k.shape[2]:
            return k, v
        return k[:, :, : self.kv_len], v[:, :, : self.kv_len]

    def plan(self, window: int | None) -> dict:
        """The backend's per-step attention memo for layers with this `window` (`attention_plan`), made by
        the first such layer of the step."""
        hit = self._plans.get(window)
        if hit is None:
            hit = self._plans[window] = self._backend.attention_plan(self.pos, self.kv_len, window)
        return hit


class Decoder:
    def __init__(self, model: ModelRef, ctx: TPContext, device: torch.device) -> None:
        self.cfg = cfg = ModelConfig.of(model)
        cfg.check_tp(ctx.size)
        self.ctx = ctx
        self.device = device
        self.ops = ctx.backend.row_ops(device)
        with open_weights(model, ctx, device) as load:
            self.embed_tokens = load.full("model.embed_tokens.weight")
            self.layers = [Block(i, cfg, load, ctx, self.ops) for i in range(cfg.num_layers)]
            self.norm = RMSNorm(load.full("model.norm.weight"), cfg.rms_norm_eps)
            if cfg.tie_word_embeddings:
                self.lm_head = self.embed_tokens
                load.skip("lm_head.weight")  # transformers ties a stored lm_head to the embedding too
            else:
                self.lm_head = load.full("lm_head.weight")
            unused = load.unused()
            if unused:
                more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
                raise DetauditError(
                    f"model {model.path} holds parameters the built-in engine does not use "
                    f"({', '.join(unused[:3])}{more}): its config does not describe them"
                )
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, device, cfg.rope)
        self.routes = any(layer.moe is not None for layer in self.layers)  # it records routing
        # KV heads per rank (one where they are replicated, `ModelConfig.kv_replicas`) times the ranks
        # held here: in emulated TP rank r's copy sits at r * per_rank, next to its query heads' place
        # among the concatenated ranks, so attention's grouping of query heads still finds it
        per_rank = cfg.num_kv_heads * cfg.kv_replicas(ctx.size) // ctx.size
        self.n_kv_local = per_rank * len(ctx.local_ranks)

    def new_cache(self, batch: int, length: int) -> list[tuple[Tensor, Tensor]]:
        self.cfg.check_length(length)
        shape = (batch, self.n_kv_local, length, self.cfg.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.ctx.dtype, device=self.device),
                torch.zeros(shape, dtype=self.ctx.dtype, device=self.device),
            )
            for _ in self.layers
        ]

    def hidden(
        self,
        ids: Tensor,
        pos: Tensor,
        cache: list[tuple[Tensor, Tensor]],
        kv_len: int | None = None,
        routing: Routing | None = None,
    ) -> Tensor:
        """Final-normed hidden states [B, T, H] of tokens `ids` at positions `pos` (both [B, T]).
        Attention reads the first `kv_len` cache slots (default: up to the furthest position, which needs
        a host sync; decode on GPU passes the whole cache: slots past a query's position are masked).
        `routing` receives the MoE layers' routing of the B*T tokens (row-major)."""
        B, T = ids.shape
        x = F.embedding(ids.reshape(-1), self.embed_tokens)  # [B*T, H]
        if kv_len is None:
            kv_len = int(pos.max()) + 1
        step = StepPlan(self, pos, cache, kv_len, routing if routing is not None else Routing())
        delta = None
        for layer, c in zip(self.layers, cache):
            x, delta = layer(x, delta, step, c)
        return self.ops.add_norm(x, delta, self.norm)[0].view(B, T, -1)

    def logits(self, h: Tensor) -> Tensor:
        """fp32 logits of final hidden states (lm_head replicated: identical at every TP size)."""
        return self.ctx.backend.linear(h, self.lm_head).float()
