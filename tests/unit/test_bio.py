"""`bio` kernels: bitwise batch invariance on CPU (torch.equal, never a tolerance), and correctness
against fp64 / PyTorch references with tolerances that fit the precision. The product tests run on
each CPU path this machine has (`cpu_path`: fp32 products, and bf16 products with fp32 accumulation
where the CPU has AVX-512 BF16)."""

from __future__ import annotations

import pytest
import torch

from detaudit.backends import get_backend
from detaudit.backends.kernels import fixed

# (K, N) of the embedded model (hidden 576, 24/8 heads of 64, MLP 1536, vocab 49152) and odd ones
MODEL_SHAPES = [(576, 1536), (576, 512), (1536, 576), (576, 49152)]
ODD_SHAPES = [(64, 64), (100, 37), (7, 300)]


def _rand(*shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


# every M up to 40 (every row count of the last block, for R = 8 and 16, several times), then the block
# boundaries around larger M
PREFIXES = list(range(1, 41)) + [47, 48, 49, 63, 64, 65, 127, 128, 129, 200, 255, 256]
# (path, dtype): fp32 operands take the fp32 path whatever the machine chose
PATHS_DTYPES = [("fp32", torch.bfloat16), ("bf16", torch.bfloat16), ("fp32", torch.float32)]


@pytest.mark.parametrize("cpu_path,dtype", PATHS_DTYPES, indirect=["cpu_path"])
@pytest.mark.parametrize("k,n", MODEL_SHAPES[:3] + ODD_SHAPES)
def test_matmul_prefix_invariant(k, n, dtype, cpu_path):
    a, w = _rand(256, k, dtype=dtype), _rand(n, k, dtype=dtype, seed=1)
    full = fixed.matmul(a, w)
    for m in PREFIXES:
        assert torch.equal(fixed.matmul(a[:m], w), full[:m]), m


@pytest.mark.parametrize("cpu_path,dtype", PATHS_DTYPES, indirect=["cpu_path"])
def test_matmul_lm_head_shape_and_row_position(dtype, cpu_path):
    k, n = MODEL_SHAPES[-1]
    a, w = _rand(40, k, dtype=dtype), _rand(n, k, dtype=dtype, seed=1)
    full = fixed.matmul(a, w)
    for m in (1, 8, 17, 32):
        assert torch.equal(fixed.matmul(a[:m], w), full[:m])
    assert torch.equal(fixed.matmul(a[29:30], w), full[29:30])  # a row's bits do not depend on its slot


@pytest.mark.parametrize("k,n", [(576, 1536), (1536, 64), (49152, 8), (576, 49152)])
def test_matmul_thread_count_invariant(k, n, cpu_path):
    """The caller's thread count only changes how blocks / panels are spread over threads, never a
    block's bits. (49152, 8) is the log-softmax row sum and (1536, 64) a skinny product: multi-threaded
    MKL splits their K across threads on AVX-512, which once broke invariance on such a CPU.)"""
    a, w = _rand(50, k, dtype=torch.bfloat16), _rand(n, k, dtype=torch.bfloat16, seed=1)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = fixed.matmul(a, w)
        one_row = fixed.matmul(a[:1], w)
        for threads in (2, 3, 4):
            torch.set_num_threads(threads)
            assert torch.equal(one, fixed.matmul(a, w)), threads
            assert torch.equal(one_row, fixed.matmul(a[:1], w)), threads  # one block: spread by panels
    finally:
        torch.set_num_threads(before)


def test_matmul_column_shard_invariant(cpu_path):
    """A column-parallel shard (N/C columns) computes the same bits as those columns of the full product."""
    a, w = _rand(33, 576, dtype=torch.bfloat16), _rand(1536, 576, dtype=torch.bfloat16, seed=1)
    full = fixed.matmul(a, w)
    for c in (2, 4, 8):
        n = 1536 // c
        for r in range(c):
            assert torch.equal(fixed.matmul(a, w[r * n : (r + 1) * n]), full[:, r * n : (r + 1) * n])


def test_matmul_between_the_librarys_own_bf16_gemms(cpu_path):
    """PyTorch's bf16 GEMM (oneDNN: the bf16 backend's F.linear, in the same process in `bench engine`)
    runs on the same threads as these products, before and after them. On AMX the tiles are per-thread
    state that its kernels configure and release: products made in between keep their bits (each of our
    threads releases the tiles after its calls, so its next call configures them again)."""
    from detaudit.backends.kernels import cpu_gemm

    a, w = _rand(200, 576, dtype=torch.bfloat16), _rand(1536, 576, dtype=torch.bfloat16, seed=1)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            want = fixed.matmul(a, w)
            for rows in (200, 8):
                # the library's GEMM on this thread and on a worker of ours, then ours on both
                cpu_gemm.run_jobs([0, 1], lambda _: torch.nn.functional.linear(a[:rows], w))
                assert torch.equal(fixed.matmul(a[:rows], w), want[:rows]), (threads, rows)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("cpu_path,dtype", PATHS_DTYPES, indirect=["cpu_path"])
@pytest.mark.parametrize("k", [2, 5, 24, 64])
def test_matmul_narrow_products_keep_their_bits(k, dtype, cpu_path):
    """A product of few columns (a column shard I / C wide, one column) has the fp32 bits of those columns
    of a wider product, at every row count: PyTorch's CPU bmm computes a product of fewer than 400
    multiply-adds by its own loop and a one-column product by a matrix-vector kernel whose order depends
    on the rows, both with other bits than the GEMM (`cpu_gemm.min_columns`)."""
    a, w = _rand(33, k, dtype=dtype), _rand(16, k, dtype=dtype, seed=1)
    full = fixed.matmul(a, w)
    for n in (1, 2, 3, 5):
        for c0 in range(0, 16 - n + 1, n):
            assert torch.equal(fixed.matmul(a, w[c0 : c0 + n]), full[:, c0 : c0 + n]), (n, c0)
    for m in (1, 5, 17, 32):
        assert torch.equal(fixed.matmul(a[:m], w[:1]), full[:m, :1]), m
        assert torch.equal(fixed.matmul(a[m : m + 1], w[:1]), full[m : m + 1, :1]), m


@pytest.mark.parametrize("cpu_path,dtype", PATHS_DTYPES, indirect=["cpu_path"])
def test_matmul_accuracy_vs_fp64(dtype, cpu_path):
    a, w = _rand(64, 576, dtype=dtype), _rand(1536, 576, dtype=dtype, seed=1)
    ref = a.double() @ w.double().t()
    ours = fixed.matmul(a, w).double()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()  # fp32 accumulation of exact products


def _bitwise(got, want, what):
    diff = (got.float() - want.float()).abs().max().item() if got.shape == want.shape else float("nan")
    assert torch.equal(got, want), f"{what}: max |diff| {diff:.3g}, torch threads {torch.get_num_threads()}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: the norm's fp32 bits themselves
@pytest.mark.parametrize("threads", [1, 2])
def test_row_ops_invariant_and_correct(threads, dtype, cpu_kernels):
    """Pinned thread counts (the rare failure this once had depended on the thread state)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        b = get_backend("bio")
        x = _rand(40, 576, dtype=dtype)
        wt = _rand(576, dtype=dtype, seed=2)
        full = b.rms_norm(x, wt, 1e-5)
        assert full.dtype == dtype
        for m in (1, 3, 16, 39):
            _bitwise(b.rms_norm(x[:m], wt, 1e-5), full[:m], f"rms_norm m={m}")
        xd = x.double()
        ref = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype).double() * wt.double()
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        assert torch.allclose(full.double(), ref, atol=tol, rtol=tol)
        logits = _rand(20, 49152, dtype=torch.float32) * 5
        lp = b.log_softmax(logits)
        for m in (1, 7, 19):
            _bitwise(b.log_softmax(logits[:m]), lp[:m], f"log_softmax m={m}")
        assert torch.allclose(lp, torch.log_softmax(logits.double(), -1).float(), rtol=1e-5, atol=1e-4)
    finally:
        torch.set_num_threads(before)


def test_silu_mul_rounds_as_torch_does(cpu_kernels):
    """In bf16, silu(gate) is rounded to bf16, then multiplied by up and rounded again, as torch's
    `silu(g).to(bf16) * up` rounds (to nearest even): on each CPU path its bf16 result is its own fp32
    silu put through those two torch roundings, bit for bit."""
    b = get_backend("bio")
    g = torch.Generator().manual_seed(5)
    gate = (torch.randn(7, 300, generator=g) * 6).bfloat16()
    up = (torch.randn(7, 300, generator=g) * 3).bfloat16()
    wide = b.silu_mul(gate.float(), torch.ones(7, 300))  # the path's fp32 silu of the same gate
    want = (wide.bfloat16().float() * up.float()).bfloat16()
    _bitwise(b.silu_mul(gate, up).view(torch.int16), want.view(torch.int16), "bf16 silu * up")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_kernels_spread_over_threads_keep_each_rows_bits(dtype, spread_on):
    """A prefill's rows are spread over threads (`cpu_calls.rows`: the team's RMS / SILU jobs, or the
    Python pool's slices where the team is off): every row of RMSNorm and silu * up, the gate and up
    strided slices of a merged product as in the MLP, gets the bits it has computed alone."""
    from detaudit.backends.kernels import cpu_calls

    team = spread_on(4)
    b = get_backend("bio")
    tall = _rand(600, 576, dtype=dtype, seed=3)  # 345,600 elements: past `ROWS_SPLIT`
    wt = _rand(576, dtype=dtype, seed=2)
    assert cpu_calls.row_threads("rms", 600, tall.numel()) > 1
    jobs = team.job if team else 0
    norm = b.rms_norm(tall, wt, 1e-5)
    merged = _rand(600, 2 * 288, dtype=dtype, seed=4) * 4
    act = b.silu_mul(merged[:, :288], merged[:, 288:])
    if team:  # both went to the team's workers, not the pool
        assert team.job == jobs + 2, (team.job, jobs)
    # operands the team does not take (up broadcast over the rows: stride 0) go to the pool, same bits
    up_row = merged[:1, 288:].expand(600, 288)
    _bitwise(b.silu_mul(merged[:, :288], up_row), b.silu_mul(merged[:, :288], up_row.contiguous()), "broadcast up")
    for i in (0, 149, 150, 299, 300, 449, 450, 599):  # the first and last rows of each thread's slice
        _bitwise(b.rms_norm(tall[i : i + 1], wt, 1e-5), norm[i : i + 1], f"rms_norm row {i} of 600")
        alone = b.silu_mul(merged[i : i + 1, :288], merged[i : i + 1, 288:])
        _bitwise(alone, act[i : i + 1], f"silu_mul row {i} of 600")


@pytest.mark.parametrize("dispatch", ["team", "pool"])
def test_a_zero_row_with_eps_zero_is_nan_not_an_error(dispatch, cpu_kernels, monkeypatch):
    """RMSNorm of a zero row with eps 0 divides by zero: NaN, as torch's ops give, on every path, on the
    Python pool's threads and on the compiled team's workers (an exception there would leave the
    dispatcher waiting)."""
    from detaudit.backends.kernels import cpu_calls

    monkeypatch.setenv(cpu_calls.TEAM_ENV, "auto" if dispatch == "team" else "off")
    b = get_backend("bio")
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        x = _rand(600, 576, dtype=torch.float32, seed=6)
        x[0] = 0
        x[599] = 0  # slot 0's rows and the last worker's
        y = b.rms_norm(x, torch.ones(576), 0.0)
        assert torch.isnan(y[0]).all() and torch.isnan(y[599]).all() and not torch.isnan(y[1:599]).any()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("backend", ["bio", "bio+tbik"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_bits_do_not_depend_on_the_shard_width(backend, dtype, cpu_kernels):
    """A rank's gate is a strided column slice of its merged gate / up product, as wide as I / C: each
    element's fp32 bits must not depend on that width, the slice's stride or the element's place (with
    F.silu, shards narrower than 32 columns took a scalar path with other bits: TP 4 of a 64-wide MLP
    differed from TP 1 at fp32)."""
    b = get_backend(backend)
    inter, rows = 64, 37
    gate_up = _rand(rows, 2 * inter, dtype=dtype) * 4
    full = b.silu_mul(gate_up[:, :inter], gate_up[:, inter:])  # TP 1's merged product
    for tp in (2, 4, 8):
        w = inter // tp
        for r in range(tp):  # rank r's own merged product [rows, 2w]: gate then up columns
            merged = torch.cat([gate_up[:, r * w : (r + 1) * w], gate_up[:, inter + r * w : inter + (r + 1) * w]], 1)
            _bitwise(b.silu_mul(merged[:, :w], merged[:, w:]), full[:, r * w : (r + 1) * w], f"tp {tp} rank {r}")
    for m in (1, 5, 36):  # a row alone or among others
        _bitwise(b.silu_mul(gate_up[:m, :inter], gate_up[:m, inter:]), full[:m], f"rows {m}")
    ref = torch.nn.functional.silu(gate_up[:, :inter].double()) * gate_up[:, inter:].double()
    assert torch.allclose(full.double(), ref, rtol=1e-2 if dtype == torch.bfloat16 else 1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_at_the_extremes(dtype, cpu_kernels):
    """silu(gate) * up where exp(-|gate|) underflows through the subnormals to 0, at +-inf and NaN, on each
    CPU path: the IEEE limits (silu(+inf) = inf, silu(-inf) = -0, NaN stays NaN), the rest close to
    fp64, and the compiled kernel's vector lanes and scalar tail alike (each value alone and in a row)."""
    b = get_backend("bio")
    vals = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-30, -1e-30, 3.0, -3.0, 20.0, -20.0]
    vals += [86.0, -86.0, 87.5, -87.5, 89.0, -89.0, 100.0, -100.0, 1e30, -1e30, 1e38, -1e38]
    gate = torch.tensor(vals, dtype=torch.float32).to(dtype)
    up = torch.full_like(gate, 1.5)
    out = b.silu_mul(gate[None], up[None])[0].float()
    assert torch.isnan(out[0]) and out[1] == float("inf"), out[:3]
    if cpu_kernels == "compiled":  # g * exp(-|g|): -0 at -inf; torch's g / (1 + exp(-g)) is -inf / inf, NaN
        assert out[2] == 0 and torch.signbit(out[2]), out[2]
    else:
        assert torch.isnan(out[2]), out[2]
    g64 = gate.double()
    ref = (g64 * torch.sigmoid(g64) * 1.5)[3:]
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert torch.allclose(out[3:].double(), ref, rtol=tol, atol=1e-30), torch.stack([out[3:].double(), ref])
    as_bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    row = b.silu_mul(gate.repeat(3)[None], up.repeat(3)[None])[0].view(as_bits)  # 69 values: lanes and a tail
    for i in range(len(vals)):  # each value alone: the scalar remainder of a one-element row
        alone = b.silu_mul(gate[i : i + 1][None], up[i : i + 1][None])[0].view(as_bits)
        for j in (i, i + len(vals), i + 2 * len(vals)):
            if torch.isnan(alone.view(dtype)).all():  # NaN (and the ops' silu(-inf)): their payload differs
                assert torch.isnan(row[j : j + 1].view(dtype)).all(), f"value {vals[i]} at {j}"
            else:
                _bitwise(alone, row[j : j + 1], f"value {vals[i]} at {j}")


def _attn_inputs(bsz=3, hq=6, hkv=2, t=70, d=16, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, hq, t, d, generator=g).to(dtype)
    k = torch.randn(bsz, hkv, t, d, generator=g).to(dtype)
    v = torch.randn(bsz, hkv, t, d, generator=g).to(dtype)
    pos = torch.arange(t).expand(bsz, t)
    return q, k, v, pos


# the model's dtype: q / k / v and the output in it; fp32 shows the attention's own fp32 bits
ATTN_DTYPES = pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])


def test_attention_matches_sdpa(cpu_kernels):
    q, k, v, pos = _attn_inputs()
    b = get_backend("bio")
    ours = b.attention(q.float(), k.float(), v.float(), pos, 0.25)
    ref = get_backend("bf16").attention(q.float(), k.float(), v.float(), pos, 0.25)
    assert torch.allclose(ours, ref, atol=1e-5)


@ATTN_DTYPES
def test_attention_prefill_equals_decode(cpu_kernels, dtype):
    """A token's attention output is the same bits computed with all queries at once (prefill) or
    one query at a time over the cache (decode), including across the KV split boundary (70 > 64)."""
    q, k, v, pos = _attn_inputs(dtype=dtype)
    b = get_backend("bio")
    prefill = b.attention(q, k, v, pos, 0.25)
    for t in (0, 1, 63, 64, 65, 69):
        step = b.attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], pos[:, t : t + 1], 0.25)
        assert torch.equal(step, prefill[:, :, t : t + 1]), t


@ATTN_DTYPES
def test_attention_batch_and_cache_length_invariant(cpu_kernels, dtype):
    """A row's output does not depend on its neighbours or on how long the batch's cache is
    (chunks it cannot see are exact no-ops)."""
    q, k, v, pos = _attn_inputs(bsz=4, dtype=dtype)
    b = get_backend("bio")
    short = pos.clone()
    short[0] = torch.arange(70).clamp(max=20)  # row 0 only sees 21 keys; the cache holds 70
    full = b.attention(q, k, v, short, 0.25)
    alone = b.attention(q[:1, :, :21], k[:1, :, :21], v[:1, :, :21], short[:1, :21], 0.25)
    assert torch.equal(full[:1, :, :21], alone)
    assert torch.equal(b.attention(q[2:3], k[2:3], v[2:3], pos[2:3], 0.25), full[2:3])


@ATTN_DTYPES
def test_attention_sliding_window_prefill_equals_decode(cpu_kernels, dtype):
    """With a window of 24 keys, a row sees only keys pos - 24 < j <= pos, in prefill and in decode."""
    q, k, v, pos = _attn_inputs(dtype=dtype)
    b = get_backend("bio")
    prefill = b.attention(q, k, v, pos, 0.25, window=24)
    ref = get_backend("bf16").attention(q.float(), k.float(), v.float(), pos, 0.25, window=24)
    assert torch.allclose(prefill.float(), ref, atol=2e-2)
    for t in (0, 23, 24, 25, 69):
        step = b.attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], pos[:, t : t + 1], 0.25, window=24)
        assert torch.equal(step, prefill[:, :, t : t + 1]), t


def test_compiled_kernels_are_named_in_the_description(cpu_kernels):
    d = get_backend("bio").describe()
    assert d["cpu_kernels"].startswith("compiled" if cpu_kernels == "compiled" else "PyTorch ops")


def test_describe_names_configs():
    d = get_backend("bio").describe()
    assert "matmul_cpu" in d and "R=16" in d["matmul_cpu"] and "torch" in d


@pytest.mark.parametrize("cpu_path,dtype", PATHS_DTYPES, indirect=["cpu_path"])
@pytest.mark.parametrize("backend", ["bio", "bio+tbik"])
def test_expert_products_same_bits_in_both_layouts(backend, dtype, cpu_path):
    """An expert's product of its routed rows (the chosen-rows layout: x[R, K], one expert) has the fp32
    bits of those rows in the product of every expert at once (the every-expert layout: x[E, T, K]); which
    layout a prefill takes depends on how many tokens share its step. (On the bf16 path the 2-D product
    once went to the bf16 micro-kernel and the 3-D one to the fp32 products: other sums.)"""
    b = get_backend(backend)
    e, t, k, n = 3, 21, 64, 10
    x = _rand(t, k, dtype=dtype)
    w = _rand(e, n, k, dtype=dtype, seed=1)
    every = b.expert_matmul(x.unsqueeze(0).expand(e, t, k), w)
    assert every.dtype == torch.float32
    rows = torch.tensor([0, 3, 4, 11, 20])
    for j in range(e):
        _bitwise(b.expert_matmul(x[rows], w[j]), every[j, rows], f"expert {j}")
        _bitwise(b.expert_linear(x[rows], w[j]), every[j, rows].to(dtype), f"expert {j} in the model dtype")


def test_every_parallel_job_runs_with_one_intra_op_thread(monkeypatch):
    """torch's intra-op thread count is process-wide: `run_jobs` must hold one thread until its last job
    has run, or a pool worker starting after the caller's own job would compute with the caller's count
    restored (other bits at K >= 1536). The worker job here waits until the count is restored, or until
    run_jobs has plainly held it past its own job."""
    import threading

    from detaudit.backends.kernels import cpu_gemm

    restored = threading.Event()
    real = cpu_gemm._set_num_threads

    def watched(n):
        real(n)
        if n > 1:
            restored.set()

    monkeypatch.setattr(cpu_gemm, "_set_num_threads", watched)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        seen = {}

        def run(job):
            if job:
                restored.wait(timeout=1.0)
            seen[job] = torch.get_num_threads()

        cpu_gemm.run_jobs([0, 1], run)
    finally:
        torch.set_num_threads(before)
    assert seen == {0: 1, 1: 1}


def test_compiled_cpu_calls_are_named_in_a_cpu_profile(cpu_kernels):
    """bench e2e --profile on CPU: the micro-kernel calls, the compiled attention and RMSNorm are no aten
    ops, so each runs inside a named range while a profiler records (else their time is nobody's)."""
    from torch.profiler import ProfilerActivity, profile

    b = get_backend("bio")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 128, generator=g).to(torch.bfloat16)
    w = torch.randn(192, 128, generator=g).to(torch.bfloat16)
    q, k, v, pos = _attn_inputs()
    with profile(activities=[ProfilerActivity.CPU]) as prof, b.activate():
        b.linear(x, w)
        b.rms_norm(x, w[0], 1e-6)
        b.attention(q, k, v, pos, 0.25)
    names = {e.key for e in prof.key_averages()}
    products = {"detaudit::bf16_block_products", "detaudit::fp32_block_products"}
    assert products & names, sorted(names)
    compiled = {"detaudit::cpu_attention", "detaudit::cpu_rms_rows"}
    assert compiled <= names if cpu_kernels == "compiled" else not compiled & names, sorted(names)
