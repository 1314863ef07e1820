"""Row sums on GPU (RMSNorm, log-softmax, the attention fallback's denominators): one program per row
adds the whole row in a fixed order (BLOCK-wide fp32 lanes over the row in order, then one tree across
the lanes), so a row's sum depends on nothing but the row. Replaces the fixed-shape product with a ones
matrix, which at a few rows put a 151936-long row into one program's K loop."""

from __future__ import annotations

import torch
from torch import Tensor

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
    if x2.shape[0]:
        _row_sum_kernel[(x2.shape[0],)](x2, out, x2.shape[1], x2.stride(0), BLOCK=BLOCK, num_warps=4)
    return out
