"""The invariant backends' MoE decode steps on GPU: with at most one (token, slot) row an expert they take
the grouped layout (`experts.Grouped`: one launch a projection over the chosen rows, so a step reads only
its chosen experts' weights). At Qwen3-30B-A3B's expert shapes, TP 1 and emulated TP 4 (tree leaves 8
and 2 a rank), every rank's fp32 partial of the grouped layout has the bits of the every-expert layout
(`experts.Dense`), at decode-sized steps and past them (both tile families of `grouped_mm`); a graphed
decode step takes the grouped layout, issues no host sync, and its replay gives the eager call's bits.
Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from detaudit.backends import experts as layouts
from detaudit.backends.kernels import grouped_mm
from gpu import moe_inputs
from gpu.moe_inputs import H

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


class _Partials:
    """A TP group's stand-in that keeps every local rank's fp32 partial (stacked) instead of reducing them,
    so the layouts are compared on fp32 bits, before any cast."""

    def __init__(self, size: int) -> None:
        self.size = size

    def reduce(self, partials: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(partials)


@pytest.mark.parametrize("backend", ["bio", "bio+tbik"])
@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("tokens", [1, 8, 16, 32])  # 8 to 256 rows: decode-sized up to E = 128 rows
def test_grouped_layout_equals_every_expert_layout_at_decode_shapes(backend, tp, tokens):
    b, _, w = moe_inputs.experts(backend, tp, 7)
    h, experts, gates = moe_inputs.tokens(tokens, 3)
    for r in range(tp):
        got = layouts.Grouped(b, w, r, "t", h, experts).down(gates, tp)
        assert got.dtype == torch.float32 and got.shape == (tokens, H)
        assert torch.equal(got, layouts.Dense(b, w, r, "t", h, experts).down(gates, tp)), r


@pytest.mark.parametrize("backend", ["bio", "bio+tbik"])
def test_grouped_decode_no_host_sync_and_graph_replay(backend, monkeypatch):
    b, _, w = moe_inputs.experts(backend, 1, 5)
    ctx = _Partials(1)
    h, experts, gates = moe_inputs.tokens(16, 4)  # 128 rows: decode-sized
    launches = []
    grouped = grouped_mm.grouped
    monkeypatch.setattr(grouped_mm, "grouped", lambda *a, **k: launches.append(1) or grouped(*a, **k))
    layouts.run(b, h, experts, gates, w, ctx, True, "t")
    assert len(launches) == 2  # gate / up, down: the grouped layout
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layouts.run(b, h, experts, gates, w, ctx, True, "t")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layouts.run(b, h, experts, gates, w, ctx, True, "t")
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layouts.run(b, h, experts, gates, w, ctx, True, "t")
    h2, experts2, gates2 = moe_inputs.tokens(16, 9)
    for static, new in ((h, h2), (experts, experts2), (gates, gates2)):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, layouts.run(b, h2, experts2, gates2, w, ctx, True, "t"))
