"""Inputs of the GPU MoE layer tests (`test_native_moe.py`, `test_grouped_decode.py`): random experts at
Qwen3-30B-A3B's expert shapes, sharded over TP ranks as the MoE layer loads them, and tokens with a
skewed top-K routing."""

from __future__ import annotations

import torch

from detaudit.backends import get_backend
from detaudit.backends.base import TPContext

E, K, H, INTER = 128, 8, 2048, 768  # Qwen3-30B-A3B's experts


def experts(backend: str, tp: int, seed: int):
    """(backend, ctx, weights) of E random experts sharded over TP `tp` (emulated: every rank's shards
    here), laid out by the backend as the MoE layer loads them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = get_backend(backend)
    ctx = TPContext(b, tp, 0, emulated=tp > 1, dtype=torch.bfloat16)
    gate, up = (torch.randn(E, INTER, H, device="cuda", generator=g).bfloat16() / 32 for _ in range(2))
    down = torch.randn(E, H, INTER, device="cuda", generator=g).bfloat16() / 32
    p = INTER // tp
    gate_up = [torch.cat([gate[:, r * p : (r + 1) * p], up[:, r * p : (r + 1) * p]], 1) for r in range(tp)]
    downs = [down[..., r * p : (r + 1) * p].contiguous() for r in range(tp)]
    return b, ctx, b.expert_weights(gate_up, downs, ctx, "t")


def tokens(t: int, seed: int):
    """h[t, H] and a skewed top-K routing (low experts get long runs, high ones a few rows or none)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(t, H, device="cuda", generator=g).bfloat16()
    scores = torch.rand(t, E, device="cuda", generator=g) * torch.linspace(4, 1, E, device="cuda") ** 3
    top = scores.topk(K)
    return h, top.indices, top.values / top.values.sum(1, keepdim=True)
