"""Sampling filters whose result for a row depends on that row alone, whatever rows share the tensor:
the cumulative sums of top-p (`row_cumsum`) and vLLM's top-k / top-p filter as the plugin runs it
(`top_k_top_p`).

Why not `torch.cumsum`: on CUDA it takes CUB's device-wide scan when the tensor is a single row, and
otherwise a per-row scan whose thread layout, and so its summation tree, follows the number of rows
(ATen's `get_log_num_threads_x_inner_scan`). A request sampled alone and the same request in a batch
then get other cumulative sums, and the top-p cut can move by one token. `row_cumsum` scans only rows
of `_WIDTH` elements, at least two of them: there ATen's scan runs its up- and down-sweeps over one tile
and every element's sum is formed the same way for any layout; the levels are joined in a fixed order.

Why not vLLM's `apply_top_k_top_p`: vLLM 0.25.1 filters with a Triton kernel when a GPU step samples 8
or more requests and with a PyTorch sort below 8 (`vllm/v1/sample/ops/topk_topp_sampler.py`), and the
two keep different tokens where tied probabilities straddle the top-p cut (bf16 logits tie often). A
request's sampled token then depended on how many requests shared its step (reports/gpu/vllm).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

_WIDTH = 16  # ATen's inner scan uses at least 16 threads a row, a tile of 32: a 16-wide row is one tile


def _scan_short(x: Tensor) -> Tensor:
    """Inclusive cumsum of rows of at most `_WIDTH` elements, as at least two rows (one more row of
    zeros for a single one, so CUB's single-row scan is never taken)."""
    if x.shape[0] > 1:
        return torch.cumsum(x, dim=-1)
    return torch.cumsum(torch.cat([x, torch.zeros_like(x)]), dim=-1)[:1]


def row_cumsum(x: Tensor) -> Tensor:
    """Inclusive cumulative sums along the last dim of `x` [R, n]: blocks of `_WIDTH` scanned on their
    own, the sums of the blocks before each block (this function, one level up) added to each."""
    rows, n = x.shape
    if n <= _WIDTH:
        return _scan_short(x)
    blocks = -(-n // _WIDTH)
    padded = F.pad(x, (0, blocks * _WIDTH - n))  # zeros after the row: no earlier sum changes
    within = _scan_short(padded.reshape(rows * blocks, _WIDTH)).view(rows, blocks, _WIDTH)
    totals = row_cumsum(within[:, :, -1].contiguous())  # [R, blocks]
    before = F.pad(totals[:, :-1], (1, 0))  # what precedes each block
    return (within + before.unsqueeze(-1)).reshape(rows, blocks * _WIDTH)[:, :n]


def top_p_drop(probs: Tensor, p: Tensor | float) -> Tensor:
    """Top-p's cut of rows of probabilities sorted in descending order: True where the mass ranked above
    a token already exceeds `p` (a float, or [R, 1] per row), so the shortest prefix reaching p stays."""
    return (row_cumsum(probs) - probs) > p


def top_k_top_p(logits: Tensor, k: Tensor | None, p: Tensor | None) -> Tensor:
    """vLLM's filter (`apply_top_k_top_p`: per-request `k` [R] and `p` [R]; the dropped logits set to
    -inf, in place) with one algorithm at every batch size. Top-k keeps every logit at least the k-th
    largest (ties at the cut all kept, as vLLM's rule); top-p (`top_p_drop`, the built-in engine's
    rule) ranks the tokens in descending order, ties by token id (a stable sort)."""
    if k is None and p is None:
        return logits
    vocab = logits.shape[-1]
    ranked, order = logits.sort(dim=-1, descending=True, stable=True)
    if k is not None:
        kth = ranked.gather(1, (k.to(torch.long).clamp(1, vocab) - 1).unsqueeze(1))
        ranked = ranked.masked_fill(ranked < kth, float("-inf"))
    if p is not None:
        probs = ranked.float().softmax(dim=-1)
        drop = top_p_drop(probs, p.to(probs.dtype).unsqueeze(1))
        ranked = ranked.masked_fill(drop, float("-inf"))
    return logits.scatter_(-1, order, ranked)
