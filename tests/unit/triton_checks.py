"""Checks of the Triton kernels, run by test_triton_interpret.py in a subprocess with
TRITON_INTERPRET=1 (the variable must be set before triton is imported). Small shapes: the interpreter
is slow; `narrow_shapes` draws narrow and odd ones with hypothesis (a few examples each). Exits non-zero
with a message on the first failed check."""

from __future__ import annotations

import sys

import torch
from interpreter_speed import install
from triton.runtime import interpreter

from detaudit.backends import get_backend
from detaudit.backends.bio import weighted_experts
from detaudit.backends.kernels import grouped_mm, tree, triton_attn, triton_mm, triton_paged, triton_rows


def _slot_free_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """The interpreter's `tl.dot` is `np.matmul`, and numpy's BLAS may give a row other bits in another
    slot of the block (its micro-kernel's edge paths: seen on a CPU without AVX-512). A GPU MMA does not,
    and these checks test the kernels' own slot independence, so here every element of the product is
    the same sequence of fp32 multiplies and adds over k, whatever its row, column or block shape (no
    BLAS, no FMA). The accumulator is added after the product, as the interpreter does."""
    if any(t.dtype.primitive_bitwidth == 8 and t.dtype.is_floating() for t in (a, b)):
        raise NotImplementedError("fp8 dot: not used by these kernels")
    out = d.data.dtype
    x, y = a.data.astype(out), b.data.astype(out)
    acc = x[..., :, 0:1] * y[..., 0:1, :]
    for k in range(1, x.shape[-1]):
        acc = acc + x[..., :, k : k + 1] * y[..., k : k + 1, :]
    return interpreter.TensorHandle(acc + d.data, d.dtype.scalar)


interpreter.InterpreterBuilder.create_dot = _slot_free_dot
install()


def check(cond: bool, what: str) -> None:
    if not cond:
        sys.exit(f"FAILED: {what}")


def main(part: str = "all") -> None:
    """Every check (`part` "all"), or one of two halves of about the same interpreter time, which the test
    runs in two processes at once: "moe" (the MoE layer's grouped layout in an engine) and "rest"."""
    if part not in ("all", "moe", "rest"):
        sys.exit(f"unknown part {part!r}: all, moe or rest")
    if part in ("all", "moe"):
        grouped_layout_tp_invariant()
    if part in ("all", "rest"):
        rest()
    print("ok")


def rest() -> None:
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        for k, n in ((64, 20), (48, 33), (40, 16)):
            x = torch.randn(40, k, generator=g).to(dt)
            w = torch.randn(n, k, generator=g).to(dt)
            full = triton_mm.mm(x, w)
            if dt != torch.float32:  # the bf16 epilogue rounds like a cast of the fp32 result
                check(torch.equal(triton_mm.mm(x, w, out_dtype=dt), full.to(dt)), f"rounded store {dt} {k}x{n}")
            ref = x.double() @ w.double().t()
            check(((full.double() - ref).abs().max() < 1e-4 * ref.abs().max()).item(), f"accuracy {dt} {k}x{n}")
            for m in range(1, 41):
                check(torch.equal(triton_mm.mm(x[:m], w), full[:m]), f"mm prefix {dt} {k}x{n} m={m}")
            for start in (1, 7, 17):  # a row in another slot of its block (the dot above is slot-free)
                check(torch.equal(triton_mm.mm(x[start:], w), full[start:]), f"mm row slot {dt} {k}x{n} {start}")
            # the tree kernel: rank r of C owns K/C columns; subtrees combined along the top of the tree
            if k % 8 == 0:
                one = triton_mm.mm(x, w, leaves=8)
                check(((one.double() - ref).abs().max() < 1e-4 * ref.abs().max()).item(), f"tree accuracy {dt} {k}x{n}")
                for c in (2, 4, 8):
                    kc = k // c
                    parts = [
                        triton_mm.mm(
                            x[:, r * kc : (r + 1) * kc].contiguous(), w[:, r * kc : (r + 1) * kc], leaves=8 // c
                        )
                        for r in range(c)
                    ]
                    check(torch.equal(tree.tree_sum(parts), one), f"tree TP invariance {dt} {k}x{n} C={c}")
                check(torch.equal(triton_mm.mm(x[:3], w, leaves=8), one[:3]), f"tree batch invariance {dt}")
        # batched (attention-shaped) products: invariant in the batch count
        a = torch.randn(6, 5, 16, generator=g).to(dt)
        b = torch.randn(6, 16, 16, generator=g).to(dt)
        full = triton_mm.mm(a, b)
        check(torch.equal(triton_mm.mm(a[2:3], b[2:3]), full[2:3]), f"batched mm {dt}")
        check(
            torch.equal(triton_mm.mm(a, b.transpose(1, 2).contiguous().transpose(1, 2)), full), f"strided operand {dt}"
        )
    # the attention kernel: the same function as the PyTorch formulation, and its own bits do not depend
    # on the rows beside a row (a program always multiplies BLOCK_R rows, padded) nor on how many chunks
    # its program walks: prefill == decode and batch invariance, bitwise (tests/gpu: at real shapes)
    for dt in (torch.float32, torch.bfloat16):
        q = torch.randn(3, 20, 16, generator=g).to(dt)
        k = torch.randn(3, 70, 16, generator=g).to(dt)
        v = torch.randn(3, 70, 16, generator=g).to(dt)
        pos = torch.randint(0, 70, (3, 20), generator=g)
        out = triton_attn.attention(q, k, v, pos, 0.25, 64)
        ref = get_backend("bf16").attention(q.float()[:, None], k.float()[:, None], v.float()[:, None], pos, 0.25)[:, 0]
        tol = 1e-5 if dt == torch.float32 else 3e-2
        check(torch.allclose(out.float(), ref, atol=tol, rtol=tol), f"attention kernel accuracy {dt}")
        attention_bits(q, k, v, dt)
        attention_in_place(g, dt)
        paged_attention_bits(g, dt)
    # row sums: one program per row
    x = torch.randn(9, 2500, generator=g)
    sums = triton_rows.row_sum(x)
    check(torch.allclose(sums.double(), x.double().sum(1), atol=1e-3), "row sum accuracy")
    check(all(torch.equal(triton_rows.row_sum(x[:m]), sums[:m]) for m in (1, 4)), "row sum batch invariance")
    fused_row_ops(g)
    narrow_shapes()
    grouped_experts(g)
    block_tables(g)
    grouped_layer_fp32_partials()
    fast_path_end_to_end()
    gluon_fallback()
    swapped_products(g)
    bench_attention_rows()


def attention_bits(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dt: torch.dtype) -> None:
    """Prefill (the last 20 positions of 70 keys, rows spanning two programs and two chunks) against
    decode (one row, the cache up to its position), and each request alone against the batch, with and
    without a sliding window: the same bits."""
    groups, rows, length = q.shape[0], q.shape[1], k.shape[1]
    pos = (torch.arange(rows) + (length - rows)).expand(groups, rows).contiguous()
    for window in (None, 8):
        pre = triton_attn.attention(q, k, v, pos, 0.25, 64, window)
        for t in (0, 1, 15, 16, rows - 1):  # first, second and last slot of a program, the next program's
            end = length - rows + t + 1
            step = triton_attn.attention(q[:, t : t + 1], k[:, :end], v[:, :end], pos[:, t : t + 1], 0.25, 64, window)
            check(torch.equal(step, pre[:, t : t + 1]), f"attention prefill == decode {dt} window={window} t={t}")
        for i in range(groups):
            one = triton_attn.attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], pos[i : i + 1], 0.25, 64, window)
            check(torch.equal(one, pre[i : i + 1]), f"attention batch invariance {dt} window={window} request {i}")


def attention_in_place(g: torch.Generator, dt: torch.dtype) -> None:
    """The kernel reading each query row (position, head) of q[B, Hq, T, D] through its strides and writing
    [B, T, Hq, D] gives, bit for bit, what the kernel before it gave around its copies (`attn_reference`,
    main at 4541b76): prefill and decode, 1 / 4 / 8 query heads per KV head, q contiguous or a view of
    [B, T, Hq, D], the cache a slice of a longer one, with and without a sliding window."""
    import attn_reference

    bsz, hq, d, size = 2, 8, 16, 80
    cases = [  # (KV heads, query positions, keys, q a view of [B, T, Hq, D], window); the last one decodes
        (2, 20, 70, False, None),
        (2, 20, 70, True, 8),
        (8, 5, 30, True, None),
        (1, 1, 67, False, 8),
    ]
    for hkv, t, length, view, window in cases:
        k_cache = torch.randn(bsz, hkv, size, d, generator=g).to(dt)
        v_cache = torch.randn(bsz, hkv, size, d, generator=g).to(dt)
        k, v = k_cache[:, :, :length], v_cache[:, :, :length]  # what attention reads: a view of the cache
        pos = torch.arange(length - t, length).expand(bsz, t) - torch.tensor([[0], [length // 3]])
        if view:
            q = torch.randn(bsz, t, hq, d, generator=g).to(dt).transpose(1, 2)
        else:
            q = torch.randn(bsz, hq, t, d, generator=g).to(dt)
        got = triton_attn.attention_heads(q, k, v, pos, 0.25, 64, window)
        want = attn_reference.heads(q, k, v, pos, 0.25, 64, window)
        what = f"attention in place {dt} hkv={hkv} t={t} q strides {q.stride()} window={window}"
        check(got.shape == q.shape and got.transpose(1, 2).is_contiguous(), f"{what}: layout")
        check(torch.equal(got.transpose(1, 2), want), f"{what}: bits")
        for sub in (2, 4):  # blocks of rows sharing a program's chunk loads, each computed as alone
            shared = triton_attn.attention_heads(q, k, v, pos, 0.25, 64, window, sub=sub)
            check(torch.equal(shared.transpose(1, 2), want), f"{what}: {sub} blocks a program, other bits")


def paged_attention_bits(g: torch.Generator, dt: torch.dtype) -> None:
    """The paged kernel (vLLM's cache layout and ragged query runs, read in place) gives the bits of
    `attention_heads` over each request's keys gathered into a contiguous copy, zero past its length
    (how the vLLM plugin computed attention before it): a step mixing prefill runs and decode tokens, pages
    in shuffled order, a padding request (no queries, no keys), 1 and 4 query heads per KV head. Every
    cache slot no request owns and every output row no query owns hold NaN: a read of one would show."""
    page, d, hq = 16, 16, 8
    # (query tokens, positions so far); 20 tokens x 4 heads fill every block of a 4-block program
    runs = [(5, 37), (1, 70), (0, 0), (12, 12), (1, 1), (1, 129), (20, 45)]
    for hkv in (2, 8):
        n_pages = 1 + sum(-(-seq // page) for _, seq in runs)
        cache = torch.full((n_pages, 2, page, hkv, d), float("nan")).to(dt)
        order = torch.randperm(n_pages - 1, generator=g) + 1  # page 0 stays NaN: owned by nobody
        width = max(-(-seq // page) for _, seq in runs)
        table = torch.zeros(len(runs), width, dtype=torch.int32)
        used = 0
        for b, (_, seq) in enumerate(runs):
            n = -(-seq // page)
            table[b, :n] = order[used : used + n]
            used += n
            for j in range(seq):
                cache[table[b, j // page], :, j % page] = torch.randn(2, hkv, d, generator=g).to(dt)
        starts = torch.tensor([0] + [sum(t for t, _ in runs[: b + 1]) for b in range(len(runs))], dtype=torch.int32)
        seqs = torch.tensor([seq for _, seq in runs], dtype=torch.int32)
        tokens = int(starts[-1])
        query = torch.randn(tokens + 3, hq, d, generator=g).to(dt)  # 3 padding tokens past the runs
        key_cache, value_cache = cache.unbind(1)
        steps = max(t for t, _ in runs)
        # the gathered reference, request by request at the step's widths
        longest = max(seq for _, seq in runs)
        keys = torch.zeros(len(runs), hkv, longest, d).to(dt)
        values = torch.zeros_like(keys)
        q = torch.zeros(len(runs), hq, steps, d).to(dt)
        pos = torch.zeros(len(runs), steps, dtype=torch.int64)
        for b, (t, seq) in enumerate(runs):
            for j in range(seq):
                keys[b, :, j] = key_cache[table[b, j // page], j % page]
                values[b, :, j] = value_cache[table[b, j // page], j % page]
            q[b, :, :t] = query[int(starts[b]) : int(starts[b]) + t].transpose(0, 1)
            pos[b, :t] = torch.arange(seq - t, seq)
        want = triton_attn.attention_heads(q, keys, values, pos, 0.25, 64)  # [R, Hq, steps, D]
        # a row's bits do not depend on how many rows share its program (`block_r`; with the interpreter's
        # slot-free dot, everything but the GPU's MMA instruction): neither kernel's, 16 or 64 rows
        wide = triton_attn.attention_heads(q, keys, values, pos, 0.25, 64, block_r=64)
        check(torch.equal(wide, want), f"attention_heads {dt} hkv={hkv}: 64 rows a program, other bits")
        for block_r, sub in ((triton_attn.BLOCK_R, 1), (64, 1), (triton_attn.BLOCK_R, 2), (triton_attn.BLOCK_R, 4)):
            out = torch.full_like(query, float("nan"))
            triton_paged.paged_attention(
                query, key_cache, value_cache, table, starts, seqs, steps, 0.25, 64, out, block_r=block_r, sub=sub
            )
            what = f"paged attention {dt} hkv={hkv} block_r={block_r} sub={sub}"
            for b, (t, _) in enumerate(runs):
                got = out[int(starts[b]) : int(starts[b]) + t]
                check(torch.equal(got, want[b, :, :t].transpose(0, 1)), f"{what}: request {b} bits")
            check(bool(out[tokens:].isnan().all()), f"{what}: rows no query owns are not written")


def bench_attention_rows() -> None:
    """`bench attention`'s own code (inputs, vLLM's page layout, the bit comparisons) on tiny shapes: under
    the interpreter every block of rows keeps the default's bits (its dot is slot-free) and the paged
    kernel the contiguous one's; on a GPU the same rows are timed (tests/gpu)."""
    from detaudit.bench.attention import bench_attention

    shape = dict(batch=2, tokens=40, heads=(4, 2), head_dim=16)
    df = bench_attention(**shape, variants=((16, 1), (16, 2)), split=16, device="cpu", reps=1)
    ours = df[df.kernel != "sdpa"]
    check(len(ours) == 8 and len(df) == 10, f"bench attention rows: {len(df)}")
    check(bool(ours.bits_as_default.all()), "bench attention: a block of rows changed the interpreter's bits")
    check(bool(ours.paged_bits_as_contiguous.all()), "bench attention: paged bits unlike contiguous")
    pre = ours[ours.workload == "prefill"]
    check(pre.decode_bits_as_prefill.tolist() == [True] * 4, "bench attention: a decode step unlike its prefill row")
    check(ours[ours.workload == "decode"].decode_bits_as_prefill.isna().all(), "bench attention: decode rows")


def _spread(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Normal values scaled by 10^-3 .. 10^2: sums whose order shows in the bits."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-3, 3, shape, generator=g)).to(dtype)


def _bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and torch.equal(got, want), what


def narrow_shapes() -> None:
    """Properties over narrow and odd shapes (hypothesis, a few examples each; fp32 bits compared): the
    product's rows and columns alone (K from 1, odd N); the tree at TP 1, 2, 4, 8 with K per rank from 1;
    attention rows in prefill, decode over a longer cache, a chunk of a chunked prefill and a request
    alone, with and without a sliding window; RMSNorm rows of odd widths; Qwen3's q / k norms inside the
    rotary kernel for any number of heads (a TP rank's); silu(gate) * up on shards of any width. A failed
    property prints its falsifying example."""
    from hypothesis import example, given, settings
    from hypothesis import strategies as st

    from detaudit.backends.kernels import fused
    from detaudit.builtin.layers import Rotary

    few = settings(max_examples=5, deadline=None, database=None)
    dtypes = st.sampled_from([torch.float32, torch.bfloat16])
    seeds = st.integers(0, 2**20)

    @few
    @given(m=st.integers(1, 33), k=st.integers(1, 70), n=st.integers(1, 40), dt=dtypes, seed=seeds, data=st.data())
    def products(m, k, n, dt, seed, data):
        x, w = _spread(m, k, seed=seed, dtype=dt), _spread(n, k, seed=seed + 1, dtype=dt)
        full = triton_mm.mm(x, w)
        j, i = data.draw(st.integers(1, m)), data.draw(st.integers(0, m - 1))
        c0 = data.draw(st.integers(0, n - 1))
        c1 = data.draw(st.integers(c0 + 1, n))
        _bits(triton_mm.mm(x[:j], w), full[:j], f"mm prefix {j}")
        _bits(triton_mm.mm(x[i:], w), full[i:], f"mm rows from {i}")
        _bits(triton_mm.mm(x, w[c0:c1]), full[:, c0:c1], f"mm columns {c0}:{c1}")

    @few
    @given(m=st.integers(1, 33), leaf=st.integers(1, 9), n=st.integers(1, 40), dt=dtypes, seed=seeds, data=st.data())
    def tree_ranks(m, leaf, n, dt, seed, data):
        k = 8 * leaf
        x, w = _spread(m, k, seed=seed, dtype=dt), _spread(n, k, seed=seed + 1, dtype=dt)
        one = triton_mm.mm(x, w, leaves=8)
        i = data.draw(st.integers(0, m - 1))
        for c in (1, 2, 4, 8):
            kc = k // c
            cols = [slice(r * kc, (r + 1) * kc) for r in range(c)]
            parts = [triton_mm.mm(x[:, s].contiguous(), w[:, s], leaves=8 // c) for s in cols]
            _bits(tree.tree_sum(parts), one, f"tree TP {c}, {kc} columns a rank")
            _bits(
                triton_mm.mm(x[i : i + 1, cols[0]].contiguous(), w[:, cols[0]], leaves=8 // c),
                parts[0][i : i + 1],
                f"tree TP {c}: rank 0's partial of row {i} alone",
            )

    # rows drawn as raw integers (taken modulo the length), so that an example can name them: the first
    # one reads 36 and 40 keys of a 90-key cache in decode and in a chunk (past 32: another split shows)
    @few
    @example(groups=2, length=90, d=16, window=None, dt=torch.float32, seed=0, rows=(35, 0, 20, 19, 1))
    @given(
        groups=st.integers(1, 3),
        length=st.integers(1, 90),
        d=st.sampled_from([16, 32]),
        window=st.one_of(st.none(), st.integers(1, 40)),
        dt=dtypes,
        seed=seeds,
        rows=st.tuples(*[st.integers(0, 2**16)] * 5),
    )
    def attention_rows(groups, length, d, window, dt, seed, rows):
        g = torch.Generator().manual_seed(seed)
        q, k = (torch.randn(groups, length, d, generator=g).to(dt) for _ in range(2))
        v = _spread(groups, length, d, seed=seed + 1, dtype=dt)
        pos = torch.arange(length).expand(groups, length).contiguous()
        pre = triton_attn.attention(q, k, v, pos, 0.25, 64, window)
        t = rows[0] % length
        end = t + 1 + rows[1] % (length - t)
        step = triton_attn.attention(q[:, t : t + 1], k[:, :end], v[:, :end], pos[:, t : t + 1], 0.25, 64, window)
        _bits(step, pre[:, t : t + 1], f"attention decode at {t} over {end} keys")
        t0 = rows[2] % length
        t1 = t0 + 1 + rows[3] % (length - t0)
        chunk = triton_attn.attention(q[:, t0:t1], k[:, :t1], v[:, :t1], pos[:, t0:t1], 0.25, 64, window)
        _bits(chunk, pre[:, t0:t1], f"attention chunk {t0}:{t1}")
        i = rows[4] % groups
        alone = triton_attn.attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], pos[i : i + 1], 0.25, 64, window)
        _bits(alone, pre[i : i + 1], "attention request alone")

    @few
    @given(m=st.integers(1, 33), n=st.integers(1, 300), seed=seeds, data=st.data())
    def norm_rows(m, n, seed, data):
        x, delta = _spread(m, n, seed=seed), _spread(m, n, seed=seed + 1)
        w = _spread(n, seed=seed + 2)
        y, s = fused.rms_norm(x, w, 1e-6, delta)
        i = data.draw(st.integers(0, m - 1))
        _bits(fused.rms_norm(x[i : i + 1], w, 1e-6, delta[i : i + 1])[0], y[i : i + 1], f"rms_norm row {i} alone")
        _bits(s, x + delta, "residual sum")

    @few
    @given(
        b=st.integers(1, 2),
        t=st.integers(1, 4),
        hkv=st.integers(1, 4),
        groups=st.integers(1, 3),
        seed=seeds,
        data=st.data(),
    )
    def qk_norm_heads(b, t, hkv, groups, seed, data):
        d, length, hq = 16, 9, hkv * groups
        qkv = _spread(b * t, (hq + 2 * hkv) * d, seed=seed)
        qw, kw = _spread(d, seed=seed + 1), _spread(d, seed=seed + 2)
        pos = torch.arange(t).expand(b, t) + torch.randint(
            0, length - t + 1, (b, 1), generator=torch.Generator().manual_seed(seed)
        )
        cos, sin = Rotary(d, 10000.0, torch.device("cpu")).cos_sin(pos, torch.float32)

        def run(h0, h1):  # KV heads h0:h1 and their query heads: a rank's columns of the merged product
            n = h1 - h0
            q = qkv[:, h0 * groups * d : h1 * groups * d]
            k = qkv[:, (hq + h0) * d : (hq + h1) * d]
            v = qkv[:, (hq + hkv + h0) * d : (hq + hkv + h1) * d]
            slots = (
                torch.arange(b)[:, None, None] * (n * length) + pos[:, :, None] + torch.arange(n) * length
            ).reshape(-1)
            kc, vc = torch.zeros(b, n, length, d), torch.zeros(b, n, length, d)
            out = fused.rope_store(q, k, v, cos, sin, kc, vc, slots, b, t, d, (qw, kw, 1e-6))
            return out, kc

        full_q, full_k = run(0, hkv)
        h0 = data.draw(st.integers(0, hkv - 1))
        h1 = data.draw(st.integers(h0 + 1, hkv))
        q, kc = run(h0, h1)
        _bits(q, full_q[:, h0 * groups : h1 * groups], f"q heads of KV heads {h0}:{h1}")
        _bits(kc, full_k[:, h0:h1], f"k heads {h0}:{h1}")

    @few
    @given(m=st.integers(1, 9), w=st.integers(1, 70), seed=seeds, data=st.data())
    def silu_shards(m, w, seed, data):
        c = 4
        # gates within +-50: exp(-gate) stays finite in fp32 (numpy, the interpreter's exp, warns on inf)
        gate = torch.randn(m, c * w, generator=torch.Generator().manual_seed(seed)) * 10
        up = _spread(m, c * w, seed=seed + 1)
        full = fused.silu_mul(gate, up)
        r = data.draw(st.integers(0, c - 1))
        merged = torch.cat([gate[:, r * w : (r + 1) * w], up[:, r * w : (r + 1) * w]], 1)
        _bits(fused.silu_mul(merged[:, :w], merged[:, w:]), full[:, r * w : (r + 1) * w], f"silu rank {r} width {w}")

    for prop in (products, tree_ranks, attention_rows, norm_rows, qk_norm_heads, silu_shards):
        try:
            prop()
        except AssertionError as e:
            sys.exit(f"FAILED: {prop.__name__}: {e}")


def fused_row_ops(g: torch.Generator) -> None:
    """The one-launch per-token kernels (fp32 here: the interpreter's bf16 conversions are numpy's; on a
    GPU tests/gpu/test_fused.py checks bf16 bitwise): rotary + cache writes give the op-by-op bits, the
    fused add + RMSNorm is batch invariant and accurate, silu * up is accurate."""
    import torch.nn.functional as F

    from detaudit.backends.kernels import fused
    from detaudit.backends.row_ops import apply_rotary
    from detaudit.builtin.layers import Rotary

    b, t, hq, hkv, d, length = 2, 3, 4, 2, 16, 9
    q, k, v = (torch.randn(b * t, h * d, generator=g) for h in (hq, hkv, hkv))
    pos = torch.arange(t).expand(b, t) + torch.tensor([[1], [5]])
    cos, sin = Rotary(d, 10000.0, torch.device("cpu")).cos_sin(pos, torch.float32)
    slots = (torch.arange(b)[:, None, None] * (hkv * length) + pos[:, :, None] + torch.arange(hkv) * length).reshape(-1)
    kc, vc = torch.zeros(b, hkv, length, d), torch.zeros(b, hkv, length, d)
    got = fused.rope_store(q, k, v, cos, sin, kc, vc, slots, b, t, d)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    kr = apply_rotary(k.view(b, t, hkv, d).transpose(1, 2), cos, sin)
    want_k.view(-1, d).index_copy_(0, slots, kr.transpose(1, 2).reshape(-1, d))
    want_v.view(-1, d).index_copy_(0, slots, v.view(-1, d))
    check(torch.equal(got, apply_rotary(q.view(b, t, hq, d).transpose(1, 2), cos, sin)), "fused rotary q")
    check(torch.equal(kc, want_k) and torch.equal(vc, want_v), "fused rotary k and cache writes")
    qw, kw = torch.randn(d, generator=g), torch.randn(d, generator=g)  # q / k norms inside the kernel
    kc2, vc2, kc3, vc3 = (torch.zeros(b, hkv, length, d) for _ in range(4))
    normed = fused.rope_store(q, k, v, cos, sin, kc2, vc2, slots, b, t, d, (qw, kw, 1e-6))
    qn = fused.rms_norm(q.reshape(-1, d), qw, 1e-6)[0].view(b * t, -1)
    kn = fused.rms_norm(k.reshape(-1, d), kw, 1e-6)[0].view(b * t, -1)
    check(
        torch.equal(normed, fused.rope_store(qn, kn, v, cos, sin, kc3, vc3, slots, b, t, d)) and torch.equal(kc2, kc3),
        "q / k norm inside the rotary kernel",
    )
    # the vLLM plugin's rotary: q or k alone as [T, H*D] (here column slices of one product)
    qs, ks, _ = torch.cat([q, k, v], 1).split([hq * d, hkv * d, hkv * d], dim=1)
    cos_t, sin_t = cos.reshape(b * t, d), sin.reshape(b * t, d)
    for x, h in ((qs, hq), (ks, hkv)):
        want = apply_rotary(x.reshape(b * t, h, d), cos_t[:, None], sin_t[:, None]).reshape(b * t, h * d)
        check(torch.equal(fused.rope_rows(x, cos_t, sin_t, d), want), f"rotary of packed rows, {h} heads")
        check(torch.equal(fused.rope_rows(x, cos_t, sin_t, d, heads=1), want), f"rotary, {h} heads one a program")
    three = qs[:, : 3 * d]  # 3 heads in a tile of 4: the fourth masked
    want = apply_rotary(three.reshape(b * t, 3, d), cos_t[:, None], sin_t[:, None]).reshape(b * t, 3 * d)
    check(torch.equal(fused.rope_rows(three, cos_t, sin_t, d), want), "rotary, a tile's masked head")
    # RMSNorm of heads read in place: the bits of the kernel that read copied rows
    import fused_reference

    heads = qs.view(b * t, hq, d)  # heads of a column slice: no plain view of its rows
    want_heads = fused_reference.rms_norm(heads, qw, 1e-6)[0].view(b * t, hq, d)
    check(torch.equal(fused.rms_norm(heads, qw, 1e-6)[0], want_heads), "heads norm read in place")
    x, delta = torch.randn(6, 200, generator=g), torch.randn(6, 200, generator=g)
    w = torch.randn(200, generator=g)
    y, s = fused.rms_norm(x, w, 1e-6, delta)
    check(torch.equal(s, x + delta), "fused residual sum")
    want_y, want_s = fused_reference.rms_norm(x, w, 1e-6, delta)
    check(torch.equal(y, want_y) and torch.equal(s, want_s), "add + norm: the one-row kernel's bits")
    sd = s.double()
    ref = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    check(((y.double() - ref).abs().max() < 1e-5 * ref.abs().max()).item(), "fused rms_norm accuracy")
    check(
        all(torch.equal(fused.rms_norm(x[:m], w, 1e-6, delta[:m])[0], y[:m]) for m in (1, 4)),
        "fused rms_norm batch invariance",
    )
    gu = torch.randn(3, 100, generator=g) * 4  # the halves of a merged gate_up product
    gate, up = gu[:, :50], gu[:, 50:]
    check(torch.allclose(fused.silu_mul(gate, up), F.silu(gate) * up, rtol=1e-6, atol=1e-6), "fused silu * up")
    check(
        torch.equal(fused.silu_mul(gate, up), fused.silu_mul(gate.contiguous(), up.contiguous())),
        "silu * up from the merged product's halves",
    )
    kc4, vc4 = torch.zeros(b, hkv, length, d), torch.zeros(b, hkv, length, d)  # q, k, v: one product's columns
    qs, ks, vs = torch.cat([q, k, v], 1).split([hq * d, hkv * d, hkv * d], dim=1)
    merged = fused.rope_store(qs, ks, vs, cos, sin, kc4, vc4, slots, b, t, d, (qw, kw, 1e-6))
    check(torch.equal(merged, normed) and torch.equal(kc4, kc2) and torch.equal(vc4, vc2), "rotary from the merged qkv")


def fast_path_end_to_end() -> None:
    """The engine with its GPU fast path (`row_ops.FusedOps`: merged projections, the fused add + norm, rotary
    with Qwen3's q / k norms inside) forced onto CPU tensors runs the whole decoder and agrees with
    the reference path (`row_ops.TorchOps`) on a tiny random Qwen3 in fp32: the same greedy tokens, log-probs
    within fp32 rounding. (Bitwise on a GPU: tests/gpu.)"""
    import tempfile
    from pathlib import Path

    from transformers import Qwen3Config, Qwen3ForCausalLM

    from detaudit.backends import get_backend, row_ops
    from detaudit.builtin.local import LocalEngine
    from detaudit.config import DecodingParams, EngineOptions, EngineSettings
    from detaudit.models import resolve_model

    torch.manual_seed(0)
    cfg = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=256,
    )
    hf = Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    prompts, ids = [[5, 6, 7, 8, 9], [11, 12, 13]], ["a", "b"]
    dec = DecodingParams(greedy=True, max_new_tokens=4)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ref = resolve_model(str(Path(d)))
        for backend in ("bf16", "bio+tbik"):
            options = EngineOptions(EngineSettings(dtype="float32"), ref, backend)
            want = LocalEngine(options).generate(prompts, ids, dec, 2)
            cls = type(get_backend(backend))
            chosen = cls.row_ops
            cls.row_ops = lambda b, device: row_ops.FusedOps(b)
            try:
                eng = LocalEngine(options)
                got = eng.generate(prompts, ids, dec, 2)
            finally:
                cls.row_ops = chosen
            check(isinstance(eng.model.ops, row_ops.FusedOps), "the fast path was taken")
            check([g.token_ids for g in got] == [g.token_ids for g in want], f"fast path tokens {backend}")
            close = all(
                torch.allclose(torch.tensor(a.token_logprobs), torch.tensor(b.token_logprobs), atol=1e-4)
                for a, b in zip(got, want)
            )
            check(close, f"fast path log-probs {backend}")


def _table_reference(counts: torch.Tensor, starts: torch.Tensor, block_m: int, max_blocks: int) -> torch.Tensor:
    """`grouped_mm.block_table` as torch ops (the table's definition; it was computed this way before)."""
    experts = counts.shape[0]
    per = (counts + block_m - 1) // block_m
    ends = torch.cumsum(per, 0)
    b = torch.arange(max_blocks)
    e = torch.searchsorted(ends, b, right=True)
    live = e < experts
    ec = e.clamp(max=experts - 1)
    local = b - (ends[ec] - per[ec])
    first = starts[ec] + local * block_m
    rows = (counts[ec] - local * block_m).clamp(max=block_m)
    return torch.stack([torch.where(live, e, -1), first, torch.where(live, rows, 0)]).to(torch.int32)


def block_tables(g: torch.Generator) -> None:
    """The grouped launches' block table (one kernel) equals its torch definition for skewed and uniform
    routings, experts with no rows, one expert with every row, an empty step, and tables of several
    programs' chunks."""
    cases = [(0, 4, 6), (1, 1, 1), (13, 3, 6), (40, 8, 128), (300, 8, 128), (97, 2, 200), (64, 4, 8)]
    for t, k, e in cases:
        for skew in (False, True):
            scores = torch.rand(t, e, generator=g) * (torch.linspace(6, 1, e) ** 4 if skew else 1)
            experts = scores.topk(k).indices if t else torch.empty(0, k, dtype=torch.long)
            if skew and t:
                experts[:, 0] = 0  # every token's first slot on expert 0: one long run
            runs = grouped_mm.Runs(experts, e)
            for block_m in (16, 64, 128):
                got, max_blocks = runs.tiles(block_m)
                check(max_blocks == t * k // block_m + e, f"table size t={t} k={k} e={e} m={block_m}")
                want = _table_reference(runs.counts, runs.starts, block_m, max_blocks)
                check(torch.equal(got, want), f"block table t={t} k={k} e={e} skew={skew} m={block_m}")


def grouped_experts(g: torch.Generator) -> None:
    """`grouped_mm`: every expert's run in one launch gives each row the bits of that expert's own
    product by `triton_mm.mm` (rows in the same block slots: runs start blocks in both), gathered from
    its source row and stored at its destination, every leaf apart; `weighted_tree` gives the bits of the
    torch ops it replaces."""
    t, k, e, h, inter, leaves = 13, 3, 6, 32, 48, 8
    experts = torch.randint(0, e, (t, k), generator=g)
    experts[:7, 0] = 2  # one expert past one 16-row block; expert 5 gets none
    experts[experts == 5] = 4
    runs = grouped_mm.Runs(experts, e)
    order = runs.order
    counts = torch.bincount(experts.reshape(-1), minlength=e)
    blocks = runs.tiles(grouped_mm.INTERPRET_CONFIG["BLOCK_M"])[0]
    check(int((blocks[0] >= 0).sum()) == int(((counts + 15) // 16).sum()), "one block per 16 rows of an expert")
    x = torch.randn(t, h, generator=g).bfloat16()
    w_gu = torch.randn(e, 2 * inter, h, generator=g).bfloat16()
    src = (order // k).to(torch.int32)
    gu = grouped_mm.grouped(x, src, w_gu, runs, runs.identity, t * k, out_dtype=torch.bfloat16)
    act = torch.randn(t * k, inter, generator=g).bfloat16()  # sorted rows
    w_down = torch.randn(e, h, inter, generator=g).bfloat16()
    dst = order.to(torch.int32)
    down = grouped_mm.grouped(act, runs.identity, w_down, runs, dst, t * k)
    # leaf-major weights, [E, leaves, N, K/leaves], at each rank's leaf count: 8 (TP 1), 4 (TP 2), 1 (TP 8)
    by_leaves = {
        lv: grouped_mm.grouped(
            act, runs.identity, w_down.view(e, h, lv, inter // lv).transpose(1, 2).contiguous(), runs, dst, t * k
        )
        for lv in (leaves, 4, 1)
    }
    check(all(y.shape == (lv, t * k, h) for lv, y in by_leaves.items()), "one output per leaf, leaf dim kept")
    check(torch.equal(by_leaves[1][0], down), "one leaf-major leaf is the whole product")
    start = 0
    for ex in range(e):
        n = int(counts[ex])
        if not n:
            continue
        rows = order[start : start + n]
        want = triton_mm.mm(x[rows // k], w_gu[ex], out_dtype=torch.bfloat16)
        check(torch.equal(gu[start : start + n], want), f"grouped gate/up rows of expert {ex}")
        check(torch.equal(down[rows], triton_mm.mm(act[start : start + n], w_down[ex])), f"grouped down {ex}")
        for lv, y in by_leaves.items():
            leaf = inter // lv
            for j in range(lv):
                cols = slice(j * leaf, (j + 1) * leaf)
                part = triton_mm.mm(act[start : start + n, cols].contiguous(), w_down[ex, :, cols])
                check(torch.equal(y[j, rows], part), f"grouped down leaf {j} of {lv}, expert {ex}")
        start += n
    gates = torch.rand(t, k, generator=g)
    for lv in (1, 2, 4, 8):
        y = torch.randn(lv, t, k, h, generator=g)
        want = tree.pairwise(weighted_experts(y, gates))
        check(torch.equal(grouped_mm.weighted_tree(y, gates), want), f"weighted tree of {lv} leaves")
    y = torch.randn(t, k, h, generator=g)[:, :, ::2]  # one leaf, strided columns
    check(torch.equal(grouped_mm.weighted_tree(y, gates), weighted_experts(y, gates)), "weighted sum, one leaf")


def grouped_layout_tp_invariant() -> None:
    """The MoE layer's grouped layout (the GPU prefill path, here on CPU tensors through the interpreter)
    in an engine: bio+tbik on a tiny Mixtral at TP 1 and emulated TP 2 and 8 (one leaf a rank, leaf-major
    weights of one leaf), a 72-token prefill (past experts.DENSE_TOKENS, so the grouped layout runs: about 36
    rows an expert, two full blocks and a partial one under the interpreter's tiles), routing records
    included: bitwise equal."""
    import tempfile
    from pathlib import Path

    sys.path[:0] = [str(Path(__file__).parents[1]), str(Path(__file__).parents[1] / "integration")]
    import test_moe
    from helpers import local_engine

    from detaudit.config import DecodingParams

    usable = grouped_mm.usable
    asked = []
    grouped_mm.usable = lambda x: asked.append(x.shape[0]) or True  # the GPU layout on CPU tensors
    try:
        with tempfile.TemporaryDirectory() as d:
            path = test_moe.build("mixtral", Path(d) / "mixtral")
            prompt = [test_moe.token_ids(batch=1, length=72, seed=7)[0].tolist()]
            dec = DecodingParams(max_new_tokens=2, seed=1)
            runs = {}
            for tp in (1, 2, 8):
                gen = local_engine(path, "bio+tbik", tp, emulated=tp > 1).generate(prompt, ["a"], dec, 1)[0]
                runs[tp] = (gen.token_ids, gen.token_logprobs, gen.route_experts, gen.route_gates)
    finally:
        grouped_mm.usable = usable
    check(bool(asked), "grouped MoE layout: the prefill never took the grouped layout")
    check(runs[2] == runs[1] and runs[8] == runs[1], "grouped MoE layout: emulated TP 2 and 8 == TP 1")


def grouped_layer_fp32_partials() -> None:
    """The MoE layer in the grouped layout (the GPU prefill path, under the interpreter) on bf16 weights,
    its ranks' partials combined in fp32 (`test_props_moe._layer`): TP 1 and emulated TP 2 and 8 (experts
    24 wide: 3 columns a rank at TP 8) give the same fp32 bits, and so does a token alone; the check
    above compares the engine's bf16 outputs, where the residual add rounds the partials."""
    from pathlib import Path

    sys.path[:0] = [str(Path(__file__).parents[1])]
    from detaudit.backends import experts
    from unit.test_props_moe import _layer, _run

    saved = grouped_mm.usable, experts.DENSE_TOKENS
    asked = []
    grouped_mm.usable = lambda x: asked.append(x.shape[0]) or True  # the GPU layout on CPU tensors
    experts.DENSE_TOKENS = 0
    try:
        h = _spread(19, 16, seed=3, dtype=torch.bfloat16)
        layers = {c: _layer("bio+tbik", c, 4, 2, 16, 24, True, torch.bfloat16, 7) for c in (1, 2, 8)}
        ref = _run(layers[1], h, decode=False)[0]
        check(ref.dtype == torch.float32 and bool(asked), "grouped MoE layer: fp32 partials of the grouped layout")
        for c in (2, 8):
            check(torch.equal(_run(layers[c], h, decode=False)[0], ref), f"grouped MoE layer fp32: TP {c} == TP 1")
        check(torch.equal(_run(layers[1], h[5:6], decode=False)[0], ref[5:6]), "grouped MoE layer fp32: token alone")
    finally:
        grouped_mm.usable, experts.DENSE_TOKENS = saved


def swapped_products(g: torch.Generator) -> None:
    """The decode kernel with the operands' roles swapped (`triton_swap`, the SWAP=1 tilings; tests/gpu checks
    its bits against every other tiling at real shapes): accurate with uneven rows, columns and K, and its
    tree is its own leaves' products added along the tree (the interpreter's tl.dot is numpy's: bits are
    compared only between identical tile products)."""
    from detaudit.errors import DetauditError

    swap = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, num_warps=1, num_stages=1, SWAP=1)
    for dt in (torch.float32, torch.bfloat16):
        # rows past one row tile, N and K not tile multiples, leaves of 12 columns (uneven BLOCK_K steps)
        for m, k, n in ((5, 128, 40), (20, 40, 16), (6, 96, 24)):
            x = torch.randn(m, k, generator=g).to(dt)
            w = torch.randn(n, k, generator=g).to(dt)
            ref = x.double() @ w.double().t()
            got = triton_mm.mm(x, w, config=swap)
            check(
                ((got.double() - ref).abs().max() < 1e-4 * ref.abs().max()).item(), f"swapped accuracy {dt} {m}x{k}x{n}"
            )
            wt = w.t().contiguous().t()  # a transposed view: strided loads
            check(torch.equal(triton_mm.mm(x, wt, config=swap), got), f"swapped, transposed weight {dt}")
            if k % 8 == 0:
                tree8 = triton_mm.mm(x, w, leaves=8, config=swap)
                leaf = k // 8
                parts = [
                    triton_mm.mm(
                        x[:, j * leaf : (j + 1) * leaf].contiguous(), w[:, j * leaf : (j + 1) * leaf], config=swap
                    )
                    for j in range(8)
                ]
                check(torch.equal(tree.tree_sum(parts), tree8), f"swapped tree = its leaves along the tree {dt}")
    try:
        triton_mm.mm(torch.randn(2, 3, 16), torch.randn(2, 8, 16), config=swap)
        check(False, "a swapped config refuses a batch of products")
    except DetauditError:
        pass


def gluon_fallback() -> None:
    """Where the Gluon tree kernel fails to build (its API is experimental), mm warns once and runs the
    Triton tree kernel: the same bits. (The Gluon kernel itself cannot run here: no Hopper GPU; its
    eligibility and build failure are simulated.)"""
    import warnings

    from detaudit.backends.kernels import gluon_tree

    def broken(*args, **kwargs):
        raise RuntimeError("simulated build failure")

    g = torch.Generator().manual_seed(5)
    x = torch.randn(24, 64, generator=g).bfloat16()
    w = torch.randn(20, 64, generator=g).bfloat16()
    want = triton_mm.mm(x, w, leaves=8)
    saved = gluon_tree.supports, gluon_tree.tree_mm
    gluon_tree.supports, gluon_tree.tree_mm = (lambda *a, **k: True), broken
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = triton_mm.mm(x, w, leaves=8, config=dict(triton_mm.INTERPRET_CONFIG, GLUON=1))
            again = triton_mm.mm(x, w, leaves=8, config=dict(triton_mm.INTERPRET_CONFIG, GLUON=1))
    finally:
        gluon_tree.supports, gluon_tree.tree_mm = saved
    check(torch.equal(got, want) and torch.equal(again, want), "Gluon fallback gives the Triton bits")
    check(
        len([c for c in caught if "Gluon tree kernel did not build" in str(c.message)]) == 1,
        "one warning for a failed Gluon build",
    )
    check(bool(gluon_tree._disabled) and not gluon_tree.available(x), "a failed build turns the kernel off")


if __name__ == "__main__":
    main(*sys.argv[1:])
