"""Row sums on GPU (RMSNorm, log-softmax, the attention fallback's denominators): one program per row
adds the whole row in a fixed order (BLOCK-wide fp32 lanes over the row in order, then one tree across
the lanes), so a row's sum depends on nothing but the row. Replaces the fixed-shape product with a ones
matrix, which at a few rows put a 151936-long row into one program's K loop."""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.backends.kernels import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK = 1024

if triton is not None:

    @triton.jit
    def _row_sum_kernel(x_ptr, out_ptr, N, stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            idx = start + offs
            acc += tl.load(x_ptr + row * stride + idx, mask=idx < N, other=0.0).to(tl.float32)
        tl.store(out_ptr + row, tl.sum(acc, 0))


def row_sum(x2: Tensor) -> Tensor:
    """fp32 sums of the rows of x2[M, N] -> [M]."""
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    out = torch.empty(x2.shape[0], dtype=torch.float32, device=x2.device)
    if not x2.shape[0]:
        return out
    key = None
    if x2.is_cuda:  # a kept launch per plan key (see `launch`)
        key = (x2.shape, x2.stride(), x2.dtype, x2.device.index, x2.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
        plan = _PLANS.get(key)
        if plan is not None:
            plan(x2.device.index, x2, out)
            return out
    first = launch.Launch.first(_row_sum_kernel, (x2.shape[0],), (x2, out, x2.shape[1], x2.stride(0)),
                                dict(BLOCK=BLOCK, num_warps=4), slots=(0, 1))
    if first is not None and key is not None:
        launch.cache_put(_PLANS, key, first)
    return out


_PLANS: dict[tuple, launch.Launch] = {}


# ---- fused RMSNorm (bio): the same bits as bio's op-by-op RMSNorm, in one launch

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, N, sx, so, inv_n, eps, BLOCK: tl.constexpr):
        """bio's RMSNorm of one row, operation for operation: the sum of squares as `_row_sum_kernel`
        adds the fp32 squares (the same BLOCK lanes over the row in order, then the same tree across
        them: both kernels load fp32 rows, so the lanes hold the same elements), the mean as torch's
        division by a CPU scalar computes it (times the fp32 reciprocal), + eps, rsqrt, x * r rounded to
        the model dtype, then * weight rounded again. Launched without FMA contraction (every product
        and sum rounded on its own, as the separate kernels round them)."""
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], tl.float32)
        for start in range(0, N, BLOCK):
            idx = start + offs
            xv = tl.load(x_ptr + row * sx + idx, mask=idx < N, other=0.0).to(tl.float32)
            acc += xv * xv
        r = tl.math.rsqrt(tl.sum(acc, 0) * inv_n + eps)
        for start in range(0, N, BLOCK):
            idx = start + offs
            xv = tl.load(x_ptr + row * sx + idx, mask=idx < N, other=0.0).to(tl.float32)
            y = (xv * r).to(out_ptr.dtype.element_ty)
            wv = tl.load(w_ptr + idx, mask=idx < N, other=0.0)
            o = (y.to(tl.float32) * wv.to(tl.float32)).to(out_ptr.dtype.element_ty)
            tl.store(out_ptr + row * so + idx, o, mask=idx < N)


def _inv(n: int) -> float:
    """1 / n in fp32, as torch's CUDA division by a CPU scalar computes it (then multiplies)."""
    return float(torch.tensor(1.0, dtype=torch.float32) / torch.tensor(float(n), dtype=torch.float32))


def rms_norm(xf: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """xf[M, N] fp32 (contiguous rows), weight[N] of `out_dtype` -> [M, N] `out_dtype`: bio's RMSNorm
    (see `_rms_norm_kernel`) in one launch."""
    out = torch.empty(xf.shape, dtype=out_dtype, device=xf.device)
    if not xf.shape[0]:
        return out
    key = (xf.shape, xf.stride(), weight.stride(), out_dtype, float(eps), xf.device.index,
           xf.data_ptr() % 16 == 0, weight.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
    plan = _RMS_PLANS.get(key)
    if plan is not None:
        plan(xf.device.index, xf, weight, out)
        return out
    n = xf.shape[1]
    first = launch.Launch.first(_rms_norm_kernel, (xf.shape[0],),
                                (xf, weight, out, n, xf.stride(0), out.stride(0), _inv(n), float(eps)),
                                dict(BLOCK=BLOCK, num_warps=4, enable_fp_fusion=False), slots=(0, 1, 2))
    if first is not None:
        launch.cache_put(_RMS_PLANS, key, first)
    return out


_RMS_PLANS: dict[tuple, launch.Launch] = {}
