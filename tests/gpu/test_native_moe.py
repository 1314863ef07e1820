"""bf16's grouped experts on a GPU (`backends/native_moe.py`; skipped without CUDA, and where torch's
grouped mm has no CUTLASS path: compute capability other than 9.x / 10.x): at Qwen3-30B-A3B's expert
shapes against the per-expert layouts within bf16 tolerance, without a host sync, captured in a CUDA
graph; the engine runs a shrunk `qwen3-30b-a3b-shaped` under bf16 with graphed decode through it."""

from __future__ import annotations

import pytest
import torch

from detaudit.backends import experts as layouts
from detaudit.backends import native_moe
from gpu import moe_inputs
from gpu.moe_inputs import E, H

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _experts(tp: int, seed: int):
    """bf16's (backend, ctx, weights) of the shared random experts, where torch's grouped mm can run them."""
    b, ctx, w = moe_inputs.experts("bf16", tp, seed)
    if not native_moe.usable(torch.empty(1, H, device="cuda", dtype=torch.bfloat16), w):
        pytest.skip("torch's grouped mm has no CUTLASS path on this GPU (compute capability 9.x / 10.x)")
    return b, ctx, w


@pytest.mark.parametrize("tp", [1, 4])
@pytest.mark.parametrize("tokens", [8, 600])  # decode (every expert on every token), prefill (per expert)
def test_grouped_experts_match_the_per_expert_layouts(tp, tokens):
    """The grouped products (one launch per projection) against the backend's per-expert layouts (batched
    or one cuBLAS product per expert), both against an fp32 computation of the same layer: bf16 tolerance."""
    b, ctx, w = _experts(tp, 1)
    h, experts, gates = moe_inputs.tokens(tokens, 2)
    got = native_moe.run(b, h, experts, gates, w, ctx)
    want = layouts.run(b, h, experts, gates, w, ctx, tokens <= layouts.DENSE_TOKENS, "t")
    ref = torch.zeros(tokens, H, device="cuda")  # fp32, expert by expert over its (token, slot) rows
    for r in range(tp):
        for e in range(E):
            t, j = (experts == e).nonzero(as_tuple=True)
            y = h[t].float() @ w.gate_up[r][e].float().t()
            a = torch.nn.functional.silu(y[:, : y.shape[1] // 2]) * y[:, y.shape[1] // 2 :]
            ref.index_add_(0, t, gates[t, j, None] * (a @ w.down[r][e].float().t()))
    scale = ref.abs().max().item()
    assert got.shape == want.shape == (tokens, H) and got.dtype == torch.bfloat16
    for name, out in (("grouped", got), ("per expert", want)):
        err = (out.float() - ref).abs().max().item()
        assert err <= 2e-2 * scale, (name, tp, tokens, err, scale)
    assert (got.float() - want.float()).abs().max().item() <= 2e-2 * scale


def test_grouped_experts_no_host_sync_and_cuda_graph_replay():
    """A decode step's experts (64 requests) issue no host sync (torch's sync debug mode raises on one), and a
    CUDA graph captured over them gives, replayed on new hidden states and routing, the eager call's bits."""
    b, ctx, w = _experts(1, 3)
    h, experts, gates = moe_inputs.tokens(64, 4)
    b.experts(h, experts, gates, w, ctx, decode=True)  # warm-up: lazy initialisation may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        b.experts(h, experts, gates, w, ctx, decode=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        b.experts(h, experts, gates, w, ctx, decode=True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = b.experts(h, experts, gates, w, ctx, decode=True)
    h2, experts2, gates2 = moe_inputs.tokens(64, 5)
    for static, new in ((h, h2), (experts, experts2), (gates, gates2)):
        static.copy_(new)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, b.experts(h2, experts2, gates2, w, ctx, decode=True))


def test_engine_bf16_moe_graphed_decode_through_grouped_experts(tmp_path, monkeypatch):
    """A shrunk copy of `qwen3-30b-a3b-shaped` under bf16: prefill and every graphed decode step run the
    experts through `native_moe.run` (the graph is captured once and replayed), the manifest's description
    says so, and teacher forcing (one long prefill) re-scores the graphed decode's tokens within bf16
    noise (a stale routing or hidden state in the replay would be far off)."""
    import json
    import shutil

    from helpers import local_engine

    from detaudit.bench.e2e import random_prompts
    from detaudit.config import DecodingParams
    from detaudit.models import resolve_model

    ref = resolve_model("qwen3-30b-a3b-shaped", auto_prepare=True)
    d = tmp_path / "m"
    shutil.copytree(ref.path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(num_hidden_layers=4, num_experts=32, num_experts_per_tok=4)
    (d / "config.json").write_text(json.dumps(cfg))
    calls = []
    run = native_moe.run
    monkeypatch.setattr(native_moe, "run", lambda b, h, *a, **kw: calls.append(h.shape[0]) or run(b, h, *a, **kw))
    prompts = random_prompts(4, 100, 151936, seed=3)
    pids = [str(i) for i in range(4)]
    dec = DecodingParams(greedy=True, max_new_tokens=8)
    eng = local_engine(d, "bf16", 1, device="cuda", cuda_graphs=True)
    try:
        assert "grouped_mm" in eng.backend.describe()["experts"]
        gens = eng.generate(prompts, pids, dec, 4)
        assert eng.last_timings["cuda_graphs"] and len(eng.generator._graphs) == 1
        assert 4 * 100 in calls and 4 in calls  # the prefill's 400 tokens, the captured decode step's 4
        scored = eng.score(prompts, [g.token_ids for g in gens], 4)
    finally:
        eng.close()
    diff = torch.tensor([a - b for g, s in zip(gens, scored) for a, b in zip(g.token_logprobs, s)]).abs()
    assert diff.mean().item() < 0.05, diff
