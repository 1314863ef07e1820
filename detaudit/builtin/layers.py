"""Parallel layers. Every reduction goes through the layer's backend: a column-parallel part is
`backend.linear`, a row-parallel layer one `backend.row_parallel` call (its products and its TP
combine: `backend.combine` in emulated TP, the backend's all-reduce in real TP).

A layer holds a list of weight shards: one (this rank's) in real TP, all C in emulated TP.
Sharding (Megatron): q/k/v and gate/up are column-parallel (split the output dim, no cross-rank
reduction); o_proj and down_proj are row-parallel (split K; partials combined by the backend).
Embedding and lm_head are replicated on every rank, so the final logits are computed from identical
inputs by identical ops at every TP size.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from detaudit.backends.base import TPContext


class ColumnParallelLinear:
    """Several column-parallel projections that read the same input (q / k / v, gate / up), returned
    as a tuple. `parts[p][r]` is part p's weight shard for the r-th rank this process holds; a bias,
    where the layer has one, is sharded with the weight's output dim and added to each shard's output
    (elementwise: batch and TP invariant).

    With `merge`, each rank's parts are one product (as serving engines' QKVParallelLinear /
    MergedColumnParallelLinear) and the parts are column slices of it: a column's bits do not depend on
    how many columns share the product under the invariant backends (their reduction never follows the
    tiling), so merging changes only bf16's library GEMM problem, as it does in a serving engine."""

    def __init__(self, parts: list[list[Tensor]], ctx: TPContext, biases: list[list[Tensor]] | None, merge: bool):
        self.ctx = ctx
        self.widths = [shards[0].shape[0] for shards in parts]
        ranks = range(len(parts[0]))
        if merge:  # one [sum of widths, K] weight (and bias) per rank
            self.weights = [[torch.cat([shards[r] for shards in parts])] for r in ranks]
            self.biases = None if biases is None else [[torch.cat([b[r] for b in biases])] for r in ranks]
        else:  # per rank, one weight per part
            self.weights = [[shards[r] for shards in parts] for r in ranks]
            self.biases = None if biases is None else [[b[r] for b in biases] for r in ranks]

    def _rank(self, x: Tensor, r: int) -> list[Tensor]:
        """Rank r's outputs, one per part (column slices of one product where merged)."""
        linear = self.ctx.backend.linear
        outs = [linear(x, w) for w in self.weights[r]]
        if self.biases is not None:
            outs = [o + b for o, b in zip(outs, self.biases[r])]
        if len(outs) == len(self.widths):
            return outs
        return list(outs[0].split(self.widths, dim=-1))

    def __call__(self, x: Tensor) -> tuple[Tensor, ...]:
        per_rank = [self._rank(x, r) for r in range(len(self.weights))]
        if len(per_rank) == 1:
            return tuple(per_rank[0])
        return tuple(torch.cat(shards, dim=-1) for shards in zip(*per_rank))


class RowParallelLinear:
    """A bias (replicated, whole) is added exactly once, to the reduced output: after the combine /
    all-reduce, the same elementwise add on every rank and at every TP size, so a TP-invariant reduction
    (bio+tbik) stays TP invariant.

    At TP 1 in process the backend computes the product rounded once to the model dtype in the kernel's
    store (`row_output`), bit for bit the combine of its one partial (`backends/base.py`), without writing
    and re-reading an fp32 partial."""

    def __init__(self, shards: list[Tensor], ctx: TPContext, name: str, bias: Tensor | None = None) -> None:
        self.shards = shards
        self.ctx = ctx
        self.name = name
        self.bias = bias

    def __call__(self, x: Tensor) -> Tensor:
        out = self.ctx.backend.row_parallel(x, self.shards, self.ctx, self.name)
        return out if self.bias is None else out + self.bias


class RMSNorm:
    """The weight and epsilon of one RMSNorm; how it runs (with the residual add) is `ops`' choice."""

    def __init__(self, weight: Tensor, eps: float) -> None:
        self.weight = weight
        self.eps = eps


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
