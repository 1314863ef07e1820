"""The compiled call loop of `cpu_calls` (imported only where numba is installed).

The kernel and brgemm_release are called through their addresses, passed as int64 with every loop (an
LLVM indirect call built by `_brgemm` / `_release`): nothing is bound by name, so numba caches the
compiled loops on disk (later processes load them in about 10 ms instead of compiling them again) and
code that merely contains a loop (`cpu_team`) compiles in a process with no micro-kernel at all. The C++
bools travel as uint8 0 / 1 (a C++ bool is one byte), pointers as int64 (the same registers on x86-64)."""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from detaudit.backends.kernels import numba_cache
from detaudit.backends.kernels.cpu_rows import _put, _to_bf16, to_bf16

numba_cache.fresh()  # before any cache is loaded: a caller's cache holds its callees' code

_I64, _I8 = ir.IntType(64), ir.IntType(8)
# at::native::cpublas::brgemm(M, N, K, ld_a, ld_b, ld_c, add_C, A, B, C, is_vnni) and brgemm_release(is_vnni)
_KERNEL = ir.FunctionType(ir.VoidType(), [_I64] * 6 + [_I8, _I64, _I64, _I64, _I8])
_RELEASE = ir.FunctionType(ir.VoidType(), [_I8])


@intrinsic
def _brgemm(typingctx, fn, m, n, k, lda, ldb, ldc, a, b, c):
    """The kernel at address `fn`: C = A @ B (add_C false, B in VNNI pairs)."""

    def codegen(context, builder, signature, args):
        zero, one = ir.Constant(_I8, 0), ir.Constant(_I8, 1)
        target = builder.inttoptr(args[0], _KERNEL.as_pointer())
        builder.call(target, [*args[1:7], zero, *args[7:10], one])
        return context.get_dummy_value()

    return types.void(*([types.int64] * 10)), codegen


@intrinsic
def _release(typingctx, fn):
    """brgemm_release(true) at address `fn`: this thread's AMX tiles released."""

    def codegen(context, builder, signature, args):
        builder.call(builder.inttoptr(args[0], _RELEASE.as_pointer()), [ir.Constant(_I8, 1)])
        return context.get_dummy_value()

    return types.void(types.int64), codegen


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _store_bf16(bits, m, n, out16, c, ldc):  # pragma: no cover (compiled)
    """The [m, n] fp32 block whose bits are `bits` rounded to bf16 as torch rounds (`cpu_rows._to_bf16`)
    and stored at element c of out16 (int16 bf16 bits), rows ldc apart."""
    _to_bf16(bits.view(np.float32), bits)
    for r in range(m):
        row = c + r * ldc
        _put(out16[row : row + n], True, bits[r * n : (r + 1) * n])


@numba.njit(nogil=True, cache=True, error_model="numpy")
def loop(kernel, release_at, m, n, k, lda, ldb, ldc, table, out16, release):  # pragma: no cover (compiled)
    """Every call of `table`, then, where `release`, the thread's AMX tiles released (brgemm_release).
    Where out16 has elements, each call's [m, n] product is made in this thread's scratch and stored
    rounded to bf16 at element table[i, 2] // 4 of out16 (int16 bf16 bits, rows ldc apart; the C offsets
    relative to it): the fp32 products never reach memory, and the bits are the fp32 output's cast by
    torch (an element's rounding depends on nothing else)."""
    if out16.shape[0] == 0:
        for i in range(table.shape[0]):
            _brgemm(kernel, m, n, k, lda, ldb, ldc, table[i, 0], table[i, 1], table[i, 2])
    else:
        bits = np.empty(m * n, dtype=np.uint32)
        base = bits.ctypes.data
        for i in range(table.shape[0]):
            _brgemm(kernel, m, n, k, lda, ldb, n, table[i, 0], table[i, 1], base)
            _store_bf16(bits, m, n, out16, table[i, 2] // 4, ldc)
    if release:
        _release(release_at)


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _tree_in_place(nodes, lo, hi):  # pragma: no cover (compiled)
    """Elements lo..hi of nodes[G, S] (G a power of two) summed up the tree into nodes[0]: each level adds
    every node into its left sibling, ((n0 + n1) + (n2 + n3)) + ..., `tree.pairwise`'s adds in its pairs."""
    g = nodes.shape[0]
    step = 1
    while step < g:
        for j in range(0, g, 2 * step):
            left, right = nodes[j], nodes[j + step]
            for e in range(lo, hi):
                left[e] += right[e]
        step *= 2


@numba.njit(nogil=True, cache=True, error_model="numpy")
def tree_loop(kernel, release_at, m, n, k, lda, ldb, ldc, table, leaves, out, out16, release):  # pragma: no cover
    """The calls of `table` in jobs of `leaves` rows, a job one output block: each leaf's [m, n] product
    into this thread's scratch, the leaves added pairwise ((l0 + l1) + (l2 + l3)) + ... (`tree.pairwise`'s
    adds, in its pairs), the sum stored at element table[job, 2] // 4 of `out` (fp32, rows ldc apart), or
    of out16 rounded to bf16 where out16 has elements (as `loop`). An element's adds do not depend on which
    elements share a job, so these are `pairwise`'s bits."""
    size = m * n
    scratch = np.empty(leaves * size, dtype=np.float32)
    base = scratch.ctypes.data
    for i in range(0, table.shape[0], leaves):
        for j in range(leaves):
            _brgemm(kernel, m, n, k, lda, ldb, n, table[i + j, 0], table[i + j, 1], base + j * size * 4)
        _tree_in_place(scratch.reshape(leaves, size), 0, size)
        c = table[i, 2] // 4
        if out16.shape[0] != 0:
            _store_bf16(scratch[:size].view(np.uint32), m, n, out16, c, ldc)
            continue
        for r in range(m):
            out[c + r * ldc : c + r * ldc + n] = scratch[r * n : (r + 1) * n]
    if release:
        _release(release_at)


PAIRWISE_CHUNK = 2048  # `pairwise`'s elements a piece of work (the team's jobs split a tree's elements so)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def pairwise(leaves, out, out16, lo, hi):  # pragma: no cover (compiled)
    """Elements lo..hi of the tree over leaves[G, S] (fp32, G a power of two, at least 2): (l0 + l1) into
    out's first level, then ((l0 + l1) + (l2 + l3)) + ... in place, `tree.pairwise`'s adds in its pairs, so
    its bits (an element's adds never depend on the other elements). out: fp32 [G / 2, S], the sum in
    out[0]; where out16 has elements (int16 bf16 bits, [S]) the sums are rounded to bf16 into it as
    torch's cast rounds (`cpu_rows.to_bf16`), as `tree_loop`'s out16."""
    g = leaves.shape[0]
    for j in range(0, g, 2):  # the first level out of place (the leaves stay the caller's)
        left, right, dst = leaves[j], leaves[j + 1], out[j // 2]
        for e in range(lo, hi):
            dst[e] = left[e] + right[e]
    _tree_in_place(out, lo, hi)
    if out16.shape[0] != 0:
        to_bf16(out[0, lo:hi], out16[lo:hi])


numba_cache.one_compiler(globals())  # after every kernel above: one process compiles, the others load
