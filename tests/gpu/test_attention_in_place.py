"""bio's attention kernel reading the model's q[B, Hq, T, D] in place and writing o_proj's [B, T, Hq, D]
(`triton_attn.attention_heads`) against the kernel before it, which read a position-major copy of the
query rows and whose output the engine transposed and copied twice (`tests/unit/attn_reference.py`, main
at 4541b76): bitwise at real shapes, prefill and decode. (Under the Triton interpreter:
`tests/unit/triton_checks.py`.)"""

from __future__ import annotations

import pytest
import torch
from helpers import require

from detaudit.backends import get_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
triton = require("triton", "triton")


# (batch, query heads, KV heads, query positions, cached keys): Qwen3-8B at TP 1 and at TP 4, a
# Qwen3-30B-A3B rank at TP 8 (one replicated KV head for 4 query heads), decode steps
SHAPES = [(4, 32, 8, 512, 512), (8, 8, 2, 300, 700), (4, 4, 1, 512, 512), (32, 32, 8, 1, 900), (64, 4, 1, 1, 530)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bsz,hq,hkv,t,length", SHAPES)
def test_in_place_attention_gives_the_copied_layouts_bits(bsz, hq, hkv, t, length, dtype):
    from unit import attn_reference

    from detaudit.backends.kernels import fixed

    g = torch.Generator(device="cuda").manual_seed(bsz + t)
    d, size = 128, -(-length // 256) * 256  # the cache holds more slots than attention reads
    k_cache = torch.randn(bsz, hkv, size, d, device="cuda", generator=g).to(dtype)
    v_cache = torch.randn(bsz, hkv, size, d, device="cuda", generator=g).to(dtype)
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]
    q = torch.randn(bsz, hq, t, d, device="cuda", generator=g).to(dtype)
    # each request's own positions: request b's last one (length - t) * b / bsz before the cache's end
    back = torch.arange(bsz, device="cuda")[:, None] * (length - t) // bsz
    pos = torch.arange(length - t, length, device="cuda").expand(bsz, t) - back
    for window in (None, 128):
        got = get_backend("bio").attention(q, k, v, pos, d**-0.5, window)
        want = attn_reference.heads(q, k, v, pos, d**-0.5, 64, window)  # bio's SPLIT: 64 keys a chunk
        flat = got.transpose(1, 2).reshape(bsz * t, hq * d)  # what the decoder hands o_proj
        assert flat.data_ptr() == got.data_ptr(), "o_proj's input is a view of the kernel's output"
        assert torch.equal(flat.view(bsz, t, hq, d), want), (bsz, hq, hkv, t, window)
    # q as a view of [B, T, Hq, D] (another layout of the same values): the same bits
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(fixed.attention(qt, k, v, pos, d**-0.5, 64), fixed.attention(q, k, v, pos, d**-0.5, 64))


def _paged_step(runs, hq, hkv, dtype, page=16, d=128, seed=0):
    """A vLLM-shaped step: runs of (query tokens, positions so far), pages shuffled, NaN where no request
    owns a slot. Returns the kernel's inputs and each request's keys / values gathered contiguously."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n_pages = 1 + sum(-(-seq // page) for _, seq in runs)
    cache = torch.full((n_pages, 2, page, hkv, d), float("nan"), device="cuda", dtype=dtype)
    order = (torch.randperm(n_pages - 1, device="cuda", generator=g) + 1).tolist()
    table = torch.zeros(len(runs), max(-(-seq // page) for _, seq in runs), dtype=torch.int32, device="cuda")
    longest = max(seq for _, seq in runs)
    keys = torch.zeros(len(runs), hkv, longest, d, device="cuda", dtype=dtype)
    values = torch.zeros_like(keys)
    for b, (_, seq) in enumerate(runs):
        mine = torch.tensor([order.pop() for _ in range(-(-seq // page))], dtype=torch.long, device="cuda")
        table[b, : len(mine)] = mine
        kv = torch.randn(2, seq, hkv, d, device="cuda", generator=g).to(dtype)
        j = torch.arange(seq, device="cuda")
        cache[mine[j // page], 0, j % page], cache[mine[j // page], 1, j % page] = kv[0], kv[1]
        keys[b, :, :seq], values[b, :, :seq] = kv[0].transpose(0, 1), kv[1].transpose(0, 1)
    starts = torch.tensor([0] + list(torch.tensor([t for t, _ in runs]).cumsum(0)), dtype=torch.int32, device="cuda")
    seqs = torch.tensor([seq for _, seq in runs], dtype=torch.int32, device="cuda")
    query = torch.randn(int(starts[-1]), hq, d, device="cuda", generator=g).to(dtype)
    return cache, table, starts, seqs, query, keys, values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hq,hkv", [(32, 8), (8, 2), (4, 1)])
def test_paged_attention_gives_the_contiguous_caches_bits(hq, hkv, dtype):
    """The vLLM plugin's kernel over pages and ragged query runs (`triton_paged`) against the built-in
    engine's (`attention_heads`) over the same keys in a contiguous cache, zero past each request's
    length: bitwise, for a step mixing prefills of 300 / 17 tokens, chunked prefill and decodes of up to
    900 positions, and a padding request with no queries."""
    from detaudit.backends.kernels import triton_attn, triton_paged

    runs = [(300, 300), (1, 900), (17, 530), (0, 0), (1, 1), (64, 700)]
    cache, table, starts, seqs, query, keys, values = _paged_step(runs, hq, hkv, dtype)
    out = torch.full_like(query, float("nan"))
    kc, vc = cache.unbind(1)
    steps = max(t for t, _ in runs)
    triton_paged.paged_attention(query, kc, vc, table, starts, seqs, steps, 128**-0.5, 64, out)
    q = torch.zeros(len(runs), hq, steps, 128, device="cuda", dtype=dtype)
    pos = torch.zeros(len(runs), steps, dtype=torch.int64, device="cuda")
    for b, (t, seq) in enumerate(runs):
        q[b, :, :t] = query[int(starts[b]) : int(starts[b]) + t].transpose(0, 1)
        pos[b, :t] = torch.arange(seq - t, seq, device="cuda")
    want = triton_attn.attention_heads(q, keys, values, pos, 128**-0.5, 64)
    for b, (t, _) in enumerate(runs):
        got = out[int(starts[b]) : int(starts[b]) + t]
        assert torch.equal(got, want[b, :, :t].transpose(0, 1)), (b, hq, hkv, dtype)
    # the backends' rows a block (32 here for 16-bit queries: the step holds prefills) and 16 alike
    narrow = torch.full_like(query, float("nan"))
    triton_paged.paged_attention(query, kc, vc, table, starts, seqs, steps, 128**-0.5, 64, narrow, block_r=16)
    assert torch.equal(narrow, out), (hq, hkv, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("d", [32, 64, 128, 256])
def test_the_backends_rows_a_block_give_16_rows_bits(d, dtype):
    """Wherever `triton_attn.rows_per_block` gives a prefill more than 16 rows a block (its head sizes and
    dtypes), both kernels give, bitwise, what 16 rows a block give: a prefill of 300 positions over 700
    cached keys, and a vLLM step that mixes it with decodes (which then run the prefill's rows a block)."""
    from detaudit.backends.kernels import triton_attn, triton_paged

    if triton_attn.rows_per_block(8 * 300, dtype, d, 64) == triton_attn.BLOCK_R:
        pytest.skip(f"16 rows a block at head size {d}, {dtype}: nothing to compare")
    g = torch.Generator(device="cuda").manual_seed(d)
    k, v = (torch.randn(2, 2, 700, d, device="cuda", generator=g).to(dtype) for _ in range(2))
    q = torch.randn(2, 8, 300, d, device="cuda", generator=g).to(dtype)
    pos = torch.arange(400, 700, device="cuda").expand(2, 300)
    for window in (None, 128):
        wide = triton_attn.attention_heads(q, k, v, pos, d**-0.5, 64, window)
        narrow = triton_attn.attention_heads(q, k, v, pos, d**-0.5, 64, window, block_r=16)
        assert torch.equal(wide, narrow), (d, dtype, window)
    runs = [(300, 700), (1, 900), (1, 33), (17, 530)]
    cache, table, starts, seqs, query, _, _ = _paged_step(runs, 8, 2, dtype, d=d, seed=d)
    kc, vc = cache.unbind(1)
    outs = [torch.full_like(query, float("nan")) for _ in range(2)]
    for out, rows in zip(outs, (None, 16)):
        triton_paged.paged_attention(query, kc, vc, table, starts, seqs, 300, d**-0.5, 64, out, block_r=rows)
    assert torch.equal(outs[0], outs[1]), (d, dtype)


def test_paged_decode_replays_from_a_cuda_graph():
    """A decode step captured once (lengths 1, as vLLM captures) and replayed with other lengths and
    queries in the same buffers gives the eager launch's bits: nothing is read on the host."""
    from detaudit.backends.kernels import triton_paged

    runs = [(1, 900), (1, 40), (1, 513), (1, 2)]
    cache, table, starts, seqs, query, _, _ = _paged_step(runs, 32, 8, torch.bfloat16)
    kc, vc = cache.unbind(1)
    s_buf, q_buf, out = seqs.clone().fill_(1), torch.zeros_like(query), torch.zeros_like(query)

    def step():
        triton_paged.paged_attention(q_buf, kc, vc, table, starts, s_buf, 1, 128**-0.5, 64, out)

    step()  # compiled and planned before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    s_buf.copy_(seqs)
    q_buf.copy_(query)
    graph.replay()
    eager = torch.empty_like(query)
    triton_paged.paged_attention(query, kc, vc, table, starts, seqs, 1, 128**-0.5, 64, eager)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@pytest.mark.parametrize("block_r", [32, 64, 128])
def test_paged_and_contiguous_agree_at_every_block_of_rows(block_r):
    """Whatever rows a program owns (`block_r`: the tile's M, which may change the MMA instruction and so a
    row's bits against the default 16), the plugin's paged kernel and the built-in engine's contiguous one
    still give each other's bits: they share the chunk update (`triton_attn.visit`)."""
    from detaudit.backends.kernels import triton_attn, triton_paged

    runs = [(300, 300), (1, 900), (17, 530), (64, 700)]
    cache, table, starts, seqs, query, keys, values = _paged_step(runs, 32, 8, torch.bfloat16, seed=block_r)
    out = torch.full_like(query, float("nan"))
    kc, vc = cache.unbind(1)
    steps = max(t for t, _ in runs)
    triton_paged.paged_attention(query, kc, vc, table, starts, seqs, steps, 128**-0.5, 64, out, block_r)
    q = torch.zeros(len(runs), 32, steps, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.zeros(len(runs), steps, dtype=torch.int64, device="cuda")
    for b, (t, seq) in enumerate(runs):
        q[b, :, :t] = query[int(starts[b]) : int(starts[b]) + t].transpose(0, 1)
        pos[b, :t] = torch.arange(seq - t, seq, device="cuda")
    want = triton_attn.attention_heads(q, keys, values, pos, 128**-0.5, 64, block_r=block_r)
    for b, (t, _) in enumerate(runs):
        assert torch.equal(out[int(starts[b]) : int(starts[b]) + t], want[b, :, :t].transpose(0, 1)), (b, block_r)


def test_bench_attention_runs_each_kernel_and_block():
    """`bench attention` at a small shape: a row per workload, kernel and layout, SDPA's row, the paged
    kernel giving the contiguous one's bits in every layout, and the default layout its own bits again
    (its timed calls replayed from CUDA graphs change nothing: run to run determinism)."""
    from detaudit.bench.attention import bench_attention

    df = bench_attention(batch=2, tokens=200, heads=(8, 2), head_dim=64, variants=((16, 1), (16, 2), (64, 1)))
    ours = df[df.kernel != "sdpa"]
    assert len(ours) == 2 * 3 * 2 and len(df[df.kernel == "sdpa"]) == 2
    assert (ours.ms > 0).all() and (df.tflops > 0).all()
    assert ours[ours.block_r == 16].bits_as_default.all() and ours.paged_bits_as_contiguous.all()
    # the 16-row layouts keep a row's bits from prefill to decode (64 rows: reported, not asserted)
    assert ours[(ours.workload == "prefill") & (ours.block_r == 16)].decode_bits_as_prefill.all()


@pytest.mark.parametrize("sub", [2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_blocks_sharing_a_program_keep_each_rows_bits(sub, dtype):
    """`sub` blocks of 16 rows a program, sharing each chunk's key / value loads: every block is computed
    by the same `visit` on the same [16, D] tiles as alone (the same MMA instruction, the same reductions),
    so both kernels give the one-block bits, bitwise, at real shapes, prefill and decode."""
    from detaudit.backends.kernels import triton_attn, triton_paged

    for bsz, hq, hkv, t, length in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(bsz * t + sub)
        k, v = (torch.randn(bsz, hkv, length, 128, device="cuda", generator=g).to(dtype) for _ in range(2))
        q = torch.randn(bsz, hq, t, 128, device="cuda", generator=g).to(dtype)
        pos = torch.arange(length - t, length, device="cuda").expand(bsz, t)
        for window in (None, 128):
            one = triton_attn.attention_heads(q, k, v, pos, 128**-0.5, 64, window, block_r=16)
            shared = triton_attn.attention_heads(q, k, v, pos, 128**-0.5, 64, window, block_r=16, sub=sub)
            assert torch.equal(shared, one), (bsz, hq, hkv, t, window, sub)
    runs = [(300, 300), (1, 900), (17, 530), (0, 0), (64, 700)]
    cache, table, starts, seqs, query, _, _ = _paged_step(runs, 32, 8, dtype, seed=sub)
    kc, vc = cache.unbind(1)
    outs = [torch.full_like(query, float("nan")) for _ in range(2)]
    for out, s in zip(outs, (1, sub)):
        triton_paged.paged_attention(query, kc, vc, table, starts, seqs, 300, 128**-0.5, 64, out, block_r=16, sub=s)
    assert torch.equal(outs[0], outs[1]), sub
