"""Property tests (hypothesis) of bio's row-local ops, asserted on fp32 bits (`torch.equal`), on both CPU
kernel modes (`cpu_kernels`: the numba-compiled kernels and the PyTorch ops). Their products have fp32
operands whatever the model dtype, so the CPU product path (`cpu_path`) does not enter them.

- attention (full and sliding window): a query row's output has the same bits computed in prefill (all
  rows at once), in decode (its row alone, over a cache as long as its position or longer, as a batch's
  longest request makes it), in a chunk of a chunked prefill, with its request alone, and with only its
  KV heads (a TP rank's); accurate against fp64;
- RMSNorm: a row's bits do not depend on the rows beside it or on the input's strides; Qwen3's per-head
  q / k norms, read from a merged q / k / v product, give every head the bits it has alone or among any
  number of heads (a TP rank's);
- log-softmax over odd vocabularies, and silu(gate) * up on shards of any width: rows and columns alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detaudit.backends import get_backend

from .props_common import DTYPES, PROPS, ROWS, SEEDS, bits, spread


def _attention_ref(q, k, v, pos, scale, window):
    """fp64 softmax attention of q[B, Hq, T, D] over k / v [B, Hkv, L, D]."""
    groups = q.shape[1] // k.shape[1]
    kd, vd = (t.double().repeat_interleave(groups, 1) for t in (k, v))
    s = (q.double() @ kd.transpose(-1, -2)) * scale
    keys = torch.arange(k.shape[2]).view(1, 1, 1, -1)
    p = pos[:, None, :, None]
    hidden = (keys > p) if window is None else (keys > p) | (keys <= p - window)
    return torch.softmax(s.masked_fill(hidden, float("-inf")), -1) @ vd


@settings(PROPS, max_examples=10)
@given(
    bsz=st.integers(1, 3),
    hkv=st.integers(1, 3),
    groups=st.integers(1, 3),
    d=st.sampled_from([1, 8, 16, 17, 64]),
    length=st.integers(1, 150),  # across the 64-key chunks of the PyTorch path
    window=st.one_of(st.none(), st.integers(1, 90)),
    dtype=DTYPES,
    seed=SEEDS,
    data=st.data(),
)
def test_attention_prefill_decode_chunks_batch_and_heads(
    bsz, hkv, groups, d, length, window, dtype, seed, data, cpu_kernels
):
    b = get_backend("bio")
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(bsz, hkv * groups, length, d, generator=g).to(dtype)
    k = torch.randn(bsz, hkv, length, d, generator=g).to(dtype)
    v = spread(bsz, hkv, length, d, seed=seed + 1, dtype=dtype)
    pos = torch.arange(length).expand(bsz, length)
    scale = d**-0.5
    pre = b.attention(q, k, v, pos, scale, window)
    assert pre.dtype == dtype
    t = data.draw(st.integers(0, length - 1), "decode position")
    end = data.draw(st.integers(t + 1, length), "cache length in decode")
    step = b.attention(q[:, :, t : t + 1], k[:, :, :end], v[:, :, :end], pos[:, t : t + 1], scale, window)
    bits(step, pre[:, :, t : t + 1], f"decode at {t} over {end} keys")
    t0 = data.draw(st.integers(0, length - 1), "chunk start")
    t1 = data.draw(st.integers(t0 + 1, length), "chunk end")
    chunk = b.attention(q[:, :, t0:t1], k[:, :, :t1], v[:, :, :t1], pos[:, t0:t1], scale, window)
    bits(chunk, pre[:, :, t0:t1], f"chunked prefill rows {t0}:{t1}")
    i = data.draw(st.integers(0, bsz - 1), "request")
    bits(b.attention(q[i : i + 1], k[i : i + 1], v[i : i + 1], pos[i : i + 1], scale, window), pre[i : i + 1], "alone")
    h0 = data.draw(st.integers(0, hkv - 1), "first KV head")
    h1 = data.draw(st.integers(h0 + 1, hkv), "end KV head")
    qh = slice(h0 * groups, h1 * groups)
    got = b.attention(q[:, qh], k[:, h0:h1], v[:, h0:h1], pos, scale, window)
    bits(got, pre[:, qh], f"KV heads {h0}:{h1}")
    ref = _attention_ref(q, k, v, pos, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((pre.double() - ref).abs() <= tol * v.double().abs().amax()).all()


@settings(PROPS, max_examples=12)
@given(m=ROWS, k=st.one_of(st.integers(1, 40), st.integers(41, 3000)), dtype=DTYPES, seed=SEEDS, data=st.data())
def test_rms_norm_rows_alone_and_strided(m, k, dtype, seed, data, cpu_kernels):
    b = get_backend("bio")
    wide = spread(m, k + 7, seed=seed, dtype=dtype)
    x = wide[:, 3 : 3 + k]  # a column slice: strided rows, as a slice of a merged product
    wt = spread(k, seed=seed + 1, dtype=dtype)
    full = b.rms_norm(x.contiguous(), wt, 1e-6)
    assert full.dtype == dtype
    bits(b.rms_norm(x, wt, 1e-6), full, "strided input")
    j = data.draw(st.integers(1, m), "prefix rows")
    bits(b.rms_norm(x[:j], wt, 1e-6), full[:j], f"the first {j} rows")
    i = data.draw(st.integers(0, m - 1), "a row alone")
    bits(b.rms_norm(x[i : i + 1], wt, 1e-6), full[i : i + 1], f"row {i} alone")
    xd = x.double()
    ref = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6)
    ref = (ref.to(dtype) if dtype != torch.float32 else ref).double() * wt.double()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert ((full.double() - ref).abs() <= tol * ref.abs().amax().clamp(min=1e-30) + 1e-30).all()


@PROPS
@given(
    bsz=st.integers(1, 3),
    t=st.integers(1, 9),
    hkv=st.integers(1, 4),
    groups=st.integers(1, 3),
    d=st.sampled_from([8, 16, 17, 64, 128]),
    dtype=DTYPES,
    seed=SEEDS,
    data=st.data(),
)
def test_qk_norms_per_head_any_head_count(bsz, t, hkv, groups, d, dtype, seed, data, cpu_kernels):
    """q / k as the engine reads them: column slices of one merged q / k / v product [B*T, (Hq + 2 Hkv) D],
    viewed [B, T, H, D]; every head's norm has the bits it has in a TP rank's own product (its heads
    only) and for its token alone."""
    b = get_backend("bio")
    hq = hkv * groups
    qkv = spread(bsz * t, (hq + 2 * hkv) * d, seed=seed, dtype=dtype)
    qw, kw = spread(d, seed=seed + 1, dtype=dtype), spread(d, seed=seed + 2, dtype=dtype)
    q = qkv[:, : hq * d].reshape(bsz, t, hq, d)
    k = qkv[:, hq * d : (hq + hkv) * d].reshape(bsz, t, hkv, d)
    qn, kn = b.rms_norm(q, qw, 1e-6), b.rms_norm(k, kw, 1e-6)
    h0 = data.draw(st.integers(0, hkv - 1), "first KV head")
    h1 = data.draw(st.integers(h0 + 1, hkv), "end KV head")
    bits(b.rms_norm(k[:, :, h0:h1].contiguous(), kw, 1e-6), kn[:, :, h0:h1], f"k heads {h0}:{h1}")
    qh = slice(h0 * groups, h1 * groups)
    bits(b.rms_norm(q[:, :, qh].contiguous(), qw, 1e-6), qn[:, :, qh], f"q heads {qh}")
    i, j = data.draw(st.integers(0, bsz - 1), "request"), data.draw(st.integers(0, t - 1), "token")
    bits(b.rms_norm(q[i : i + 1, j : j + 1], qw, 1e-6), qn[i : i + 1, j : j + 1], "one token's q heads")


@settings(PROPS, max_examples=10)
@given(m=ROWS, v=st.one_of(st.integers(1, 64), st.integers(65, 5000)), seed=SEEDS, data=st.data())
def test_log_softmax_rows_alone(m, v, seed, data, cpu_kernels):
    b = get_backend("bio")
    logits = torch.randn(m, v, generator=torch.Generator().manual_seed(seed)) * 8
    full = b.log_softmax(logits)
    assert full.dtype == torch.float32
    j = data.draw(st.integers(1, m), "prefix rows")
    bits(b.log_softmax(logits[:j]), full[:j], f"the first {j} rows")
    i = data.draw(st.integers(0, m - 1), "a row alone")
    bits(b.log_softmax(logits[i : i + 1]), full[i : i + 1], f"row {i} alone")
    assert torch.allclose(full.double(), torch.log_softmax(logits.double(), -1), rtol=0, atol=1e-5 + v * 2e-7)


@PROPS
@given(
    name=st.sampled_from(["bio", "bio+tbik"]),
    m=ROWS,
    w=st.integers(1, 100),
    dtype=DTYPES,
    seed=SEEDS,
    data=st.data(),
)
def test_silu_mul_on_shards_of_any_width(name, m, w, dtype, seed, data):
    """A rank's gate / up are the halves of its merged product [m, 2w] (strided column slices): each
    element has the bits of TP 1's wider product (4 ranks here), in any row set."""
    b = get_backend(name)
    c = 4
    gate, up = spread(m, c * w, seed=seed, dtype=dtype), spread(m, c * w, seed=seed + 1, dtype=dtype)
    full = b.silu_mul(gate, up)
    assert full.dtype == dtype
    r = data.draw(st.integers(0, c - 1), "rank")
    cols = slice(r * w, (r + 1) * w)
    merged = torch.cat([gate[:, cols], up[:, cols]], 1)
    bits(b.silu_mul(merged[:, :w], merged[:, w:]), full[:, cols], f"rank {r} of {c}, width {w}")
    i = data.draw(st.integers(0, m - 1), "a row alone")
    bits(b.silu_mul(gate[i : i + 1, cols], up[i : i + 1, cols]), full[i : i + 1, cols], "a row of a shard alone")
    ref = torch.nn.functional.silu(gate.double()) * up.double()
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    assert ((full.double() - ref).abs() <= tol * ref.abs() + 1e-30).all()


class _Step:
    """What `rope_store` reads of a forward step (`model.StepPlan`): sizes, rotary cos / sin, positions and
    the cache rows of (b, t, h)."""

    def __init__(self, pos: torch.Tensor, head_dim: int, n_kv: int, length: int, dtype: torch.dtype) -> None:
        from detaudit.builtin.layers import Rotary

        self.B, self.T = pos.shape
        self.head_dim, self.pos = head_dim, pos
        self.cos, self.sin = Rotary(head_dim, 10000.0, torch.device("cpu")).cos_sin(pos, dtype)
        heads = torch.arange(n_kv) * length
        self.slots = (torch.arange(self.B)[:, None, None] * (n_kv * length) + pos[:, :, None] + heads).reshape(-1)


@PROPS
@given(
    bsz=st.integers(1, 4),
    t=st.integers(1, 9),
    hkv=st.integers(1, 3),
    groups=st.integers(1, 3),
    d=st.sampled_from([8, 40, 64, 128]),
    dtype=DTYPES,
    seed=SEEDS,
    data=st.data(),
)
def test_compiled_rope_store_gives_the_torch_ops_bits(bsz, t, hkv, groups, d, dtype, seed, data):
    """bio's CPU rope_store (one compiled call for a step of up to 64 tokens, `fixed.rope_store`) against
    the PyTorch ops it replaces (`TorchOps.rope_store`): the rotated q and the cache, bitwise, with q / k / v
    read as the columns of one merged product and positions anywhere in a longer cache."""
    from detaudit.backends.kernels import cpu_calls

    if cpu_calls.compiled("cpu_rows") is None:
        return  # (numba not installed: bio's CPU steps are the PyTorch ops themselves)
    length = 48
    pos = (torch.arange(t) + data.draw(st.integers(0, length - t), "first position")).expand(bsz, t).contiguous()
    pos[0] = torch.arange(t) + data.draw(st.integers(0, length - t), "request 0's first position")
    _rope_against_torch(pos, hkv, groups, d, length, dtype, seed)


def _rope_against_torch(pos, hkv, groups, d, length, dtype, seed):
    """`CompiledOps.rope_store` against `TorchOps.rope_store` at positions pos[B, T]: q and both caches."""
    from detaudit.backends.kernels import fixed
    from detaudit.backends.row_ops import CompiledOps, TorchOps

    b = get_backend("bio")
    (bsz, t), hq = pos.shape, hkv * groups
    step = _Step(pos, d, hkv, length, dtype)
    qkv = spread(bsz * t, (hq + 2 * hkv) * d, seed=seed, dtype=dtype) * 3
    q, k, v = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d], qkv[:, (hq + hkv) * d :]
    caches = []
    outs = []
    for ops in (TorchOps(b), CompiledOps(b)):
        cache = tuple(spread(bsz * hkv * length, d, seed=seed + 7, dtype=dtype).view(bsz, hkv, length, d) for _ in "kv")
        outs.append(ops.rope_store(q, k, v, step, cache, None))
        caches.append(cache)
    spare = tuple(torch.zeros(bsz, hkv, length, d, dtype=dtype) for _ in "kv")
    assert fixed.rope_store(q, k, v, step.cos, step.sin, pos, spare, d) is not None  # the compiled call ran
    bits(outs[1], outs[0], "the rotated q")
    bits(caches[1][0], caches[0][0], "the k cache")
    bits(caches[1][1], caches[0][1], "the v cache")


@pytest.mark.parametrize("steps", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_rope_spread_over_threads_gives_the_torch_ops_bits(dtype, steps, spread_on):
    """A batch-32 decode step's rotary (the embedded model's 24 / 8 heads of 64), and a prefill's of 4
    requests of 40 tokens, is spread over threads (`cpu_calls.rope`: the team's ROPE jobs, or the Python
    pool's slices where the team is off): the torch ops' bits in every row, whichever thread made it."""
    from detaudit.backends.kernels import cpu_calls

    team = spread_on(8)
    if steps == "decode":
        pos = torch.randint(0, 47, (32, 1), generator=torch.Generator().manual_seed(5))
    else:
        pos = (torch.arange(40) + torch.tensor([[0], [8], [3], [5]])).contiguous()
    assert cpu_calls.row_threads("rope", pos.numel(), pos.numel() * 32 * 64) > 2
    jobs = team.job if team else 0
    _rope_against_torch(pos, 8, 3, 64, 48, dtype, seed=11)
    if team:  # the compiled calls' two went to the team's workers
        assert team.job == jobs + 2, (team.job, jobs)


@PROPS
@given(
    m=st.integers(1, 9),
    k=st.sampled_from([8, 17, 64, 576]),
    add=st.booleans(),
    dtype=DTYPES,
    seed=SEEDS,
)
def test_compiled_add_norm_gives_the_torch_ops_bits(m, k, add, dtype, seed):
    """bio's CPU add_norm for a step of up to 64 rows (one compiled call, `fixed.add_rms`) against the
    steps it replaces (`TorchOps.add_norm`: the add, bio's RMSNorm rows, the cast, the weight), bitwise:
    the normed rows and the residual sum, with and without a delta."""
    from types import SimpleNamespace

    from detaudit.backends.kernels import cpu_calls, fixed
    from detaudit.backends.row_ops import CompiledOps, TorchOps

    if cpu_calls.compiled("cpu_rows") is None:
        return  # (numba not installed: bio's CPU steps are the PyTorch ops themselves)
    b = get_backend("bio")
    x, delta = spread(m, k, seed=seed, dtype=dtype) * 4, spread(m, k, seed=seed + 1, dtype=dtype) if add else None
    norm = SimpleNamespace(weight=spread(k, seed=seed + 2, dtype=dtype), eps=1e-6)
    assert fixed.add_rms(x, delta, norm.weight, norm.eps) is not None  # the compiled call ran
    want, got = TorchOps(b).add_norm(x, delta, norm), CompiledOps(b).add_norm(x, delta, norm)
    bits(got[0], want[0], "the normed rows")
    bits(got[1], want[1], "the residual sum")


@pytest.mark.parametrize("add", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_add_norm_spread_over_threads_gives_the_torch_ops_bits(dtype, add, spread_on):
    """A prefill's add + RMSNorm (600 rows of 576, a delta whose rows are a longer row's columns) spread
    over 8 threads (the team's ADD_RMS job, or the Python pool's slices): the torch ops' bits in every
    row, whichever thread made it."""
    from types import SimpleNamespace

    from detaudit.backends.kernels import cpu_calls
    from detaudit.backends.row_ops import CompiledOps, TorchOps

    team = spread_on(8)
    m, k = 600, 576
    assert cpu_calls.row_threads("add_rms", m, m * k) == 8
    x = spread(m, k, seed=3, dtype=dtype) * 4
    delta = spread(m, k + 64, seed=4, dtype=dtype)[:, 32 : 32 + k] if add else None
    norm = SimpleNamespace(weight=spread(k, seed=5, dtype=dtype), eps=1e-6)
    b = get_backend("bio")
    jobs = team.job if team else 0
    got = CompiledOps(b).add_norm(x, delta, norm)
    if team:  # the one call went to the team's workers
        assert team.job == jobs + 1, (team.job, jobs)
    want = TorchOps(b).add_norm(x, delta, norm)
    bits(got[0], want[0], "the normed rows")
    bits(got[1], want[1], "the residual sum")


def _attention_heads_against_torch(pos, hkv, groups, d, length, dtype, seed, layout="rotary", window=None):
    """bio's compiled CPU attention (`fixed.attention`: each thread scales its KV heads' queries from q's own
    layout and puts its output rows in [B, T, Hq, D], `cpu_rows.scaled_heads` / `heads_out`) against the
    steps those replaced around the same kernel: the queries' transposed copy, `qg.float() * scale`,
    `kernel.attend`, the output's transposed copy and torch's cast. Bitwise; a NaN's payload aside (see
    `cpu_rows._to_bf16`). q: a [B, Hq, T, D] view of [B, T, Hq, D] (`layout` "rotary", as the rotary leaves
    it) or contiguous; k / v a slice of a longer cache."""
    import numpy as np

    from detaudit.backends.kernels import cpu_calls, fixed

    kernel = cpu_calls.compiled("cpu_attention")
    (bsz, t), hq, scale = pos.shape, hkv * groups, d**-0.5
    q = spread(bsz, t, hq, d, seed=seed, dtype=torch.float32) * 4
    q.view(-1)[:3] = torch.tensor([float("inf"), 1e-39, float("nan")])
    q = q.to(dtype).transpose(1, 2)
    if layout != "rotary":
        q = q.contiguous()
    k, v = (spread(bsz, hkv, length + 5, d, seed=seed + i, dtype=dtype)[:, :, :length] for i in (1, 2))
    got = fixed.attention(q, k, v, pos, scale, 64, window)
    assert got.transpose(1, 2).is_contiguous()  # (o_proj's input, a view)
    g, rows = bsz * hkv, t * groups
    qg = q.reshape(bsz, hkv, groups, t, d).transpose(2, 3).reshape(g, rows, d)
    qs = (qg.float() * scale).contiguous().numpy()
    p = pos[:, None, :, None].expand(bsz, hkv, t, groups).reshape(g, rows).contiguous().numpy()
    as_bits = torch.int16 if dtype == torch.bfloat16 else torch.float32
    kn, vn = (x.reshape(g, length, d).view(as_bits).numpy() for x in (k, v))
    out = np.empty((g, rows, d), dtype=np.float32)
    kernel.attend(qs, p, kn, vn, dtype == torch.bfloat16, window or 0, out)
    want = torch.from_numpy(out).view(bsz, hkv, t, groups, d).transpose(2, 3).reshape(bsz, hq, t, d).to(dtype)
    nan = torch.isnan(want)
    assert nan.any() and torch.equal(torch.isnan(got), nan)  # (the NaN query's rows)
    bits(got.masked_fill(nan, 0), want.masked_fill(nan, 0), "the attention output")


@PROPS
@given(
    bsz=st.integers(1, 3),
    t=st.integers(1, 9),
    hkv=st.integers(1, 3),
    groups=st.integers(1, 3),
    d=st.sampled_from([8, 64, 80]),
    layout=st.sampled_from(["rotary", "contiguous"]),
    window=st.sampled_from([None, 5]),
    dtype=DTYPES,
    seed=SEEDS,
)
def test_compiled_attention_reads_and_writes_heads_in_place_with_the_torch_ops_bits(
    bsz, t, hkv, groups, d, layout, window, dtype, seed
):
    """The compiled attention's queries read and output written where the layers keep them, against the
    copies, scaling and cast they replaced (`_attention_heads_against_torch`), prefill and decode shapes."""
    from detaudit.backends.kernels import cpu_calls

    if cpu_calls.compiled("cpu_attention") is None:
        return  # (numba not installed: the torch ops are the path)
    length = 20
    pos = (torch.arange(t) + torch.arange(bsz)[:, None] + length - t - bsz + 1).clamp(min=0).contiguous()
    _attention_heads_against_torch(pos, hkv, groups, d, length, dtype, seed, layout, window)


@pytest.mark.parametrize("steps", ["decode", "prefill"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_compiled_attention_spread_over_threads_reads_and_writes_heads_in_place(dtype, steps, spread_on):
    """A batch-32 decode step's attention (the embedded model's 24 / 8 heads of 64) and a prefill's of 4
    requests of 40 tokens, spread over 8 threads (the team's ATTEND job, or the Python pool's slices): each
    thread's scaled queries and output rows in place give the torch ops' bits."""
    from detaudit.backends.kernels import fixed

    team = spread_on(8)
    if steps == "decode":
        pos = torch.randint(0, 47, (32, 1), generator=torch.Generator().manual_seed(5))
    else:
        pos = (torch.arange(40) + torch.tensor([[0], [8], [3], [5]])).contiguous()
    rows = pos.numel() * 3
    assert 4.0 * pos.shape[0] * 8 * rows * 64 * 48 > fixed.ATTENTION_SPLIT_FLOPS  # (spread, not one thread)
    jobs = team.job if team else 0
    _attention_heads_against_torch(pos, 8, 3, 64, 48, dtype, seed=11)
    if team:  # the one attention call went to the team's workers
        assert team.job == jobs + 1, (team.job, jobs)


@PROPS
@given(n=st.integers(1, 3000), scale=st.sampled_from([1e-40, 1.0, 3e38]), seed=SEEDS)
def test_compiled_cast_to_bf16_is_torchs(n, scale, seed):
    """The compiled cast (`cpu_rows.to_bf16`: the leaf sums' rounding, `cpu_loop.pairwise`) against torch's
    `.to(bfloat16)`, bitwise: ties, subnormals, overflow to infinity, across its chunks; NaN stays NaN (its
    payload is the scalar rule's, `cpu_rows._to_bf16`)."""
    from detaudit.backends.kernels import cpu_calls

    rows = cpu_calls.compiled("cpu_rows")
    if rows is None:
        return  # (numba not installed: torch's cast is the path)
    x = spread(1, n, seed=seed, dtype=torch.float32).view(-1) * scale
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-133, float("inf"), 3.4e38, -0.0])
    x[: min(n, 7)] = ties[: min(n, 7)]  # (halfway cases round to even; 3.4e38 rounds past bf16's largest)
    nan = n > 8
    if nan:
        x[8] = float("nan")
    got = torch.empty(n, dtype=torch.bfloat16)
    rows.to_bf16(x.numpy(), got.view(torch.int16).numpy())
    want = x.bfloat16()
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    if nan:  # (the NaN's payload aside)
        got, want = got.clone(), want.clone()
        got.view(-1)[8] = want.view(-1)[8] = 0
    bits(got.view(torch.int16), want.view(torch.int16), "the cast")
