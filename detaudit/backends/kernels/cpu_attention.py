"""bio's attention on CPU as one compiled kernel (numba; imported only where it is installed).

Each query row is computed alone, from its own query, its position and the cache: the scores of the
keys it can see (each a dot product over D in 16 fp32 lanes, d to lane d % 16 in order, then the
lanes added pairwise: 0+8, 0+4, 0+2, 0+1 ...), their max, then exp(score - max), the row's sum of
them and its weighted sum of values, both in key order, and one division. Nothing depends on how
many rows or keys share the call, so a row has the same bits in prefill (many rows) and decode (one),
in any batch and at any TP size (heads are never split). No fused multiply-add: numba compiles
without fast-math, so every product is rounded, then added.

Vectorized within a dot product: where D is a multiple of 16 and the rows contiguous, a score's 16
lanes are one LLVM vector and a row's weighted values 16 elements at a time (`cpu_lanes`: the same
additions in the same order), read from the cache as it is stored, no copy (LLVM leaves `_dot`'s 16
scalar accumulators scalar). Otherwise the same operations run one lane at a time. exp is a polynomial in IEEE
fp32 adds and multiplies (`exp_shifted`), so a vector lane and the scalar remainder give the same bits;
it replaced libm's scalar expf (other bits: the description says which exp, so earlier runs' cells are
not merged with these).

The cache is read as it is stored: bf16 as its 16 bits (a bf16 is the top half of an fp32), other
dtypes converted to fp32 by the caller. Against the chunked PyTorch-ops path (`fixed.attention`), this
replaces about 60 small ops per layer and step with one call; the backend's description names the
kernel, so runs made with and without it are never merged as one.
"""

from __future__ import annotations

import numba
import numpy as np

from detaudit.backends.kernels import cpu_lanes, numba_cache

numba_cache.fresh()  # before any cache is loaded: a caller's cache holds its callees' code

LANES = cpu_lanes.LANES  # a dot product's lanes, on the vector path and the scalar one


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _dot(q, k):
    """sum q[i] * k[i] as the module docstring says: lane i % 16 adds its products in order (16 scalar
    accumulators, which LLVM leaves scalar: `cpu_lanes` is the vector form), then the lanes pairwise."""
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


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
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


# exp, Cephes' expf (S. Moshier) in IEEE fp32 adds and multiplies: x = n ln2 + r, |r| <= ln2 / 2 (ln2 in
# two parts, n * LN2_HI exact), exp(r) by a degree-7 polynomial, times 2^n built from n's bits
LOG2E = np.float32(1.44269504088896341)
LN2_HI = np.float32(0.693359375)
LN2_LO = np.float32(-2.12194440e-4)
P0, P1, P2 = np.float32(1.9875691500e-4), np.float32(1.3981999507e-3), np.float32(8.3334519073e-3)
P3, P4, P5 = np.float32(4.1665795894e-2), np.float32(1.6666665459e-1), np.float32(5.0000001201e-1)
ONE = np.float32(1)
X_MIN = np.float32(-88)  # x is raised to this (n = -127: 0), keeping n far inside MAGIC's range
MAGIC = np.float32(12582912)  # 1.5 * 2^23: x + MAGIC rounds x to an integer, held in the low bits
MAGIC_BITS = np.int32(0x4B400000)  # MAGIC's bits: bits(n + MAGIC) - MAGIC_BITS = n
N_MIN = np.int32(-126)  # the least n whose 2^n is a normal fp32; below it the result is 0


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def exp_shifted(row, shift, bits):
    """row[j] = exp(row[j] - shift) for every j, by the same IEEE fp32 operations for every element.

    No branch, no library call, no FMA (numba compiles without fast-math, so no contraction): LLVM
    vectorizes the loops (their index runs from 0, so numba's negative-index wraparound folds away),
    and an element's bits are the same in a vector lane or in the scalar remainder, so they never
    depend on the row's length or on where the element sits. `bits` (int32, at least as long as the
    row) holds each element's n + MAGIC, then its 2^n. exp(x) for x below about -87.7 (n < -126) is
    0, as fp32's flush-to-zero would make most of those results; NaN stays NaN."""
    scale = bits.view(np.float32)
    for j in range(row.shape[0]):
        x = row[j] - shift
        if x < X_MIN:
            x = X_MIN
        t = x * LOG2E + MAGIC  # round(x / ln2) + MAGIC, exactly
        n = t - MAGIC
        r = x - n * LN2_HI
        r = r - n * LN2_LO
        p = ((((P0 * r + P1) * r + P2) * r + P3) * r + P4) * r + P5
        row[j] = p * (r * r) + r + ONE
        scale[j] = t
    for j in range(row.shape[0]):
        n = bits[j] - MAGIC_BITS
        bits[j] = (n + np.int32(127)) << np.int32(23) if n >= N_MIN else np.int32(0)
    for j in range(row.shape[0]):
        row[j] = row[j] * scale[j]


@numba.njit(nogil=True, cache=True, error_model="numpy")
def exp_rows(x, out):  # pragma: no cover (compiled)
    """out[i, :] = exp(x[i, :]) by `exp_shifted` (shift 0), for tests: the elements of one row are
    vector lanes or the scalar remainder depending on the row's length."""
    bits = np.empty(x.shape[1], dtype=np.int32)
    for i in range(x.shape[0]):
        out[i, :] = x[i, :]
        exp_shifted(out[i], np.float32(0), bits)


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _row(q, k, v, bf16, lo, hi, scores, exp_bits, key_bits, out):  # pragma: no cover (compiled)
    """One query row q[D] over keys lo..hi of k / v [L, D]: its scores (`_dot` each), their max,
    exp(score - max) in place, their sum in key order, out[D] = the weighted sum of values in key order
    divided by it. 16-lane vector code (`cpu_lanes`) where D is a multiple of 16 and every row contiguous,
    else the same operations one lane at a time: the same bits."""
    d = q.shape[0]
    item = 2 if bf16 else 4  # the lanes read int16 bf16 bits or fp32, nothing else
    contiguous = q.strides[0] == 4 and out.strides[0] == 4 and k.strides[1] == item and v.strides[1] == item
    lanes = d % LANES == 0 and contiguous and k.itemsize == item and v.itemsize == item
    blocks = d // LANES
    key = key_bits.view(np.float32)
    quads = lo + (hi + 1 - lo) // 4 * 4 if lanes else lo  # keys lo .. quads - 1 four at a time
    step = k.strides[0]
    for j in range(lo, quads, 4):
        if bf16:
            cpu_lanes.dots4_bf16(q.ctypes.data, k.ctypes.data + j * step, step, blocks, scores.ctypes.data + 4 * j)
        else:
            cpu_lanes.dots4_f32(q.ctypes.data, k.ctypes.data + j * step, step, blocks, scores.ctypes.data + 4 * j)
    for j in range(quads, hi + 1):
        if not lanes:
            load(k[j], bf16, key_bits)
            scores[j] = _dot(q, key)
        elif bf16:
            scores[j] = cpu_lanes.dot_bf16(q.ctypes.data, k.ctypes.data + j * step, blocks)
        else:
            scores[j] = cpu_lanes.dot_f32(q.ctypes.data, k.ctypes.data + j * step, blocks)
    m = np.float32(-np.inf)
    for j in range(lo, hi + 1):
        if scores[j] > m:
            m = scores[j]
    exp_shifted(scores[lo : hi + 1], m, exp_bits)
    total = np.float32(0)
    for j in range(lo, hi + 1):
        total += scores[j]
    out[:] = 0
    if not lanes:
        for j in range(lo, hi + 1):
            load(v[j], bf16, key_bits)
            e = scores[j]
            for i in range(d):
                out[i] += e * key[i]
    elif bf16:
        cpu_lanes.weighted_bf16(out.ctypes.data, scores.ctypes.data, v.ctypes.data, v.strides[0], lo, hi, blocks)
    else:
        cpu_lanes.weighted_f32(out.ctypes.data, scores.ctypes.data, v.ctypes.data, v.strides[0], lo, hi, blocks)
    for i in range(d):
        out[i] /= total


@numba.njit(nogil=True, cache=True, error_model="numpy")
def attend(qs, pos, k, v, bf16, window, out):  # pragma: no cover (compiled)
    """qs[G, R, D] fp32 (scaled queries), pos[G, R] int64, k / v [G, L, D] (uint16 bf16 bits when
    `bf16`, as int16, else fp32), window (0: none; else key j visible iff pos - window < j <= pos),
    out[G, R, D] fp32."""
    g_count, rows, d = qs.shape
    length = k.shape[1]
    scores = np.empty(length, dtype=np.float32)
    exp_bits = np.empty(length, dtype=np.int32)
    key_bits = np.empty(d, dtype=np.uint32)
    for g in range(g_count):
        for r in range(rows):
            p = pos[g, r]
            lo = max(p - window + 1 if window > 0 else 0, 0)
            hi = max(min(p, length - 1), lo - 1)  # a row that sees no key (p < 0): an empty range, out 0 / 0
            _row(qs[g, r], k[g], v[g], bf16, lo, hi, scores, exp_bits, key_bits, out[g, r])
