"""One-launch GPU kernels for the decoder's per-token ops, which eager PyTorch runs as dozens of small
kernels per layer (the engine's GPU fast path, `backends.row_ops.FusedOps`):

- `rms_norm`: residual add (optional) and RMSNorm of each row, one program per row. Both GPU
  backends' RMSNorm *is* this kernel (a definition, not a copy of the op-by-op bits): a row's sum of
  squares is added in one fixed order (BLOCK fp32 lanes over the row in order, then one tree across
  the lanes) that depends on nothing but the row, so it is batch invariant, prefill == decode and the
  same at every TP size. The elementwise steps round where the op-by-op formulation rounds: the
  residual sum once to the model dtype, the normalised row once before the weight product.
- `rope_store`: rotary embedding of q and k and the KV-cache writes of k and v, one launch (with
  Qwen3's per-head q / k RMSNorm first: `rms_norm`'s statements for a row of D, the same bits). The same
  bits as `row_ops.apply_rotary` followed by the two `index_copy_`: every product and the sum are
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
ROPE_LANES = 1024  # a rotary program's [heads, D / 2] tile: at most this many elements per half
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
        x_ptr,
        d_ptr,
        s_ptr,
        y_ptr,
        w_ptr,
        N,
        INNER,
        sxo,
        sxi,
        sd,
        ss,
        sy,
        inv_n,
        eps,
        HAS_DELTA: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One row a program. x's row r is at (r // INNER) * sxo + (r % INNER) * sxi: a [T, H, N] view
        with a row stride per token and per head (vLLM's q / k heads, column slices of one q/k/v product)
        is read where it lies. Only the address differs from a plain row's, never the bits."""
        row = tl.program_id(0).to(tl.int64)
        xr = x_ptr + (row // INNER) * sxo + (row % INNER) * sxi
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            idx = start + offs
            inside = idx < N
            x = tl.load(xr + idx, mask=inside, other=0.0)
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
            x = tl.load(xr + idx, mask=inside, other=0.0)
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
    def _rotate_into(
        dst, x1, x2, cos_ptr, sin_ptr, row, lo, live, D: tl.constexpr, HALF: tl.constexpr, DT: tl.constexpr
    ):
        """Heads' halves (fp32; one head, or a [heads, HALF] tile with `dst` per head) rotated by token
        `row`'s cos / sin and stored at dst[0:D] in DT where `live`: the rotate-half of
        `row_ops.apply_rotary`, every rotary kernel's one copy of it."""
        c1 = tl.load(cos_ptr + row * D + lo).to(tl.float32)
        c2 = tl.load(cos_ptr + row * D + HALF + lo).to(tl.float32)
        s1 = tl.load(sin_ptr + row * D + lo).to(tl.float32)
        s2 = tl.load(sin_ptr + row * D + HALF + lo).to(tl.float32)
        tl.store(dst + lo, _rot(x1, c1, -x2, s1, DT), mask=live)
        tl.store(dst + HALF + lo, _rot(x2, c2, x1, s2, DT), mask=live)

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
        if h < HQ:
            x1, x2 = _head(q_ptr + row * sq + h * D, qw_ptr, lo, inv_d, eps, NORM, D, HALF, DT)
            b = row // T
            dst = qo_ptr + ((b * HQ + h) * T + row % T) * D  # [B, HQ, T, D]
            _rotate_into(dst, x1, x2, cos_ptr, sin_ptr, row, lo, lo < HALF, D, HALF, DT)
        else:
            j = h - HQ
            slot = tl.load(slot_ptr + row * HKV + j)
            x1, x2 = _head(k_ptr + row * sk + j * D, kw_ptr, lo, inv_d, eps, NORM, D, HALF, DT)
            _rotate_into(kc_ptr + slot * D, x1, x2, cos_ptr, sin_ptr, row, lo, lo < HALF, D, HALF, DT)
            full = tl.arange(0, D)
            tl.store(vc_ptr + slot * D + full, tl.load(v_ptr + row * sv + j * D + full))

    @triton.jit
    def _rope_rows_kernel(
        x_ptr, cos_ptr, sin_ptr, o_ptr, sx, H, D: tl.constexpr, HALF: tl.constexpr, HEADS: tl.constexpr
    ):
        """HEADS heads of one token of x[T, H*D] rotated into o[T, H*D] as one [HEADS, HALF] tile per
        half: `_rope_store_kernel`'s `_rotate_into` for heads without a norm. Every element's ops are its
        own (no reduction), so the tile's shape is never a bit (vLLM's rotary layer: q and k each alone)."""
        row = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * HEADS + tl.arange(0, HEADS)[:, None]
        live = h < H
        DT: tl.constexpr = o_ptr.dtype.element_ty
        lo = tl.arange(0, HALF)[None, :]
        src = x_ptr + row * sx + h * D
        x1 = tl.load(src + lo, mask=live, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF + lo, mask=live, other=0.0).to(tl.float32)
        _rotate_into(o_ptr + (row * H + h) * D, x1, x2, cos_ptr, sin_ptr, row, lo, live, D, HALF, DT)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, o_ptr, n, sg, su, BLOCK: tl.constexpr, EXPF: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < n
        g = tl.load(g_ptr + row * sg + offs, mask=inside, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + offs, mask=inside, other=0.0).to(tl.float32)
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


def _row_view(x: Tensor) -> Tensor | None:
    """x as [rows, N] without a copy, where that is a layout the kernels read as it is, else None."""
    try:
        x2 = x.view(-1, x.shape[-1])
    except RuntimeError:  # no such view (e.g. heads of a column slice)
        return None
    return x2 if _plain_rows(x2) else None


def _heads_view(x: Tensor) -> tuple[Tensor, int, int, int] | None:
    """x[..., H, N] whose rows the kernel can read in place as (token, head): (x as [T, H, N], H, the
    token stride, the head stride), or None. Unit stride along N, 16-byte aligned start and strides (so
    the loads take the layout of a contiguous row: the same reduction order)."""
    if x.dim() < 3 or x.stride(-1) != 1:
        return None
    x3 = x.reshape(-1, x.shape[-2], x.shape[-1]) if x.dim() > 3 else x  # (a copy, if any, is contiguous)
    size = x3.element_size()
    if x3.data_ptr() & 15 or (x3.stride(0) * size) & 15 or (x3.stride(1) * size) & 15:
        return None
    return x3, x3.shape[1], x3.stride(0), x3.stride(1)


def rms_norm(x: Tensor, weight: Tensor, eps: float, delta: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """RMSNorm over the last dim of `x` (+ `delta`, when given: the residual sum, in x's dtype) ->
    (normed, the sum or None). fp32 statistics; the result and the sum in x's dtype. Without a delta, x
    may be a strided [..., H, N] view (rows per token and head, e.g. vLLM's q heads), read where it lies
    instead of copied first."""
    n = x.shape[-1]
    x2 = _row_view(x)
    heads = _heads_view(x) if x2 is None and delta is None else None
    if heads is not None:
        x2, inner, sxo, sxi = heads
        m = x2.shape[0] * inner
    else:
        x2 = _rows(x) if x2 is None else x2
        inner, sxo, sxi, m = 1, x2.stride(0), x2.stride(0), x2.shape[0]
    d2 = _rows(delta) if delta is not None else x2
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    s = torch.empty_like(y) if delta is not None else y  # (without a delta the sum is not written)
    if m:
        key = None
        if x.is_cuda:
            key = (
                m,
                n,
                inner,
                sxo,
                sxi,
                d2.stride(0),
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
            (m,),
            (x2, d2, s, y, weight, n, inner, sxo, sxi, d2.stride(0), s.stride(0), y.stride(0))
            + (_inverse(n), float(eps)),
            dict(HAS_DELTA=delta is not None, BLOCK=min(MAX_BLOCK, triton.next_power_of_2(n))),
            (0, 1, 2, 3, 4),
            (x2, d2, s, y, weight),
            x.device.index if x.is_cuda else 0,
        )
    return y.view(x.shape), (s.view(x.shape) if delta is not None else None)


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
    hq, hkv = q.shape[1] // d, k.shape[1] // d
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("rope_store writes rows of contiguous caches")  # (the kernel addresses slot * D)
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty((batch, hq, tokens, d), dtype=q.dtype, device=q.device)
    qw, kw, eps = norms if norms is not None else (q, k, 0.0)
    tensors = (q, k, v, cos, sin, k_cache, v_cache, slots, out, qw, kw)
    key = None
    if q.is_cuda:
        strides = (q.stride(0), k.stride(0), v.stride(0))
        key = (batch, tokens, hq, hkv, d, *strides, q.dtype, q.device.index, norms is not None, float(eps))
        key += _aligned(*tensors)
    args = (*tensors, tokens, hq, hkv, q.stride(0), k.stride(0), v.stride(0), _inverse(d), float(eps))
    grid = (batch * tokens, hq + hkv)
    meta = dict(D=d, HALF=d // 2, NORM=norms is not None)
    _run(_ROPE, key, _rope_store_kernel, grid, args, meta, tuple(range(11)), tensors, q.device.index or 0)
    return out


def rope_rows(x: Tensor, cos: Tensor, sin: Tensor, head_dim: int, heads: int | None = None) -> Tensor:
    """x[T, H*D] (rows unit-stride, any row stride), cos / sin[T, D] -> x rotated, [T, H*D] contiguous, in
    one launch: `row_ops.apply_rotary`'s bits (each op rounded where PyTorch's rounds, as `rope_store`).
    `heads`: heads a program, a power of two (None: as many as fill ROPE_LANES; `bench rows` compares)."""
    d = head_dim
    t = x.shape[0]
    if x.dim() != 2 or x.shape[1] % d or cos.shape != (t, d) or sin.shape != (t, d):
        raise ValueError(f"rope_rows: x [T, H*{d}] and cos / sin [T, {d}], got {tuple(x.shape)}, {tuple(cos.shape)}")
    if not (cos.dtype == sin.dtype == x.dtype):
        raise ValueError(f"rope_rows: cos / sin must be in x's dtype {x.dtype}, got {cos.dtype}, {sin.dtype}")
    if x.stride(-1) != 1:
        x = x.contiguous()
    if not (cos.is_contiguous() and sin.is_contiguous()):
        cos, sin = cos.contiguous(), sin.contiguous()
    h = x.shape[1] // d
    out = torch.empty((t, h * d), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    if heads is None:
        heads = min(triton.next_power_of_2(h), max(1, ROPE_LANES // (d // 2)))
    elif heads < 1 or heads & (heads - 1):
        raise ValueError(f"rope_rows: heads a program must be a power of two, got {heads}")
    tensors = (x, cos, sin, out)
    key = None
    if x.is_cuda:
        key = (t, h, d, heads, x.stride(0), x.dtype, x.device.index) + _aligned(*tensors)
    _run(
        _ROPE_ROWS,
        key,
        _rope_rows_kernel,
        (t, triton.cdiv(h, heads)),
        (*tensors, x.stride(0), h),
        dict(D=d, HALF=d // 2, HEADS=heads),
        (0, 1, 2, 3),
        tensors,
        x.device.index or 0,
    )
    return out


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up for gate / up[M, N] (rows unit-stride, any row stride: the halves of one fused
    gate_up projection) -> [M, N] contiguous, the bits of `F.silu(gate) * up`."""
    gate, up = (
        t if t.dim() == 2 and t.stride(-1) == 1 else t.reshape(-1, t.shape[-1]).contiguous() for t in (gate, up)
    )
    m, n = gate.shape
    out = torch.empty((m, n), dtype=gate.dtype, device=gate.device)
    if not out.numel():
        return out
    key = None
    if gate.is_cuda:
        key = (m, n, gate.stride(0), up.stride(0), gate.dtype, gate.device.index, *_aligned(gate, up, out))
    args = (gate, up, out, n, gate.stride(0), up.stride(0))
    meta = dict(BLOCK=SILU_BLOCK, EXPF=gate.is_cuda)
    _run(
        _SILU,
        key,
        _silu_mul_kernel,
        (m, triton.cdiv(n, SILU_BLOCK)),
        args,
        meta,
        (0, 1, 2),
        (gate, up, out),
        gate.device.index or 0,
    )
    return out


_RMS: dict[tuple, launch.Launch] = {}
_ROPE: dict[tuple, launch.Launch] = {}
_ROPE_ROWS: dict[tuple, launch.Launch] = {}
_SILU: dict[tuple, launch.Launch] = {}
