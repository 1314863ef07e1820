"""Llama / Qwen2 / Qwen3 / Mistral decoder with Hugging Face parameter names. Plain tensors, inference
only; every numeric reduction goes through the backend held by the TPContext. What a checkpoint's
config asks for is read (and anything unimplemented refused) by `arch.ModelConfig.from_dir`."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from detaudit.backends.kernels import fused
from detaudit.engine.arch import SUPPORTED, ModelConfig  # noqa: F401  (ModelConfig: the sweep's check)
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


class Block:
    def __init__(self, i: int, cfg: ModelConfig, load, ctx: TPContext) -> None:
        p = f"model.layers.{i}."
        b = ctx.backend
        self.cfg = cfg
        self.ctx = ctx
        self.window = cfg.windows[i] if cfg.windows else None

        def column(name: str, bias: bool) -> ColumnParallelLinear:
            return ColumnParallelLinear(
                load.shards(name + ".weight", 0), ctx, load.shards(name + ".bias", 0) if bias else None
            )

        def row(name: str, bias: bool) -> RowParallelLinear:
            return RowParallelLinear(
                load.shards(name + ".weight", 1), ctx, name, load.full(name + ".bias") if bias else None
            )

        self.input_layernorm = RMSNorm(load.full(p + "input_layernorm.weight"), cfg.rms_norm_eps, b)
        self.post_attention_layernorm = RMSNorm(load.full(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps, b)
        self.q_proj = column(p + "self_attn.q_proj", cfg.qkv_bias)
        self.k_proj = column(p + "self_attn.k_proj", cfg.qkv_bias)
        self.v_proj = column(p + "self_attn.v_proj", cfg.qkv_bias)
        self.o_proj = row(p + "self_attn.o_proj", cfg.o_bias)
        self.q_norm = self.k_norm = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(load.full(p + "self_attn.q_norm.weight"), cfg.rms_norm_eps, b)
            self.k_norm = RMSNorm(load.full(p + "self_attn.k_norm.weight"), cfg.rms_norm_eps, b)
        self.gate_proj = column(p + "mlp.gate_proj", cfg.mlp_bias)
        self.up_proj = column(p + "mlp.up_proj", cfg.mlp_bias)
        self.down_proj = row(p + "mlp.down_proj", cfg.mlp_bias)
        local = len(ctx.local_ranks)
        self.n_heads = cfg.num_heads // ctx.size * local
        self.n_kv = cfg.num_kv_heads // ctx.size * local
        # GPU, one shard per layer (TP 1, real TP): q/k/v and gate/up as one product each, as serving
        # engines merge them (QKVParallelLinear, MergedColumnParallelLinear); the parts are column slices
        # of its output. bio's matmul gives a column the same bits whatever N is (its reduction never
        # follows the tiling), so only bf16's library GEMM can see a different problem. (Emulated TP holds
        # C shards per layer: kept apart.)
        # Qwen3's q / k norms inside the rotary kernel where the backend's GPU RMSNorm is that kernel's
        self._fused_norms = None
        if self.q_norm is not None and getattr(b, "FUSED_RMS_NORM", False):
            self._fused_norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        self.qkv = self.gate_up = None
        if fused.usable(self.q_proj.shards[0]) and len(self.q_proj.shards) == 1:
            self.qkv = merged(self.q_proj, self.k_proj, self.v_proj)
            self.gate_up = merged(self.gate_proj, self.up_proj)
            self.q_proj = self.k_proj = self.v_proj = self.gate_proj = self.up_proj = None  # (memory)
        # the one-kernel rotary path over the merged product (GPU): where a step's kept buffers apply
        self.merged_rope = self.qkv is not None and (self.q_norm is None or self._fused_norms is not None)

    def _qkv(self, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if self.qkv is None:
            return self.q_proj(h), self.k_proj(h), self.v_proj(h)
        out = self.qkv(h)
        nq, nkv = self.n_heads * self.cfg.head_dim, self.n_kv * self.cfg.head_dim
        return out[:, :nq], out[:, nq : nq + nkv], out[:, nq + nkv :]

    def _gate_up(self, h: Tensor) -> tuple[Tensor, Tensor]:
        if self.gate_up is None:
            return self.gate_proj(h), self.up_proj(h)
        out = self.gate_up(h)
        half = out.shape[1] // 2
        return out[:, :half], out[:, half:]

    def __call__(
        self, x: Tensor, delta: Tensor | None, step: "StepPlan", cache: tuple[Tensor, Tensor]
    ) -> tuple[Tensor, Tensor]:
        """x: the residual stream of the step's tokens flattened, [B*T, H], and `delta`, what the previous
        layer adds to it (None before the first layer): the add is the input norm's (one kernel on GPU).
        Returns this layer's (x, delta). Every per-token op is row-local, and a 2-D operand is the product
        the library folds a 3-D one into: the same kernels, fewer view ops per call."""
        B, T = step.B, step.T
        d = self.cfg.head_dim
        bufs = step.buffers  # eager GPU decode: the kept output buffers (`Decoder.hidden` decides)
        h, x = self.input_layernorm.add(x, delta, None if bufs is None else bufs.norm_out(x))
        k_cache, v_cache = cache
        # the cache is updated before attention, so a token's key sits in the same slot whether it
        # was written in prefill or decode: one row per (token, KV head) of the flat cache, at the slots
        # computed once per step
        if step.fused and self.merged_rope:
            # GPU, merged projection: (q/k norms,) rotary and both cache writes in one kernel reading q, k, v
            # at their column offsets of the one product
            q = fused.rope_store_qkv(
                self.qkv(h),
                self.n_heads,
                self.n_kv,
                step.cos,
                step.sin,
                k_cache,
                v_cache,
                step.slots,
                B,
                T,
                d,
                self._fused_norms,
                None if bufs is None else bufs.q,
            )
        elif step.fused:  # GPU: (q/k norms,) rotary for q and k and both cache writes in one kernel
            q, k, v = self._qkv(h)
            if self.q_norm is not None and self._fused_norms is None:
                q = self.q_norm(q.reshape(B * T * self.n_heads, d)).view(B * T, -1)
                k = self.k_norm(k.reshape(B * T * self.n_kv, d)).view(B * T, -1)
            q = fused.rope_store(q, k, v, step.cos, step.sin, k_cache, v_cache, step.slots, B, T, d, self._fused_norms)
        else:
            q, k, v = self._qkv(h)
            if self.q_norm is not None:
                q = self.q_norm(q.view(B, T, self.n_heads, d))
                k = self.k_norm(k.view(B, T, self.n_kv, d))
            q = apply_rotary(q.view(B, T, self.n_heads, d).transpose(1, 2), step.cos, step.sin)
            k = apply_rotary(k.view(B, T, self.n_kv, d).transpose(1, 2), step.cos, step.sin)
            k_cache.view(-1, d).index_copy_(0, step.slots, k.transpose(1, 2).reshape(-1, d))
            v_cache.view(-1, d).index_copy_(0, step.slots, v.reshape(-1, d))
        if step.kv_len != k_cache.shape[2]:  # (the whole cache, as decode on GPU reads it: no slicing)
            k_cache, v_cache = k_cache[:, :, : step.kv_len], v_cache[:, :, : step.kv_len]
        attn = self.ctx.backend.attention(q, k_cache, v_cache, step.pos, d**-0.5, **step.attention_kwargs(self.window))
        delta = self.o_proj(attn.transpose(1, 2).reshape(B * T, self.n_heads * d), rounded=False)
        h, x = self.post_attention_layernorm.add(x, delta, None if bufs is None else bufs.norm_out(x))
        if step.fused and self.gate_up is not None:  # the halves read at their column offsets
            act = fused.silu_mul_halves(self.gate_up(h), None if bufs is None else bufs.act)
            return x, self.down_proj(act, rounded=False)
        gate, up = self._gate_up(h)
        return x, self.down_proj(fused.silu_mul(gate, up) if step.fused else F.silu(gate) * up, rounded=False)


def merged(*parts: ColumnParallelLinear) -> ColumnParallelLinear:
    """One column-parallel layer computing `parts` side by side (one shard each)."""
    weight = torch.cat([p.shards[0] for p in parts])
    bias = None if parts[0].bias is None else [torch.cat([p.bias[0] for p in parts])]
    return ColumnParallelLinear([weight], parts[0].ctx, bias)


class DecodeBuffers:
    """The per-layer outputs of one batch size's eager decode step on GPU, allocated once and written by
    every layer of every step: the normed input of each projection (`h`), the residual stream (two
    buffers, each layer's add writing the one it does not read), the rotated queries and the gated
    activation. Eager decode is host-bound, and on the GPU machines' hosts each `torch.empty` cost
    2-12 us, six per layer (reports/gpu/eager-host-cost-h100.md, fifth pass). Reuse is safe because one
    stream runs the step in order: a buffer is rewritten only by a kernel queued after every kernel that
    reads its last value; nothing in it leaves the step (the final norm and the logits allocate). The
    kernels and their launch plans are the same, so the bits are (tested: eager == graphed, batch and TP
    invariance on GPU). CUDA-graphed steps keep their own memory pool and do not use these."""

    __slots__ = ("h", "res", "q", "act")

    def __init__(self, model: "Decoder", rows: int) -> None:
        first = model.layers[0]
        dt, dev, cfg = model.ctx.dtype, model.device, model.cfg
        self.h = torch.empty((rows, cfg.hidden_size), dtype=dt, device=dev)
        self.res = (torch.empty_like(self.h), torch.empty_like(self.h))
        self.q = torch.empty((rows, first.n_heads, 1, cfg.head_dim), dtype=dt, device=dev)
        self.act = torch.empty((rows, first.gate_up.shards[0].shape[0] // 2), dtype=dt, device=dev)

    def norm_out(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(normed, sum) buffers for a layer's add + RMSNorm reading the residual `x`: the sum goes to the
        residual buffer x does not lie in."""
        return self.h, (self.res[1] if x.data_ptr() == self.res[0].data_ptr() else self.res[0])


class StepPlan:
    """What every layer of one forward step shares, computed once per step instead of once per layer:
    rotary cos / sin, the cache slots the step's keys and values go to, the backend's per-step
    attention inputs (`backend.attention_plan`, where it has one: bf16's mask, bio's row positions) and,
    for an eager decode step on GPU, the kept output buffers."""

    __slots__ = ("B", "T", "pos", "cos", "sin", "kv_len", "slots", "fused", "buffers", "_backend", "_plans")

    def __init__(
        self,
        model: "Decoder",
        pos: Tensor,
        cache: list[tuple[Tensor, Tensor]],
        kv_len: int,
        buffers: DecodeBuffers | None = None,
    ) -> None:
        B, T = pos.shape
        self.B, self.T, self.pos, self.kv_len = B, T, pos, kv_len
        self.buffers = buffers
        self.cos, self.sin = model.rotary.cos_sin(pos, model.ctx.dtype)
        n_kv, length = cache[0][0].shape[1], cache[0][0].shape[2]
        # flat row of (b, t, h) in a [B, Hkv, L, D] cache viewed as [B*Hkv*L, D]: (b*Hkv + h)*L + pos[b, t]
        heads = torch.arange(n_kv, device=pos.device) * length
        rows = torch.arange(B, device=pos.device)[:, None, None] * (n_kv * length)
        self.slots = (rows + pos[:, :, None] + heads).reshape(-1)
        self.fused = fused.rope_usable(pos, model.cfg.head_dim)  # GPU: the one-launch per-token kernels
        self._backend = model.ctx.backend
        self._plans: dict = {}

    def attention_kwargs(self, window: int | None) -> dict:
        """Keyword arguments of `backend.attention` for a layer with this `window` (None: full attention;
        a sliding window is passed only where the layer has one, so backends without the keyword still
        run every full-attention model)."""
        hit = self._plans.get(window)
        if hit is None:
            hit = {} if window is None else {"window": window}
            make = getattr(self._backend, "attention_plan", None)
            if make is not None:
                hit["plan"] = make(self.pos, self.kv_len, window)
            self._plans[window] = hit
        return hit


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
            if cfg.tie_word_embeddings:
                self.lm_head = self.embed_tokens
                if hasattr(load, "skip"):  # transformers ties a stored lm_head to the embedding too
                    load.skip("lm_head.weight")
            else:
                self.lm_head = load.full("lm_head.weight")
            unused = load.unused() if hasattr(load, "unused") else []
            if unused:
                more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
                raise DetauditError(
                    f"model {path} holds parameters the built-in engine does not use "
                    f"({', '.join(unused[:3])}{more}): its config does not describe them"
                )
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta, device, cfg.rope)
        self._buffers: dict[int, DecodeBuffers] = {}  # batch -> eager decode's kept outputs (GPU)
        local = len(ctx.local_ranks)
        self.n_kv_local = cfg.num_kv_heads // ctx.size * local

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
        keep_buffers: bool = False,
    ) -> Tensor:
        """Final-normed hidden states [B, T, H] of tokens `ids` at positions `pos` (both [B, T]).
        Attention reads the first `kv_len` cache slots (default: up to the furthest position, which needs
        a host sync; a CUDA-graphed decode step passes the whole cache: slots past a query's position
        are masked). `keep_buffers` (eager decode on GPU): the layers write kept `DecodeBuffers`."""
        B, T = ids.shape
        x = F.embedding(ids.reshape(-1), self.embed_tokens)  # [B*T, H]
        if kv_len is None:
            kv_len = int(pos.max()) + 1
        buffers = None
        if keep_buffers and T == 1 and self.layers and self.layers[0].merged_rope:
            buffers = self._buffers.get(B)
            if buffers is None:
                buffers = self._buffers[B] = DecodeBuffers(self, B)
        step = StepPlan(self, pos, cache, kv_len, buffers)
        delta = None
        for layer, c in zip(self.layers, cache):
            x, delta = layer(x, delta, step, c)
        return self.norm.add(x, delta)[0].view(B, T, -1)

    def logits(self, h: Tensor) -> Tensor:
        """fp32 logits of final hidden states (lm_head replicated: identical at every TP size)."""
        return self.ctx.backend.linear(h, self.lm_head).float()
