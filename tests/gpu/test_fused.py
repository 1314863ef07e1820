"""The one-launch per-token kernels (`kernels/fused.py`) on a GPU, bitwise: rotary + cache writes, the
vLLM plugin's rotary of packed rows and silu * up give the op-by-op PyTorch bits; the fused add +
RMSNorm is batch invariant, position invariant, gives the residual sum's bits and is as accurate as the
op-by-op norm against fp64."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import require

from detaudit.backends import get_backend
from detaudit.backends.kernels import fused
from detaudit.backends.row_ops import apply_rotary
from detaudit.builtin.layers import Rotary

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
require("triton", "triton")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("b,t,hq,hkv,d", [(8, 1, 32, 8, 128), (3, 70, 24, 8, 64), (32, 1, 4, 1, 128)])
def test_rope_store_gives_the_op_by_op_bits(b, t, hq, hkv, d, dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    length = t + 40
    q = (torch.randn(b * t, hq * d, device="cuda", generator=g) * 3).to(dtype)
    k = (torch.randn(b * t, hkv * d, device="cuda", generator=g) * 3).to(dtype)
    v = torch.randn(b * t, hkv * d, device="cuda", generator=g).to(dtype)
    pos = torch.arange(t, device="cuda").expand(b, t) + torch.randint(0, 40, (b, 1), device="cuda", generator=g)
    cos, sin = Rotary(d, 1e6, torch.device("cuda")).cos_sin(pos, dtype)
    heads = torch.arange(hkv, device="cuda") * length
    slots = (torch.arange(b, device="cuda")[:, None, None] * (hkv * length) + pos[:, :, None] + heads).reshape(-1)
    caches = [torch.randn(b, hkv, length, d, device="cuda", generator=g).to(dtype) for _ in range(2)]
    want_k, want_v = (c.clone() for c in caches)
    want_q = apply_rotary(q.view(b, t, hq, d).transpose(1, 2), cos, sin)
    kr = apply_rotary(k.view(b, t, hkv, d).transpose(1, 2), cos, sin)
    want_k.view(-1, d).index_copy_(0, slots, kr.transpose(1, 2).reshape(-1, d))
    want_v.view(-1, d).index_copy_(0, slots, v.view(-1, d))
    # the engine's form on GPU: column slices of one q/k/v product
    qs, ks, vs = torch.cat([q, k, v], 1).split([hq * d, hkv * d, hkv * d], dim=1)
    for _ in range(2):  # the JIT launch, then the kept plan
        for args in ((q, k, v), (qs, ks, vs)):
            got_k, got_v = (c.clone() for c in caches)
            got_q = fused.rope_store(*args, cos, sin, got_k, got_v, slots, b, t, d)
            assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,hq,hkv,d", [(16, 32, 8, 128), (700, 24, 8, 64), (1, 4, 1, 128)])
def test_rope_rows_gives_the_op_by_op_bits(t, hq, hkv, d, dtype):
    """The vLLM plugin's rotary (q and k each alone, [T, H*D] in vLLM's packing, column slices of one qkv
    product): `fused.rope_rows` against `apply_rotary` op by op, bitwise; the row ops' `rotary_rows`
    takes it on GPU."""
    from detaudit.backends.row_ops import FusedOps

    g = torch.Generator(device="cuda").manual_seed(2)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, device="cuda", generator=g) * 3).to(dtype)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    pos = torch.randint(0, 4000, (t,), device="cuda", generator=g)
    cos, sin = Rotary(d, 1e6, torch.device("cuda")).cos_sin(pos[None], dtype)
    cos, sin = cos[0, 0], sin[0, 0]  # [T, D]
    ops = get_backend("bio").row_ops(torch.device("cuda"))
    assert isinstance(ops, FusedOps)
    for x, h in ((q, hq), (k, hkv)):
        want = apply_rotary(x.reshape(t, h, d), cos[:, None], sin[:, None]).reshape(t, h * d)
        first = fused.rope_rows(x, cos, sin, d)  # the JIT launch
        # the kept plan, on other tensors of the same layout (each result kept alive: no reused address)
        x2, cos2, sin2 = (x * 0.5).to(dtype), cos.flip(0).contiguous(), sin.flip(0).contiguous()
        second = fused.rope_rows(x2, cos2, sin2, d)
        want2 = apply_rotary(x2.reshape(t, h, d), cos2[:, None], sin2[:, None]).reshape(t, h * d)
        assert torch.equal(first, want) and torch.equal(second, want2)
        assert torch.equal(ops.rotary_rows(x, cos, sin, d), want)
        assert torch.equal(ops.rotary_rows(x.reshape(t, h, d), cos, sin, d).view(t, h * d), want)  # [T, H, D]
    # a row start that is not 16-byte aligned, cos / sin as strided views: copied, the same bits
    odd = torch.empty(t * hq * d + 1, device="cuda", dtype=dtype)[1:].view(t, hq * d).copy_(q)
    wide = torch.stack([cos, sin], 1)  # cos / sin as views with a row stride of 2 * D
    want = apply_rotary(q.reshape(t, hq, d), cos[:, None], sin[:, None]).reshape(t, hq * d)
    assert torch.equal(fused.rope_rows(odd, wide[:, 0], wide[:, 1], d), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_silu_mul_gives_the_op_by_op_bits(dtype):
    g = torch.Generator(device="cuda").manual_seed(2)
    gate = (torch.randn(37, 12288, device="cuda", generator=g) * 6).to(dtype)
    gate[0, :4] = torch.tensor([0.0, -100.0, 100.0, -0.0])
    up = torch.randn(37, 12288, device="cuda", generator=g).to(dtype)
    halves = torch.cat([gate, up], 1).split(12288, dim=1)  # the engine's form: one gate/up product
    for _ in range(2):
        assert torch.equal(fused.silu_mul(gate, up), F.silu(gate) * up)
        assert torch.equal(fused.silu_mul(*halves), F.silu(gate) * up)


@pytest.mark.parametrize("n", [128, 576, 4096, 5120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_add_rms_norm_invariant_and_accurate(n, dtype):
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(300, n, device="cuda", generator=g) * 2).to(dtype)
    delta = torch.randn(300, n, device="cuda", generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dtype)
    y, s = fused.rms_norm(x, w, 1e-6, delta)
    assert torch.equal(s, x + delta)  # the residual sum: PyTorch's add, bitwise
    alone, _ = fused.rms_norm(s, w, 1e-6)
    assert torch.equal(alone, y)  # add + norm == norm of the sum
    for m in (1, 7, 64, 299):  # batch invariant
        assert torch.equal(fused.rms_norm(x[:m], w, 1e-6, delta[:m])[0], y[:m]), m
    perm = torch.randperm(300, device="cuda", generator=g)  # a row's bits do not depend on its slot
    assert torch.equal(fused.rms_norm(x[perm], w, 1e-6, delta[perm])[0], y[perm])
    odd = torch.empty(300 * n + 1, device="cuda", dtype=dtype)[1:].view(300, n)  # a misaligned view
    odd.copy_(s)
    assert torch.equal(fused.rms_norm(odd, w, 1e-6)[0], y)
    sd = s.double()
    ref = sd * torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    op_by_op = get_backend("bf16")  # on CPU: PyTorch ops (the fused kernel is the GPU path)
    cpu = op_by_op.rms_norm(s.cpu(), w.cpu(), 1e-6).double()
    err, err_ops = ((y.double() - ref).abs().max().item(), (cpu - ref.cpu()).abs().max().item())
    assert err <= 2 * err_ops + 1e-6, (err, err_ops)


@pytest.mark.parametrize("n", [128, 576, 4096, 5120])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_gives_the_one_row_kernels_bits(n, dtype):
    """Rows read through strides are never a bit: `fused.rms_norm` on plain rows (with and without the
    residual) and on heads of a column slice of one q/k/v product read in place ([T, H, N] and
    [B, T, H, N] views), against the kernel that read copied rows (`unit/fused_reference.py`, kept
    verbatim), bitwise."""
    from unit import fused_reference

    g = torch.Generator(device="cuda").manual_seed(5)
    x = (torch.randn(301, n, device="cuda", generator=g) * 2).to(dtype)
    delta = torch.randn(301, n, device="cuda", generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, device="cuda", generator=g)).to(dtype)
    want_y, want_s = fused_reference.rms_norm(x, w, 1e-6, delta)
    y, s = fused.rms_norm(x, w, 1e-6, delta)
    assert torch.equal(y, want_y) and torch.equal(s, want_s)
    assert torch.equal(fused.rms_norm(x, w, 1e-6)[0], fused_reference.rms_norm(x, w, 1e-6)[0])
    qkv = (torch.randn(30, 7 * n, device="cuda", generator=g) * 2).to(dtype)
    heads = qkv[:, n : 5 * n].view(30, 4, n)  # 4 heads of a column slice: strided rows, no plain view
    want = fused_reference.rms_norm(heads.contiguous(), w, 1e-6)[0].view(30, 4, n)
    for _ in range(2):  # the JIT launch, then the kept plan
        assert torch.equal(fused.rms_norm(heads, w, 1e-6)[0], want)
        assert torch.equal(fused.rms_norm(heads.view(5, 6, 4, n), w, 1e-6)[0], want.view(5, 6, 4, n))


def test_rope_rows_heads_a_program_are_not_a_bit():
    """`rope_rows` at 1, 4 or 16 heads a program (masked heads of a tile included: 24 heads): the op-by-op bits."""
    g = torch.Generator(device="cuda").manual_seed(6)
    t, h, d = 40, 24, 128
    x = (torch.randn(t, 2 * h * d, device="cuda", generator=g) * 3).bfloat16()[:, : h * d]
    pos = torch.randint(0, 4000, (t,), device="cuda", generator=g)
    cos, sin = Rotary(d, 1e6, torch.device("cuda")).cos_sin(pos[None], torch.bfloat16)
    cos, sin = cos[0, 0], sin[0, 0]
    want = apply_rotary(x.reshape(t, h, d), cos[:, None], sin[:, None]).reshape(t, h * d)
    for heads in (None, 1, 4, 16):
        assert torch.equal(fused.rope_rows(x, cos, sin, d, heads=heads), want), heads


def test_backends_rms_norm_is_the_fused_kernel_on_gpu():
    """bio's and bf16's GPU RMSNorm are the kernel, whatever the leading shape (q/k norms are [B, T, H, D])."""
    g = torch.Generator(device="cuda").manual_seed(4)
    x = torch.randn(4, 3, 8, 128, device="cuda", generator=g).bfloat16()
    w = torch.randn(128, device="cuda", generator=g).bfloat16()
    want = fused.rms_norm(x.reshape(-1, 128), w, 1e-6)[0].view_as(x)
    for name in ("bio", "bf16", "bio+tbik"):
        assert torch.equal(get_backend(name).rms_norm(x, w, 1e-6), want), name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merged_projections_and_in_kernel_qk_norm_give_the_separate_bits(dtype):
    """What the engine does on GPU with one shard per layer, against the separate ops, bitwise: bio's
    product with q/k/v (gate/up) weights side by side == each product alone; Qwen3's q / k norm inside the
    rotary kernel == the backend's RMSNorm then the rotary kernel; silu * up of the merged halves."""
    g = torch.Generator(device="cuda").manual_seed(5)
    hq, hkv, d, hidden, inter = 32, 8, 128, 4096, 12288
    wq, wk, wv = (torch.randn(n, hidden, device="cuda", generator=g).to(dtype) / 64 for n in (hq * d, hkv * d, hkv * d))
    wg, wu = (torch.randn(inter, hidden, device="cuda", generator=g).to(dtype) / 64 for _ in range(2))
    bio = get_backend("bio")
    qkv_w, gu_w = torch.cat([wq, wk, wv]), torch.cat([wg, wu])
    for m in (1, 8, 32, 64, 200):
        h = torch.randn(m, hidden, device="cuda", generator=g).to(dtype)
        qkv, gu = bio.linear(h, qkv_w), bio.linear(h, gu_w)
        q, k, v = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d], qkv[:, (hq + hkv) * d :]
        assert (
            torch.equal(q, bio.linear(h, wq))
            and torch.equal(k, bio.linear(h, wk))
            and torch.equal(v, bio.linear(h, wv))
        ), m
        assert torch.equal(gu, torch.cat([bio.linear(h, wg), bio.linear(h, wu)], 1)), m
        assert torch.equal(fused.silu_mul(gu[:, :inter], gu[:, inter:]), F.silu(gu[:, :inter]) * gu[:, inter:]), m
    b, t, length = 4, 5, 32
    h = torch.randn(b * t, hidden, device="cuda", generator=g).to(dtype)
    qkv = bio.linear(h, qkv_w)
    q, k, v = qkv[:, : hq * d], qkv[:, hq * d : (hq + hkv) * d], qkv[:, (hq + hkv) * d :]
    qw, kw = (
        (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(dtype),
        (1 + 0.1 * torch.randn(d, device="cuda", generator=g)).to(dtype),
    )
    pos = torch.arange(t, device="cuda").expand(b, t) + 3
    cos, sin = Rotary(d, 1e6, torch.device("cuda")).cos_sin(pos, dtype)
    slots = (
        torch.arange(b, device="cuda")[:, None, None] * (hkv * length)
        + pos[:, :, None]
        + torch.arange(hkv, device="cuda") * length
    ).reshape(-1)
    caches = [torch.zeros(b, hkv, length, d, device="cuda", dtype=dtype) for _ in range(4)]
    got = fused.rope_store(q, k, v, cos, sin, caches[0], caches[1], slots, b, t, d, (qw, kw, 1e-6))
    qn = bio.rms_norm(q.reshape(-1, d), qw, 1e-6).view(b * t, -1)
    kn = bio.rms_norm(k.reshape(-1, d), kw, 1e-6).view(b * t, -1)
    want = fused.rope_store(qn, kn, v, cos, sin, caches[2], caches[3], slots, b, t, d)
    assert torch.equal(got, want) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_bench_rows_layouts_keep_the_bits():
    """`detaudit bench rows` at small shapes: a row per workload and layout, every layout with the first's
    bits, times and copy ratios positive."""
    from detaudit.bench.rows import ROWS, bench_rows

    df = bench_rows(64, 256, (4, 2), 64, 512, torch.bfloat16)
    assert len(df) == ROWS
    assert df["bits_as_default"].all(), df
    assert (df["ms"] > 0).all() and (df["vs_copy"] > 0).all()
