"""What every Triton product kernel shares (`triton_mm`, `triton_swap`, `grouped_mm`): `span`, the one
reduction order of an output element (a leaf, or all of K), and `carry`, the tree matmul's compile-time
carry of finished leaves up TBIK's tree."""

from __future__ import annotations

try:  # optional: GPU kernels and the interpreter tests only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

carry = span = None  # without triton: nothing calls them

if triton is not None:

    @triton.jit
    def carry(j: tl.constexpr, acc, s0, s1, s2, node):
        """Carry finished leaf j up the complete binary tree (binary-counter order; j is a compile-time
        constant, so the branches vanish and the pending nodes s0..s2 live in registers)."""
        if j % 2 == 0:
            s0 = acc
            node = acc
        else:
            node = s0 + acc  # level 1
            if j % 4 == 1:
                s1 = node
            else:
                node = s1 + node  # level 2
                if j % 8 == 3:
                    s2 = node
                else:
                    node = s2 + node  # level 3
        return s0, s1, s2, node

    @triton.jit
    def span(
        x_ptr,
        w_ptr,
        offs_m,
        M,
        cols,
        start,
        length,
        sxm,
        sxk,
        swn,
        swk,
        EVEN: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        MASK_M: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """fp32 x[rows, start:start+length] @ w[cols, start:start+length]^T, accumulated sequentially in
        BLOCK_K steps from zero: the one reduction order of every output element (a leaf, or all of K).
        Rows past M are never stored, so what they hold does not matter: they re-read valid rows
        (offs_m % M, no mask), or with MASK_M they are not read at all (zeros; at a few rows in a
        64-row tile that saves most of x's traffic)."""
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + (offs_m % M)[:, None] * sxm + (start + offs_k)[None, :] * sxk
        row_ok = (offs_m < M)[:, None]
        b_ptrs = w_ptr + (start + offs_k)[:, None] * swk + cols[None, :] * swn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(length, BLOCK_K)):
            if EVEN:
                if MASK_M:
                    a = tl.load(a_ptrs, mask=row_ok, other=0.0)
                else:
                    a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                left = length - kk * BLOCK_K
                if MASK_M:
                    a = tl.load(a_ptrs, mask=(offs_k[None, :] < left) & row_ok, other=0.0)
                else:
                    a = tl.load(a_ptrs, mask=offs_k[None, :] < left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < left, other=0.0)
            if UPCAST:  # the CPU interpreter cannot multiply bf16 (numpy has none); bf16 x bf16 is exact in fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * sxk
            b_ptrs += BLOCK_K * swk
        return acc
