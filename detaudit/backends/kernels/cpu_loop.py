"""The compiled call loop of `cpu_calls` (imported only where numba is installed).

The kernel and brgemm_release are bound by name (`SYMBOL`, `RELEASE`, given their addresses in this
process by `bind` before the first call), not by address, so numba can cache the compiled loop on disk:
later processes load it in about 10 ms instead of compiling it again. Pointers travel as int64 (the
same registers on x86-64), the C++ bools as uint8 0 / 1 (a C++ bool is one byte)."""

from __future__ import annotations

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import types

SYMBOL = "detaudit_cpu_brgemm_bf16"
RELEASE = "detaudit_cpu_brgemm_release"
_SIG = types.void(*([types.int64] * 6), types.uint8, types.int64, types.int64, types.int64, types.uint8)
_kernel = types.ExternalFunction(SYMBOL, _SIG)
_release = types.ExternalFunction(RELEASE, types.void(types.uint8))


def bind(addr: int, release_addr: int) -> None:
    llvm.add_symbol(SYMBOL, addr)
    llvm.add_symbol(RELEASE, release_addr)


@numba.njit(nogil=True, cache=True)
def loop(m, n, k, lda, ldb, ldc, table, release):  # pragma: no cover (compiled)
    """Every call of `table`, then, where `release`, the thread's AMX tiles released (brgemm_release)."""
    for i in range(table.shape[0]):
        _kernel(m, n, k, lda, ldb, ldc, 0, table[i, 0], table[i, 1], table[i, 2], 1)
    if release:
        _release(1)


@numba.njit(nogil=True, cache=True, inline="always")
def _tree_in_place(nodes):  # pragma: no cover (compiled)
    """nodes[G, S] (G a power of two) summed up the tree into nodes[0]: each level adds every node into its
    left sibling, ((n0 + n1) + (n2 + n3)) + ..., `tree.pairwise`'s adds in its pairs."""
    g, size = nodes.shape
    step = 1
    while step < g:
        for j in range(0, g, 2 * step):
            left, right = nodes[j], nodes[j + step]
            for e in range(size):
                left[e] += right[e]
        step *= 2


@numba.njit(nogil=True, cache=True)
def tree_loop(m, n, k, lda, ldb, ldc, table, leaves, out, release):  # pragma: no cover (compiled)
    """The calls of `table` in jobs of `leaves` rows, a job one output block: each leaf's [m, n] product
    into this thread's scratch, the leaves added pairwise ((l0 + l1) + (l2 + l3)) + ... (`tree.pairwise`'s
    adds, in its pairs), the sum stored at element table[job, 2] // 4 of `out` (fp32, rows ldc apart).
    An element's adds do not depend on which elements share a job, so these are `pairwise`'s bits."""
    size = m * n
    scratch = np.empty(leaves * size, dtype=np.float32)
    base = scratch.ctypes.data
    for i in range(0, table.shape[0], leaves):
        for j in range(leaves):
            _kernel(m, n, k, lda, ldb, n, 0, table[i + j, 0], table[i + j, 1], base + j * size * 4, 1)
        _tree_in_place(scratch.reshape(leaves, size))
        c = table[i, 2] // 4
        for r in range(m):
            out[c + r * ldc : c + r * ldc + n] = scratch[r * n : (r + 1) * n]
    if release:
        _release(1)


@numba.njit(nogil=True, cache=True)
def pairwise(leaves, out):  # pragma: no cover (compiled)
    """out = the tree over leaves[G, S] (fp32, G a power of two, at least 2): (l0 + l1) into out's first
    level, then ((l0 + l1) + (l2 + l3)) + ... in place, `tree.pairwise`'s adds in its pairs, so its bits
    (an element's adds never depend on the other elements). out: fp32 [G / 2, S], the sum in out[0]."""
    g, size = leaves.shape
    for j in range(0, g, 2):  # the first level out of place (the leaves stay the caller's)
        left, right, dst = leaves[j], leaves[j + 1], out[j // 2]
        for e in range(size):
            dst[e] = left[e] + right[e]
    _tree_in_place(out)
