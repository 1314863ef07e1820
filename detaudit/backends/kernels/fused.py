"""One-launch GPU kernels for the decoder's per-token ops, which eager PyTorch runs as dozens of small
kernels per layer (reports/gpu/eager-host-cost-h100.md: about 60 ops per layer at 18-30 us of host
time each, the eager decode step's cost):

- `rms_norm`: residual add (optional) and RMSNorm of each row, one program per row. Both GPU
  backends' RMSNorm *is* this kernel (a definition, not a copy of the op-by-op bits): a row's sum of
  squares is added in one fixed order (BLOCK fp32 lanes over the row in order, then one tree across
  the lanes) that depends on nothing but the row, so it is batch invariant, prefill == decode and the
  same at every TP size. The elementwise steps round where the op-by-op formulation rounds: the
  residual sum once to the model dtype, the normalised row once before the weight product.
- `rope_store`: rotary embedding of q and k and the KV-cache writes of k and v, one launch (with
  Qwen3's per-head q / k RMSNorm first: `rms_norm`'s statements for a row of D, the same bits). The same
  bits as `layers.apply_rotary` followed by the two `index_copy_`: every product and the sum are
  rounded to the model dtype as PyTorch's bf16 ops round them (fp32 products of bf16 values are exact).
- `silu_mul`: `silu(gate) * up` with PyTorch's formula (x / (1 + exp(-x)) with the accurate expf and
  an IEEE division), rounded where the two ops round: the same bits.

Contraction of a multiply and an add into one FMA (which changes rounding) is switched off for all
three (`enable_fp_fusion=False`). Launches are kept per plan key (`launch`)."""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from detaudit.backends.kernels import launch

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_BLOCK = 1024  # fp32 lanes of the row-sum (rows longer than this are walked in BLOCK steps)
SILU_BLOCK = 1024
_OPTS = dict(num_warps=4, enable_fp_fusion=False)


def usable(t: Tensor) -> bool:
    """Whether the fused kernels run for tensors like `t` (a CUDA tensor and Triton installed)."""
    return triton is not None and t.is_cuda


def rope_usable(t: Tensor, head_dim: int) -> bool:
    half = head_dim // 2
    return usable(t) and head_dim % 2 == 0 and half >= 8 and half & (half - 1) == 0


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, d_ptr, s_ptr, y_ptr, w_ptr, N, sx, sd, ss, sy, inv_n, eps, HAS_DELTA: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            idx = start + offs
            inside = idx < N
            x = tl.load(x_ptr + row * sx + idx, mask=inside, other=0.0)
            if HAS_DELTA:  # the residual sum, rounded once to the model dtype (as x + delta is)
                d = tl.load(d_ptr + row * sd + idx, mask=inside, other=0.0)
                x = (x.to(tl.float32) + d.to(s_ptr.dtype.element_ty).to(tl.float32)).to(s_ptr.dtype.element_ty)
                tl.store(s_ptr + row * ss + idx, x, mask=inside)
            xf = x.to(tl.float32)
            acc += xf * xf
        r = tl.rsqrt(tl.sum(acc, 0) * inv_n + eps)
        for start in range(0, N, BLOCK):
            idx = start + offs
            inside = idx < N
            x = tl.load(x_ptr + row * sx + idx, mask=inside, other=0.0)
            if HAS_DELTA:  # recomputed, not read back: another thread of this program stored it
                d = tl.load(d_ptr + row * sd + idx, mask=inside, other=0.0)
                x = (x.to(tl.float32) + d.to(s_ptr.dtype.element_ty).to(tl.float32)).to(s_ptr.dtype.element_ty)
            w = tl.load(w_ptr + idx, mask=inside, other=0.0).to(tl.float32)
            y = (x.to(tl.float32) * r).to(y_ptr.dtype.element_ty).to(tl.float32) * w
            tl.store(y_ptr + row * sy + idx, y.to(y_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def _rot(x, c, y, s, DT: tl.constexpr):
        """x * cos + y * sin, each op rounded to DT (PyTorch's bf16 ops); y is the rotated half."""
        a = (x * c).to(DT).to(tl.float32)
        b = (y * s).to(DT).to(tl.float32)
        return (a + b).to(DT)

    @triton.jit
    def _head(src, w_ptr, lo, inv_d, eps, NORM: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr):
        """One head's row as its two fp32 halves, RMS-normed first when NORM: the statements of
        `_rms_norm_kernel` without a delta for a row of D (BLOCK = D), so the same bits."""
        if NORM:
            full = tl.arange(0, D)
            acc = tl.zeros([D], tl.float32)
            xf = tl.load(src + full).to(tl.float32)
            acc += xf * xf
            r = tl.rsqrt(tl.sum(acc, 0) * inv_d + eps)
            x1 = tl.load(src + lo)
            x2 = tl.load(src + HALF + lo)
            w1 = tl.load(w_ptr + lo).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + lo).to(tl.float32)
            x1 = ((x1.to(tl.float32) * r).to(DT).to(tl.float32) * w1).to(DT)
            x2 = ((x2.to(tl.float32) * r).to(DT).to(tl.float32) * w2).to(DT)
        else:
            x1 = tl.load(src + lo)
            x2 = tl.load(src + HALF + lo)
        return x1.to(tl.float32), x2.to(tl.float32)

    @triton.jit
    def _rope_store_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        cos_ptr,
        sin_ptr,
        kc_ptr,
        vc_ptr,
        slot_ptr,
        qo_ptr,
        qw_ptr,
        kw_ptr,
        T,
        HQ,
        HKV,
        sq,
        sk,
        sv,
        k_off,
        v_off,
        inv_d,
        eps,
        D: tl.constexpr,
        HALF: tl.constexpr,
        NORM: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)  # the token: b * T + t
        h = tl.program_id(1)  # q heads first, then the KV heads
        DT: tl.constexpr = qo_ptr.dtype.element_ty
        lo = tl.arange(0, HALF)
        c1 = tl.load(cos_ptr + row * D + lo).to(tl.float32)
        c2 = tl.load(cos_ptr + row * D + HALF + lo).to(tl.float32)
        s1 = tl.load(sin_ptr + row * D + lo).to(tl.float32)
        s2 = tl.load(sin_ptr + row * D + HALF + lo).to(tl.float32)
        if h < HQ:
            x1, x2 = _head(q_ptr + row * sq + h * D, qw_ptr, lo, inv_d, eps, NORM, D, HALF, DT)
            b = row // T
            dst = qo_ptr + ((b * HQ + h) * T + row % T) * D  # [B, HQ, T, D]
            tl.store(dst + lo, _rot(x1, c1, -x2, s1, DT))
            tl.store(dst + HALF + lo, _rot(x2, c2, x1, s2, DT))
        else:
            j = h - HQ
            slot = tl.load(slot_ptr + row * HKV + j)
            x1, x2 = _head(k_ptr + k_off + row * sk + j * D, kw_ptr, lo, inv_d, eps, NORM, D, HALF, DT)
            tl.store(kc_ptr + slot * D + lo, _rot(x1, c1, -x2, s1, DT))
            tl.store(kc_ptr + slot * D + HALF + lo, _rot(x2, c2, x1, s2, DT))
            full = tl.arange(0, D)
            tl.store(vc_ptr + slot * D + full, tl.load(v_ptr + v_off + row * sv + j * D + full))

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n, sg, su, u_off, BLOCK: tl.constexpr, EXPF: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        g = tl.load(g_ptr + row * sg + offs, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + u_off + row * su + offs, mask=inside, other=0.0).to(tl.float32)
        DT: tl.constexpr = o_ptr.dtype.element_ty
        if EXPF:  # CUDA's accurate expf, as PyTorch's silu calls it
            e = libdevice.exp(-g)
        else:  # the CPU interpreter has no libdevice
            e = tl.exp(-g)
        s = tl.div_rn(g, 1.0 + e).to(DT).to(tl.float32)
        tl.store(o_ptr + row * n + offs, (s * u).to(DT), mask=inside)


def _aligned(*ts: Tensor) -> tuple[bool, ...]:
    """The JIT's pointer specialisation of `ts` for a plan key: one True where all are 16-byte aligned
    (the usual case, cheap to key), else each tensor's flag."""
    ptrs = 0
    for t in ts:
        ptrs |= t.data_ptr()
    return (True,) if not ptrs & 15 else tuple(t.data_ptr() % 16 == 0 for t in ts) + (False,)


def _plain_rows(t: Tensor) -> bool:
    """A 2-D operand the kernels read as it is: unit stride along a row, rows 16-byte aligned."""
    return t.dim() == 2 and t.stride(1) == 1 and not (t.data_ptr() & 15) and not ((t.stride(0) * t.element_size()) & 15)


def _run(
    plans: dict,
    key: tuple | None,
    kernel,
    grid: tuple,
    args: tuple,
    kwargs: dict,
    slots: tuple,
    tensors: tuple,
    device: int,
) -> None:
    if key is not None:
        plan = plans.get(key)
        if plan is not None:
            plan(device, *tensors)
            return
    first = launch.Launch.first(kernel, grid, args, {**kwargs, **_OPTS}, slots=slots)
    if first is not None and key is not None:
        launch.cache_put(plans, key, first)


def _rows(t: Tensor) -> Tensor:
    """t as [rows, N] with unit stride along N and 16-byte aligned rows (the kernel's loads then take one
    layout, so one reduction order, whatever the caller's view)."""
    t2 = t.reshape(-1, t.shape[-1])
    if not _plain_rows(t2):
        t2 = t2.contiguous()
        if (t2.stride(0) * t2.element_size()) % 16:
            t2 = t2.clone()  # (a fresh allocation is aligned; an odd row length keeps its layout per row)
    return t2


@functools.lru_cache(maxsize=None)
def _inverse(n: int) -> float:
    """1/N rounded to fp32 (the kernel multiplies the sum of squares by it, as `t / N` does in PyTorch)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / n)


def _fits(out: Tensor, shape: tuple, dtype: torch.dtype) -> Tensor:
    """`out` as a kernel's output buffer: contiguous, of `shape` and `dtype` (the layout the launch plans
    were made for), or ValueError."""
    if not (out.is_contiguous() and out.shape == shape and out.dtype == dtype):
        raise ValueError(
            f"output buffer {tuple(out.shape)} {out.dtype} (contiguous: {out.is_contiguous()}) "
            f"does not fit a {tuple(shape)} {dtype} result"
        )
    return out


def _norm_outputs(x: Tensor, delta: Tensor | None, out: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """`rms_norm`'s (normed, sum) buffers, of x's shape and dtype: `out`'s, checked, or new ones (without a
    delta the sum is not written: the normed buffer stands in for it)."""
    if out is None:
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        return y, (torch.empty(x.shape, dtype=x.dtype, device=x.device) if delta is not None else y)
    y = _fits(out[0], x.shape, x.dtype)
    return y, (_fits(out[1], x.shape, x.dtype) if delta is not None else y)


def rms_norm(
    x: Tensor, weight: Tensor, eps: float, delta: Tensor | None = None, out: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor | None]:
    """RMSNorm over the last dim of `x` (+ `delta`, when given: the residual sum, in x's dtype) ->
    (normed, the sum or None). fp32 statistics; the result and the sum in x's dtype. `out`: (normed, sum)
    buffers to write instead of allocating (contiguous, x's shape and dtype; neither may overlap x or
    delta); the sum's is unused without a delta."""
    fast = None
    if x.is_cuda and _plain_rows(x) and (delta is None or _plain_rows(delta)):  # the engine's calls: no views
        fast = (
            x.shape,
            x.stride(0),
            x.dtype,
            None if delta is None else (delta.stride(0), delta.dtype),
            weight.data_ptr() & 15,
            weight.dtype,
            eps,
            x.device.index,
        )
        plan = _RMS_FAST.get(fast)
        if plan is not None:
            y, s = _norm_outputs(x, delta, out)
            if delta is None:
                plan(x.device.index, x, x, y, y, weight)
                return y, None
            plan(x.device.index, x, delta, s, y, weight)
            return y, s
    x2 = _rows(x)
    n = x2.shape[1]
    d2 = _rows(delta) if delta is not None else x2
    y_out, s_out = _norm_outputs(x, delta, out)  # x's shape; the kernel writes them as [rows, N]
    y, s = y_out.view(x2.shape), s_out.view(x2.shape)
    if not x2.shape[0]:
        return y_out, (s_out if delta is not None else None)
    block = min(MAX_BLOCK, triton.next_power_of_2(n))
    inv_n = _inverse(n)
    key = None
    if x.is_cuda:
        key = (
            x2.shape,
            x2.stride(),
            d2.stride(),
            d2.dtype,
            x.dtype,
            weight.dtype,
            float(eps),
            delta is not None,
            x.device.index,
            *_aligned(x2, d2, s, y, weight),
        )
    _run(
        _RMS,
        key,
        _rms_norm_kernel,
        (x2.shape[0],),
        (x2, d2, s, y, weight, n, x2.stride(0), d2.stride(0), s.stride(0), y.stride(0), inv_n, float(eps)),
        dict(HAS_DELTA=delta is not None, BLOCK=block),
        (0, 1, 2, 3, 4),
        (x2, d2, s, y, weight),
        x.device.index if x.is_cuda else 0,
    )
    if fast is not None and key in _RMS and not (s.data_ptr() & 15 or y.data_ptr() & 15):
        _RMS_FAST[fast] = _RMS[key]  # (launch.MAX_PLANS bounds _RMS; this one follows the same keys)
        if len(_RMS_FAST) > launch.MAX_PLANS:
            _RMS_FAST.clear()
    return y_out, (s_out if delta is not None else None)


def rope_store(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    batch: int,
    tokens: int,
    head_dim: int,
    norms: tuple[Tensor, Tensor, float] | None = None,
) -> Tensor:
    """q[B*T, HQ*D], k / v[B*T, HKV*D] (rows unit-stride, any row stride: column slices of one fused
    projection), cos / sin[B, 1, T, D] -> rotated q as [B, HQ, T, D] contiguous; rotated k and v written
    to the flat caches' rows `slots` [B*T*HKV] (ordered (token, KV head)). `norms` = (q weight, k weight,
    eps): each head RMS-normed first (Qwen3's q_norm / k_norm), with `rms_norm`'s bits for rows of D."""
    d = head_dim
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return _rope(
        q, k, v, 0, 0, q.shape[1] // d, k.shape[1] // d, cos, sin, k_cache, v_cache, slots, batch, tokens, d, norms
    )


def rope_store_qkv(
    qkv: Tensor,
    hq: int,
    hkv: int,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    batch: int,
    tokens: int,
    head_dim: int,
    norms: tuple[Tensor, Tensor, float] | None = None,
    out: Tensor | None = None,
) -> Tensor:
    """`rope_store` of q, k, v given side by side as the columns of one product qkv[B*T, (HQ + 2 HKV) * D]
    (unit-stride rows): the kernel reads each part at its column offset, so no slice views are made (the
    same loads, the same bits). `out`: the rotated q's buffer ([B, HQ, T, D] contiguous) instead of a new one."""
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    return _rope(
        qkv,
        qkv,
        qkv,
        hq * head_dim,
        (hq + hkv) * head_dim,
        hq,
        hkv,
        cos,
        sin,
        k_cache,
        v_cache,
        slots,
        batch,
        tokens,
        head_dim,
        norms,
        out,
    )


def _rope(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    k_off: int,
    v_off: int,
    hq: int,
    hkv: int,
    cos: Tensor,
    sin: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slots: Tensor,
    batch: int,
    tokens: int,
    d: int,
    norms: tuple[Tensor, Tensor, float] | None,
    out: Tensor | None = None,
) -> Tensor:
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_store writes rows of contiguous caches")  # (the kernel addresses slot * D)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    if out is None:
        out = torch.empty((batch, hq, tokens, d), dtype=q.dtype, device=q.device)
    else:
        _fits(out, (batch, hq, tokens, d), q.dtype)
    qw, kw, eps = norms if norms is not None else (q, k, 0.0)
    key = None
    if q.is_cuda:
        key = (
            batch,
            tokens,
            hq,
            hkv,
            d,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            k_off,
            v_off,
            q.dtype,
            q.device.index,
            norms is not None,
            float(eps),
            *_aligned(q, k, v, cos, sin, k_cache, v_cache, slots, out, qw, kw),
        )
    _run(
        _ROPE,
        key,
        _rope_store_kernel,
        (batch * tokens, hq + hkv),
        (
            q,
            k,
            v,
            cos,
            sin,
            k_cache,
            v_cache,
            slots,
            out,
            qw,
            kw,
            tokens,
            hq,
            hkv,
            q.stride(0),
            k.stride(0),
            v.stride(0),
            k_off,
            v_off,
            _inverse(d),
            float(eps),
        ),
        dict(D=d, HALF=d // 2, NORM=norms is not None),
        tuple(range(11)),
        (q, k, v, cos, sin, k_cache, v_cache, slots, out, qw, kw),
        q.device.index if q.is_cuda else 0,
    )
    return out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for gate / up[M, N] (rows unit-stride, any row stride: the halves of one fused
    gate_up projection) -> [M, N] contiguous, the bits of `F.silu(gate) * up`."""
    gate, up = (
        t if t.dim() == 2 and t.stride(-1) == 1 else t.reshape(-1, t.shape[-1]).contiguous() for t in (gate, up)
    )
    return _silu(gate, up, 0, gate.shape[1])


def silu_mul_halves(gate_up: Tensor, out: Tensor | None = None) -> Tensor:
    """`silu_mul` of the two halves of gate_up[M, 2N] (unit-stride rows), read at their column offsets
    without slice views: the same loads, the same bits. `out`: an [M, N] contiguous buffer to write."""
    if gate_up.dim() != 2 or gate_up.stride(-1) != 1:
        gate_up = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
    n = gate_up.shape[1] // 2
    return _silu(gate_up, gate_up, n, n, out)


def _silu(gate: Tensor, up: Tensor, u_off: int, n: int, out: Tensor | None = None) -> Tensor:
    m = gate.shape[0]
    if out is None:
        out = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    else:
        _fits(out, (m, n), gate.dtype)
    if not out.numel():
        return out
    key = (
        (m, n, u_off, gate.stride(0), up.stride(0), gate.dtype, gate.device.index, *_aligned(gate, up, out))
        if gate.is_cuda
        else None
    )
    _run(
        _SILU,
        key,
        _silu_mul_kernel,
        (m, triton.cdiv(n, SILU_BLOCK)),
        (gate, up, out, n, gate.stride(0), up.stride(0), u_off),
        dict(BLOCK=SILU_BLOCK, EXPF=gate.is_cuda),
        (0, 1, 2),
        (gate, up, out),
        gate.device.index if gate.is_cuda else 0,
    )
    return out


_RMS: dict[tuple, launch.Launch] = {}
_RMS_FAST: dict[tuple, launch.Launch] = {}
_ROPE: dict[tuple, launch.Launch] = {}
_SILU: dict[tuple, launch.Launch] = {}
