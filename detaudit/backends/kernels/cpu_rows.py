"""bio's RMSNorm statistics on CPU as one compiled kernel (numba; imported only where it is installed).

A row's sum of squares is `cpu_attention._dot(x, x)` (16 fp32 lanes, lane i % 16 in order, then the
lanes pairwise; every square rounded, then added), divided by K; then y = x * (1 / sqrt(var + eps)),
all in fp32. A row's bits depend on nothing but the row, so prefill, decode, any batch and any TP size
agree. It replaces the ~12 small ops of the fixed-shape-product path (`bio._rms_norm`) with one call;
the backend's description names it.
"""

from __future__ import annotations

import numba
import numpy as np

from detaudit.backends.kernels.cpu_attention import _dot, load


@numba.njit(nogil=True, cache=True)
def rms_rows(x, bf16, eps, out):  # pragma: no cover (compiled)
    """x[M, K] (bf16 bits as int16 when `bf16`, else fp32) -> out[M, K] fp32 = x * rsqrt(mean(x^2) + eps)."""
    m, k = x.shape
    bits = np.empty(k, dtype=np.uint32)
    row = bits.view(np.float32)
    eps32 = np.float32(eps)
    for r in range(m):
        load(x[r], bf16, bits)
        var = _dot(row, row) / np.float32(k)
        scale = np.float32(1) / np.sqrt(var + eps32)
        for i in range(k):
            out[r, i] = row[i] * scale
