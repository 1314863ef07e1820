"""Decode-size products with the operands' roles swapped: out^T[N, M] = w[N, K] @ x[M, K]^T.

At a few rows (a decode step: M = the batch, at most 32), `triton_mm`'s kernel pads the MMA's M side (64
rows on Hopper) with rows that do not exist and streams the weight in narrow column tiles: it keeps few
weight bytes in flight per SM, and on a card with more bandwidth (H200) it gains little of it. Here the
weight's rows fill the MMA's M side (BLOCK_N of them) and the tokens its N side (BLOCK_M = 16 or 32), as
cuBLAS runs these shapes; one program per (column tile, row tile), the weight tile streamed once.

Per output element the reduction is `triton_carry.span`'s, the function every product kernel runs, here
with the operands' roles swapped: one fp32 accumulator from zero, fed the same products in K order,
BLOCK_K columns a step (each MMA instruction adds its 16 K columns to the accumulator; which operand is
the instruction's A does not change the element's terms or their order); in a tree each leaf is
accumulated alone from zero and the leaves are added by the same compile-time carries; the store rounds
once. tests/gpu checks these bits against the other tilings (products at M = 1 to 256 and to 2048, bf16
and fp16, with a wide exponent range; each rank's tree at 7 and 32 rows).
"""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.backends.kernels import launch
from detaudit.backends.kernels.triton_carry import carry, span

try:  # optional: GPU kernels and the interpreter tests only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

if triton is not None:

    @triton.jit
    def _swap_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        M,
        N,
        LEAF,
        sxm,
        sxk,
        swn,
        swk,
        som,
        son,
        NUM_LEAVES: tl.constexpr,
        EVEN: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = offs_n % N  # columns past N re-read valid ones and are never stored
        s0 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        s1 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        s2 = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        node = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for j in tl.static_range(NUM_LEAVES):  # one leaf: the plain product over all of K
            # `span` with the operands' roles swapped: the weight's columns on its M side, the tokens on
            # its N side; token columns past M re-read valid rows and are never stored
            acc = span(
                w_ptr,
                x_ptr,
                cols,
                N,
                offs_m % M,
                j * LEAF,
                LEAF,
                swn,
                swk,
                sxm,
                sxk,
                EVEN,
                PRECISION,
                UPCAST,
                False,
                BLOCK_N,
                BLOCK_M,
                BLOCK_K,
            )
            s0, s1, s2, node = carry(j, acc, s0, s1, s2, node)
        mask = (offs_n < N)[:, None] & (offs_m < M)[None, :]
        out = out_ptr + offs_m[None, :] * som + offs_n[:, None] * son
        tl.store(out, node.to(out_ptr.dtype.element_ty), mask=mask)  # one rounding (RNE) to out's dtype


def first(x: Tensor, w: Tensor, out: Tensor, leaves: int, cfg: dict[str, int]) -> launch.Launch | None:
    """Launch x[M, K] @ w[N, K]^T into out[M, N] (K in `leaves` equal leaves) through the JIT; the plan to
    launch it again (`launch.Launch.first`)."""
    m, k = x.shape
    n = w.shape[0]
    leaf = k // leaves
    bn, bm, bk = cfg["BLOCK_N"], cfg["BLOCK_M"], cfg["BLOCK_K"]
    return launch.Launch.first(
        _swap_kernel,
        (triton.cdiv(n, bn), triton.cdiv(m, bm)),
        (x, w, out, m, n, leaf, *x.stride(), *w.stride(), *out.stride()),
        dict(
            NUM_LEAVES=leaves,
            EVEN=leaf % bk == 0,
            # fp32 operands in IEEE precision, as `triton_mm` (no TF32); bf16 / fp16 ignore it
            PRECISION="ieee" if (x.dtype == torch.float32 or x.device.type == "cpu") else "tf32",
            UPCAST=x.device.type == "cpu",
            BLOCK_N=bn,
            BLOCK_M=bm,
            BLOCK_K=bk,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        ),
        slots=(0, 1, 2),
    )
