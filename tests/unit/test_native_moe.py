"""bf16's grouped experts (`backends/native_moe.py`): the rows sorted by expert, the experts' row offsets
made on the device, one grouped product per projection, the outputs put back in (token, slot) order.
On a GPU torch runs the grouped products as CUTLASS kernels (tests/gpu/test_native_moe.py); here torch's
CPU grouped mm (a loop over the experts) runs the same code around them, checked against the
per-expert layouts the backend runs on CPU."""

from __future__ import annotations

import pytest
import torch

from detaudit.backends import experts as layouts
from detaudit.backends import get_backend, native_moe
from detaudit.backends.base import TPContext

E, H, INTER, K = 6, 32, 32, 2


def weights(ctx: TPContext, g: torch.Generator, dtype: torch.dtype) -> layouts.ExpertWeights:
    """Random experts sharded over ctx's ranks as the MoE layer loads them: gate_up [E, 2 I/C, H] (gate rows,
    then up rows), down [E, H, I/C]."""
    gate, up = (torch.randn(E, INTER, H, generator=g) / 4 for _ in range(2))
    down = torch.randn(E, H, INTER, generator=g) / 4
    c = ctx.size
    part = INTER // c
    gate_up = [torch.cat([gate[:, r * part : (r + 1) * part], up[:, r * part : (r + 1) * part]], 1) for r in range(c)]
    downs = [down[..., r * part : (r + 1) * part].contiguous() for r in range(c)]
    b = ctx.backend
    return b.expert_weights([w.to(dtype) for w in gate_up], [w.to(dtype) for w in downs], ctx, "t")


def routing(t: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-2 of E experts per token, expert 3 routed nowhere (an empty group), gates summing to 1."""
    scores = torch.rand(t, E, generator=g)
    scores[:, 3] = -1
    experts = scores.topk(K).indices
    gates = torch.rand(t, K, generator=g)
    return experts, gates / gates.sum(1, keepdim=True)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("tokens", [5, 70])  # the every-expert layout, then the per-expert one
def test_grouped_experts_match_the_per_expert_layouts(dtype, tol, tp, tokens):
    g = torch.Generator().manual_seed(tokens + tp)
    b = get_backend("bf16")
    ctx = TPContext(b, tp, 0, emulated=tp > 1, dtype=dtype)
    w = weights(ctx, g, dtype)
    h = torch.randn(tokens, H, generator=g).to(dtype)
    experts, gates = routing(tokens, g)
    assert native_moe.aligned(h, w) and not native_moe.usable(h, w)  # CPU: the backend keeps its layouts
    want = b.experts(h, experts, gates, w, ctx, decode=False)
    got = native_moe.run(b, h, experts, gates, w, ctx)
    assert got.shape == want.shape == (tokens, H) and got.dtype == want.dtype
    scale = want.float().abs().max().item()
    assert (got.float() - want.float()).abs().max().item() <= tol * scale


def test_operands_torch_cannot_group_keep_the_layouts():
    """torch's grouped mm takes rows of whole 16 bytes only: a rank's expert width of 12 bf16 is not."""
    ctx = TPContext(get_backend("bf16"), 1, 0, emulated=False, dtype=torch.bfloat16)
    w = ctx.backend.expert_weights([torch.zeros(E, 24, H).bfloat16()], [torch.zeros(E, H, 12).bfloat16()], ctx)
    assert not native_moe.aligned(torch.zeros(3, H).bfloat16(), w)
    assert not native_moe.aligned(torch.zeros(3, 36).bfloat16(), weights(ctx, torch.Generator(), torch.bfloat16))


def test_long_prefill_in_pieces_gives_the_whole_bits(monkeypatch):
    """Past PREFILL_BYTES the layer runs in pieces of tokens. The grouped product is replaced here by one
    whose rows do not depend on the other rows (each row alone by its expert, found from the offsets), so
    the pieces must give the whole layer's bits: a check of the sorting, offsets and reassembly, exact."""
    g = torch.Generator().manual_seed(3)
    b = get_backend("bf16")
    ctx = TPContext(b, 1, 0, emulated=False, dtype=torch.float32)
    w = weights(ctx, g, torch.float32)
    h = torch.randn(90, H, generator=g)
    experts, gates = routing(90, g)
    calls = []

    def row_by_row(x, w, offs):
        calls.append(x.shape[0])
        of_row = torch.searchsorted(offs, torch.arange(x.shape[0], dtype=offs.dtype), right=True)
        return torch.stack([x[i] @ w[e].t() for i, e in enumerate(of_row.tolist())])

    monkeypatch.setattr(native_moe, "grouped", row_by_row)
    whole = native_moe.run(b, h, experts, gates, w, ctx)
    assert calls == [90 * K, 90 * K]
    monkeypatch.setattr(layouts, "PREFILL_BYTES", 40 * K * (3 * INTER + 2 * H) * 4)  # 40 tokens' products
    assert torch.equal(native_moe.run(b, h, experts, gates, w, ctx), whole)
    assert calls[2:] == [30 * K] * 6  # gate / up and down of 3 pieces of 30 tokens
    ref = b.experts(h, experts, gates, w, ctx, decode=False)  # the per-expert layout, torch's own products
    assert (whole - ref).abs().max() <= 1e-5 * ref.abs().max()
