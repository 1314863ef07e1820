"""The GPU RMSNorm kernel as it was before it ran several rows a program and read heads through strides
(main at 0135787): one program per row of x[M, N] (rows copied to a plain layout first). The backends'
RMSNorm is defined by that kernel's arithmetic, so `fused.rms_norm` is checked bitwise against it, on a
GPU (tests/gpu/test_fused.py) and under the Triton interpreter (`triton_checks.py`). Kept verbatim but
for the launch: only the rows a program and the addressing of the new kernel may differ."""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

MAX_BLOCK = 1024

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


def rms_norm(x: Tensor, weight: Tensor, eps: float, delta: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """x[M, N] (and delta[M, N]) as plain contiguous rows -> (normed, the residual sum or None)."""
    x = x.reshape(-1, x.shape[-1]).contiguous()
    d = delta.reshape(-1, x.shape[-1]).contiguous() if delta is not None else x
    y = torch.empty_like(x)
    s = torch.empty_like(x) if delta is not None else y
    n = x.shape[1]
    inv_n = float(torch.tensor(1.0, dtype=torch.float32) / n)
    if x.shape[0]:
        _rms_norm_kernel[(x.shape[0],)](
            x,
            d,
            s,
            y,
            weight,
            n,
            x.stride(0),
            d.stride(0),
            s.stride(0),
            y.stride(0),
            inv_n,
            float(eps),
            HAS_DELTA=delta is not None,
            BLOCK=min(MAX_BLOCK, triton.next_power_of_2(n)),
            num_warps=4,
            enable_fp_fusion=False,
        )
    return y, (s if delta is not None else None)
