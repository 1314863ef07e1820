"""The compiled call loop of `cpu_calls` (imported only where numba is installed).

The kernel is bound by name (`SYMBOL`, given its address in this process by `bind` before the first
call), not by address, so numba can cache the compiled loop on disk: later processes load it in
about 10 ms instead of compiling it again. Pointers travel as int64 (the same registers on x86-64), the
two C++ bools as uint8 0 / 1 (a C++ bool is one byte)."""

from __future__ import annotations

import llvmlite.binding as llvm
import numba
from numba import types

SYMBOL = "detaudit_cpu_brgemm_bf16"
_SIG = types.void(*([types.int64] * 6), types.uint8, types.int64, types.int64, types.int64, types.uint8)
_kernel = types.ExternalFunction(SYMBOL, _SIG)


def bind(addr: int) -> None:
    llvm.add_symbol(SYMBOL, addr)


@numba.njit(nogil=True, cache=True)
def loop(m, n, k, lda, ldb, ldc, table):  # pragma: no cover (compiled)
    for i in range(table.shape[0]):
        _kernel(m, n, k, lda, ldb, ldc, 0, table[i, 0], table[i, 1], table[i, 2], 1)
