"""Parallel layers. Every reduction goes through the active Backend; collectives only through
`backend.all_reduce` (real TP) or `backend.combine` (emulated TP).

A layer holds a list of weight shards: one (this rank's) in real TP, all C in emulated TP.
Sharding (Megatron): q/k/v and gate/up are column-parallel (split the output dim, no cross-rank
reduction); o_proj and down_proj are row-parallel (split K; partials combined by the backend).
Embedding and lm_head are replicated on every rank, so the final logits are computed from identical
inputs by identical ops at every TP size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from detaudit.backends.base import Backend, Group


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
    def __init__(self, shards: list[Tensor], ctx: TPContext) -> None:
        self.shards = shards
        self.ctx = ctx

    def __call__(self, x: Tensor) -> Tensor:
        outs = [self.ctx.backend.linear(x, w) for w in self.shards]
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class RowParallelLinear:
    def __init__(self, shards: list[Tensor], ctx: TPContext, name: str) -> None:
        self.shards = shards
        self.ctx = ctx
        self.name = name

    def __call__(self, x: Tensor) -> Tensor:
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
        if ctx.size == 1:
            return b.combine([partial], ctx.dtype)
        assert ctx.group is not None
        return b.all_reduce(partial, ctx.group, ctx.dtype)


class RMSNorm:
    def __init__(self, weight: Tensor, eps: float, backend: Backend) -> None:
        self.weight = weight
        self.eps = eps
        self.backend = backend

    def __call__(self, x: Tensor) -> Tensor:
        return self.backend.rms_norm(x, self.weight, self.eps)


class Rotary:
    """HF 'default' rotary embedding (rotate_half convention); cos/sin computed in fp32."""

    def __init__(self, head_dim: int, theta: float, device: torch.device) -> None:
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        freqs = positions.float()[..., None] * self.inv_freq  # [B, T, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]  # [B, 1, T, D]


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
