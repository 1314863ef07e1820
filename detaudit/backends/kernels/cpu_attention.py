"""bio's attention on CPU as one compiled kernel (numba; imported only where it is installed).

Each query row is computed alone, from its own query, its position and the cache: the scores of the
keys it can see (each a dot product over D in 16 fp32 lanes, d to lane d % 16 in order, then the
lanes added pairwise: 0+8, 0+4, 0+2, 0+1 ...), their max, then exp(score - max), the row's sum of
them and its weighted sum of values, both in key order, and one division. Nothing depends on how
many rows or keys share the call, so a row has the same bits in prefill (many rows) and decode (one),
in any batch and at any TP size (heads are never split). No fused multiply-add: numba compiles
without fast-math, so every product is rounded, then added.

The cache is read as it is stored: bf16 as its 16 bits (a bf16 is the top half of an fp32), other
dtypes converted to fp32 by the caller. Against the chunked PyTorch-ops path (`fixed.attention`), this
replaces about 60 small ops per layer and step with one call; the backend's description names the
kernel, so runs made with and without it are never merged as one.
"""

from __future__ import annotations

import numba
import numpy as np

LANES = 16


@numba.njit(nogil=True, cache=True, inline="always")
def _dot(q, k):
    """sum q[i] * k[i] as the module docstring says: lane i % 16 adds its products in order (16 scalar
    accumulators, which LLVM keeps in one vector register), then the lanes pairwise."""
    zero = np.float32(0)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = a10 = a11 = a12 = a13 = a14 = a15 = zero
    d = q.shape[0]
    full = d - d % LANES
    for b in range(0, full, LANES):
        a0 += q[b + 0] * k[b + 0]
        a1 += q[b + 1] * k[b + 1]
        a2 += q[b + 2] * k[b + 2]
        a3 += q[b + 3] * k[b + 3]
        a4 += q[b + 4] * k[b + 4]
        a5 += q[b + 5] * k[b + 5]
        a6 += q[b + 6] * k[b + 6]
        a7 += q[b + 7] * k[b + 7]
        a8 += q[b + 8] * k[b + 8]
        a9 += q[b + 9] * k[b + 9]
        a10 += q[b + 10] * k[b + 10]
        a11 += q[b + 11] * k[b + 11]
        a12 += q[b + 12] * k[b + 12]
        a13 += q[b + 13] * k[b + 13]
        a14 += q[b + 14] * k[b + 14]
        a15 += q[b + 15] * k[b + 15]
    b = full
    rem = d - full
    if rem > 0:
        a0 += q[b + 0] * k[b + 0]
    if rem > 1:
        a1 += q[b + 1] * k[b + 1]
    if rem > 2:
        a2 += q[b + 2] * k[b + 2]
    if rem > 3:
        a3 += q[b + 3] * k[b + 3]
    if rem > 4:
        a4 += q[b + 4] * k[b + 4]
    if rem > 5:
        a5 += q[b + 5] * k[b + 5]
    if rem > 6:
        a6 += q[b + 6] * k[b + 6]
    if rem > 7:
        a7 += q[b + 7] * k[b + 7]
    if rem > 8:
        a8 += q[b + 8] * k[b + 8]
    if rem > 9:
        a9 += q[b + 9] * k[b + 9]
    if rem > 10:
        a10 += q[b + 10] * k[b + 10]
    if rem > 11:
        a11 += q[b + 11] * k[b + 11]
    if rem > 12:
        a12 += q[b + 12] * k[b + 12]
    if rem > 13:
        a13 += q[b + 13] * k[b + 13]
    if rem > 14:
        a14 += q[b + 14] * k[b + 14]
    a0, a1, a2, a3, a4, a5, a6, a7 = a0 + a8, a1 + a9, a2 + a10, a3 + a11, a4 + a12, a5 + a13, a6 + a14, a7 + a15
    a0, a1, a2, a3 = a0 + a4, a1 + a5, a2 + a6, a3 + a7
    a0, a1 = a0 + a2, a1 + a3
    return a0 + a1


@numba.njit(nogil=True, cache=True, inline="always")
def load(src, bf16, bits):
    """src[D] into the fp32 buffer `bits.view(float32)`: bf16 stored as int16 bits (the top half of an
    fp32, so exact), or any value converted."""
    if bf16:
        for i in range(src.shape[0]):
            bits[i] = np.uint32(np.uint16(src[i])) << 16
    else:
        row = bits.view(np.float32)
        for i in range(src.shape[0]):
            row[i] = src[i]


@numba.njit(nogil=True, cache=True, inline="always")
def _sees(j, p, window):
    """Whether a query at position p sees key j (window 0: every key up to p)."""
    return j <= p and (window == 0 or j > p - window)


@numba.njit(nogil=True, cache=True)
def attend(qs, pos, k, v, bf16, window, out):  # pragma: no cover (compiled)
    """qs[G, R, D] fp32 (scaled queries), pos[G, R] int64, k / v [G, L, D] (uint16 bf16 bits when
    `bf16`, as int16, else fp32), window (0: none; else key j visible iff pos - window < j <= pos),
    out[G, R, D] fp32."""
    g_count, rows, d = qs.shape
    length = k.shape[1]
    scores = np.empty((rows, length), dtype=np.float32)
    row_max = np.empty(rows, dtype=np.float32)
    sums = np.empty(rows, dtype=np.float32)
    bits = np.empty(d, dtype=np.uint32)
    key = bits.view(np.float32)  # the key or value row `load` wrote
    for g in range(g_count):
        first = length
        last = -1
        for r in range(rows):
            p = pos[g, r]
            lo = p - window + 1 if window > 0 else 0
            first = min(first, max(lo, 0))
            last = max(last, min(p, length - 1))
            row_max[r] = -np.inf
            sums[r] = 0
            out[g, r, :] = 0
        for j in range(first, last + 1):
            load(k[g, j], bf16, bits)
            for r in range(rows):
                if not _sees(j, pos[g, r], window):
                    continue
                s = _dot(qs[g, r], key)
                scores[r, j] = s
                if s > row_max[r]:
                    row_max[r] = s
        for j in range(first, last + 1):
            load(v[g, j], bf16, bits)
            for r in range(rows):
                if not _sees(j, pos[g, r], window):
                    continue
                e = np.float32(np.exp(scores[r, j] - row_max[r]))
                sums[r] += e
                for i in range(d):
                    out[g, r, i] += e * key[i]
        for r in range(rows):
            for i in range(d):
                out[g, r, i] /= sums[r]
