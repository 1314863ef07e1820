"""The tree matmul's compile-time carry, shared by every Triton kernel that adds leaves along TBIK's tree
(`triton_mm`'s tree kernels, `triton_swap`, `grouped_mm`'s weighted sums)."""

from __future__ import annotations

try:  # optional: GPU kernels and the interpreter tests only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

carry = None  # without triton: nothing calls it

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
