"""Parallel layers. Every reduction goes through the active Backend; collectives only through
`backend.all_reduce` (real TP) or `backend.combine` (emulated TP).

A layer holds a list of weight shards: one (this rank's) in real TP, all C in emulated TP.
Sharding (Megatron): q/k/v and gate/up are column-parallel (split the output dim, no cross-rank
reduction); o_proj and down_proj are row-parallel (split K; partials combined by the backend).
Embedding and lm_head are replicated on every rank, so the final logits are computed from identical
inputs by identical ops at every TP size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from detaudit.backends.base import Backend, Group
from detaudit.backends.kernels import fused


@dataclass
class TPContext:
    backend: Backend
    size: int  # C, the TP size
    rank: int  # this process's rank (0 in emulated mode)
    emulated: bool
    group: Group | None = None
    dtype: torch.dtype = torch.bfloat16

    @property
    def local_ranks(self) -> range:
        """Ranks whose shards this process holds."""
        return range(self.size) if self.emulated else range(self.rank, self.rank + 1)


class ColumnParallelLinear:
    """A bias, when the layer has one, is sharded with the weight's output dim and added to each shard's
    output (elementwise: batch and TP invariant)."""

    def __init__(self, shards: list[Tensor], ctx: TPContext, bias: list[Tensor] | None = None) -> None:
        self.shards = shards
        self.ctx = ctx
        self.bias = bias

    def __call__(self, x: Tensor) -> Tensor:
        outs = [self.ctx.backend.linear(x, w) for w in self.shards]
        if self.bias is not None:
            outs = [o + b for o, b in zip(outs, self.bias)]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class RowParallelLinear:
    """A bias (replicated, whole) is added exactly once, to the reduced output: after the combine /
    all-reduce, the same elementwise add on every rank and at every TP size, so a TP-invariant reduction
    (bio+tbik) stays TP invariant."""

    def __init__(self, shards: list[Tensor], ctx: TPContext, name: str, bias: Tensor | None = None) -> None:
        self.shards = shards
        self.ctx = ctx
        self.name = name
        self.bias = bias
        # where `rounded=False` may return the partial itself (see __call__), decided once
        self._partial_is_delta = (
            bias is None
            and ctx.group is None
            and ctx.size == 1
            and fused.usable(shards[0])
            and getattr(ctx.backend, "ONE_PARTIAL_IS_A_CAST", False)
        )

    def __call__(self, x: Tensor, rounded: bool = True) -> Tensor:
        """The layer's output in the model dtype. With `rounded=False` the caller takes the output as a
        residual `delta` to a fused add + RMSNorm (`kernels.fused.rms_norm`), which rounds it to the model
        dtype before adding; at TP 1 in process on GPU, without a bias, where the backend's combine of one
        partial is that rounding (`ONE_PARTIAL_IS_A_CAST`), the partial is returned as it is: one cast
        kernel fewer per layer, the same bits."""
        if not rounded and self._partial_is_delta:
            return self.ctx.backend.row_partial(x, self.shards[0], 1, name=self.name)
        out = self._reduced(x)
        return out if self.bias is None else out + self.bias

    def _reduced(self, x: Tensor) -> Tensor:
        ctx = self.ctx
        b = ctx.backend
        if ctx.emulated:
            k = self.shards[0].shape[1]
            partials = [
                b.row_partial(x[..., i * k : (i + 1) * k], w, ctx.size, name=self.name)
                for i, w in enumerate(self.shards)
            ]
            return b.combine(partials, ctx.dtype)
        partial = b.row_partial(x, self.shards[0], ctx.size, name=self.name)
        if ctx.group is None:  # TP 1 in process; a TP-1 process group (DETAUDIT_TP1_GROUP) all-reduces
            assert ctx.size == 1
            return b.combine([partial], ctx.dtype)
        return b.all_reduce(partial, ctx.group, ctx.dtype)


class RMSNorm:
    def __init__(self, weight: Tensor, eps: float, backend: Backend) -> None:
        self.weight = weight
        self.eps = eps
        self.backend = backend
        self._fused = getattr(backend, "FUSED_RMS_NORM", False) and fused.usable(weight)  # (x is on weight's device)

    def __call__(self, x: Tensor) -> Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)

    def add(self, x: Tensor, delta: Tensor | None, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """The residual sum s = x + delta (x itself when delta is None; delta rounded to x's dtype first)
        and the normed s: (normed, s). On GPU, where the backend's RMSNorm is the fused kernel
        (`FUSED_RMS_NORM`), that kernel computes both (into `out`'s (normed, s) buffers where given: the
        engine's kept decode buffers); otherwise the add, then the backend's RMSNorm (`out` unused)."""
        if self._fused:
            y, s = fused.rms_norm(x, self.weight, self.eps, delta, out)
            return y, (x if s is None else s)
        s = x if delta is None else x + delta.to(x.dtype)
        return self.backend.rms_norm(s, self.weight, self.eps), s


class Rotary:
    """HF rotary embedding (rotate_half convention); cos/sin computed in fp32. `rope` (an
    `arch.RopeSpec`) selects transformers' frequency scaling: default, linear, llama3, or dynamic (which
    equals default up to max_position_embeddings, the only range the engine runs it in)."""

    def __init__(self, head_dim: int, theta: float, device: torch.device, rope=None) -> None:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        self.inv_freq = inv_freq if rope is None else scaled_inv_freq(inv_freq, rope)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, D]


def scaled_inv_freq(inv_freq: Tensor, rope) -> Tensor:
    """transformers' `modeling_rope_utils` frequency scaling, operation for operation (attention_factor
    is 1.0 for these types there)."""
    if rope.rope_type in ("default", "dynamic"):  # dynamic: unscaled up to max_position_embeddings
        return inv_freq
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type != "llama3":
        raise ValueError(f"rope_type {rope.rope_type!r}")
    factor, low, high = rope.factor, rope.low_freq_factor, rope.high_freq_factor
    old_context_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_context_len / low
    high_freq_wavelen = old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth_factor = (old_context_len / wavelen - low) / (high - low)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
