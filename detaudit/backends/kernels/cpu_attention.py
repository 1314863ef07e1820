"""bio's attention on CPU as one compiled kernel (numba; imported only where it is installed).

Each query row is computed alone, from its own query, its position and the cache: the scores of the
keys it can see (each a dot product over D in 16 fp32 lanes, d to lane d % 16 in order, then the
lanes added pairwise: 0+8, 0+4, 0+2, 0+1 ...), their max, then exp(score - max), the row's sum of
them and its weighted sum of values, both in key order, and one division. Nothing depends on how
many rows or keys share the call, so a row has the same bits in prefill (many rows) and decode (one),
in any batch and at any TP size (heads are never split). A score lane's and a weighted value's steps
are fused multiply-adds (a * b + c rounded once: `cpu_lanes.fma`, `_fused_dot`); every other operation
is an IEEE fp32 one of its own (numba compiles without fast-math, so nothing is contracted or reordered).

Vectorized within a dot product: where D is a multiple of 16 and the rows contiguous, a score's 16 lanes
are one LLVM vector and a row's weighted values 16 elements at a time (`cpu_lanes`: the same operations in
the same order), read from the cache as it is stored. What rows share is done once for them, never
changing a row's operations: the query rows at one position (a KV head's query heads, up to RUN) read
each value row once for all their weighted sums, and each key once for all their scores where AVX-512's
registers hold the accumulators (`cpu_lanes.SCORE_ROWS`), and run their max and sum loops side by side
(`_run`); where a KV head has many query rows (prefill) its bf16 keys and values are widened to fp32 once
(exact), not in every row's loops (`WIDEN_ROWS`). The rows' chains are independent, so the core overlaps
their latencies. Where D is not a multiple of 16, or a row is strided, the same operations run
one lane at a time. exp is a polynomial in IEEE fp32 adds and multiplies (`exp_shifted`), so a vector
lane and the scalar remainder give the same bits; it replaced libm's scalar expf (other bits: the
description says which exp, so earlier runs' cells are not merged with these).

The cache is read as it is stored (decode), or widened as above: bf16 as its 16 bits (a bf16 is the top
half of an fp32), other dtypes converted to fp32 by the caller. Against the chunked PyTorch-ops path
(`fixed.attention`), this replaces about 60 small ops per layer and step with one call; the backend's
description names the kernel, so runs made with and without it are never merged as one.
"""

from __future__ import annotations

import numba
import numpy as np

from detaudit.backends.kernels import cpu_lanes, numba_cache

numba_cache.fresh()  # before any cache is loaded: a caller's cache holds its callees' code

LANES = cpu_lanes.LANES  # a dot product's lanes, on the vector path and the scalar one


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _dot(q, k):
    """sum q[i] * k[i] in 16 lanes: lane i % 16 adds its products in order, each product rounded, then the
    lanes pairwise (RMSNorm's sum of squares, `cpu_rows`; 16 scalar accumulators, which LLVM leaves
    scalar). The attention's scores take the same order with fused steps: `_fused_dot`."""
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
def _fused_dot(q, k, lanes):  # pragma: no cover (compiled)
    """A score, q . k, as the module docstring says: lane i % 16 = q[i] * k[i] + lane, fused, in order from
    +0, then the lanes pairwise (0+8, 0+4, 0+2, 0+1). `lanes`: 16 fp32 of scratch. The scalar form of
    `cpu_lanes`' dots (D not a multiple of 16, or strided rows): the same operations, so the same bits."""
    lanes[:] = 0
    for i in range(q.shape[0]):
        lane = i % LANES
        lanes[lane] = cpu_lanes.fma(q[i], k[i], lanes[lane])
    width = LANES // 2
    while width > 0:
        for lane in range(width):
            lanes[lane] += lanes[lane + width]
        width //= 2
    return lanes[0]


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


RUN = cpu_lanes.ROWS  # query rows whose max and sum (four independent chains) and weighted sums run side by side
# from this many query rows a KV head (prefill; decode's query heads of a KV head) a bf16 cache's keys and
# values are widened to fp32 once for them, not in every row's loops: the same values, so the same bits
WIDEN_ROWS = 8


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _scores(qs, n, k, bf16, lanes, blocks, lo, hi, scores, key_bits):  # pragma: no cover (compiled)
    """scores[i, j] = `_fused_dot`(qs[i], k[j]) for rows i < n and keys lo..hi: four keys at a time for up
    to SCORE_ROWS rows in 16-lane vector code (`cpu_lanes`, each key read once for them) where `lanes`, else
    one lane at a time: the same bits."""
    key = key_bits.view(np.float32)
    quads = lo + (hi + 1 - lo) // 4 * 4 if lanes else lo  # keys lo .. quads - 1 four at a time
    step = k.strides[0]
    q_at, q_step, at, at_step = qs.ctypes.data, qs.strides[0], scores.ctypes.data, scores.strides[0]
    for first in range(0, n, cpu_lanes.SCORE_ROWS):
        rows = min(cpu_lanes.SCORE_ROWS, n - first)
        q_first, at_first = q_at + first * q_step, at + first * at_step
        for j in range(lo, quads, 4):
            key_at = k.ctypes.data + j * step
            if bf16:
                cpu_lanes.dots4_bf16(q_first, q_step, key_at, step, blocks, at_first + 4 * j, at_step, rows)
            else:
                cpu_lanes.dots4_f32(q_first, q_step, key_at, step, blocks, at_first + 4 * j, at_step, rows)
    for j in range(quads, hi + 1):
        if not lanes:
            load(k[j], bf16, key_bits)  # once for the rows
        for i in range(n):
            if not lanes:
                scores[i, j] = _fused_dot(qs[i], key, key[qs.shape[1] :])
            elif bf16:
                scores[i, j] = cpu_lanes.dot_bf16(q_at + i * q_step, k.ctypes.data + j * step, blocks)
            else:
                scores[i, j] = cpu_lanes.dot_f32(q_at + i * q_step, k.ctypes.data + j * step, blocks)


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _run(qs, n, k, v, bf16, lo, hi, scores, exp_bits, key_bits, out):  # pragma: no cover (compiled)
    """Query rows qs[0..n-1] (n <= RUN), which see the same keys lo..hi of k / v [L, D]: for each, its
    scores (`_fused_dot` each), their max, exp(score - max) in place, their sum in key order, out[i] = the
    weighted sum of values in key order divided by it. The rows' max and sum loops run as RUN chains side
    by side (a row past n re-reads row 0's scores, and its result is dropped), as do their scores and
    weighted sums (`cpu_lanes`, each key and value read once for the rows): each chain is one row's
    operations in key order, so a row's bits are the ones it has alone, and the core overlaps the chains'
    latencies. 16-lane vector code where D is a multiple of 16 and the elements of every row contiguous,
    else the same operations one lane at a time: the same bits."""
    d = qs.shape[1]
    item = 2 if bf16 else 4  # the lanes read int16 bf16 bits or fp32, nothing else
    contiguous = qs.strides[1] == 4 and out.strides[1] == 4 and k.strides[1] == item and v.strides[1] == item
    lanes = d % LANES == 0 and contiguous and k.itemsize == item and v.itemsize == item
    blocks = d // LANES
    key = key_bits.view(np.float32)
    _scores(qs, n, k, bf16, lanes, blocks, lo, hi, scores, key_bits)
    s0, s1 = scores[0], scores[1 if n > 1 else 0]
    s2, s3 = scores[2 if n > 2 else 0], scores[3 if n > 3 else 0]
    m0 = m1 = m2 = m3 = np.float32(-np.inf)
    for j in range(lo, hi + 1):
        if s0[j] > m0:
            m0 = s0[j]
        if s1[j] > m1:
            m1 = s1[j]
        if s2[j] > m2:
            m2 = s2[j]
        if s3[j] > m3:
            m3 = s3[j]
    for i in range(n):
        m = m0 if i == 0 else (m1 if i == 1 else (m2 if i == 2 else m3))
        exp_shifted(scores[i, lo : hi + 1], m, exp_bits)
    t0 = t1 = t2 = t3 = np.float32(0)
    for j in range(lo, hi + 1):
        t0 += s0[j]
        t1 += s1[j]
        t2 += s2[j]
        t3 += s3[j]
    out[:n] = 0
    if not lanes:
        for j in range(lo, hi + 1):
            load(v[j], bf16, key_bits)  # once for the rows, as in the vector code
            for i in range(n):
                row, w = out[i], scores[i, j]
                for c in range(d):
                    row[c] = cpu_lanes.fma(w, key[c], row[c])
    elif bf16:  # the rows' weighted sums in one pass over the values (each key's read once for them)
        cpu_lanes.weighted_bf16(*_weighted_args(out, scores, v, lo, hi, blocks), n)
    else:
        cpu_lanes.weighted_f32(*_weighted_args(out, scores, v, lo, hi, blocks), n)
    for i in range(n):
        total = t0 if i == 0 else (t1 if i == 1 else (t2 if i == 2 else t3))
        row = out[i]
        for c in range(d):
            row[c] /= total


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _weighted_args(out, scores, v, lo, hi, blocks):  # pragma: no cover (compiled)
    """`cpu_lanes`' weighted sums' addresses and strides for the rows of out and scores."""
    return (
        out.ctypes.data,
        out.strides[0],
        scores.ctypes.data,
        scores.strides[0],
        v.ctypes.data,
        v.strides[0],
        lo,
        hi,
        blocks,
    )


@numba.njit(nogil=True, cache=True, error_model="numpy")
def attend(qs, pos, k, v, bf16, window, out):  # pragma: no cover (compiled)
    """qs[G, R, D] fp32 (scaled queries), pos[G, R] int64, k / v [G, L, D] (uint16 bf16 bits when
    `bf16`, as int16, else fp32), window (0: none; else key j visible iff pos - window < j <= pos),
    out[G, R, D] fp32."""
    g_count, rows, d = qs.shape
    length = k.shape[1]
    scores = np.empty((RUN, length), dtype=np.float32)
    exp_bits = np.empty(length, dtype=np.int32)
    key_bits = np.empty(d + LANES, dtype=np.uint32)  # a key's D values, then `_fused_dot`'s 16 lanes
    wide = bf16 and rows >= WIDEN_ROWS
    kw = np.empty((length if wide else 0, d), dtype=np.float32)
    vw = np.empty_like(kw)
    for g in range(g_count):
        if wide:  # the keys any row sees, widened once for all the rows
            seen = 0
            for r in range(rows):
                seen = max(seen, min(pos[g, r], length - 1) + 1)
            _widen(k[g], seen, kw)
            _widen(v[g], seen, vw)
        r = 0
        while r < rows:  # runs of up to RUN consecutive rows at one position (a KV head's query heads)
            p = pos[g, r]
            n = 1
            while n < RUN and r + n < rows and pos[g, r + n] == p:
                n += 1
            lo = max(p - window + 1 if window > 0 else 0, 0)
            hi = max(min(p, length - 1), lo - 1)  # a row that sees no key (p < 0): an empty range, out 0 / 0
            q, o = qs[g, r : r + n], out[g, r : r + n]
            if wide:
                _run(q, n, kw, vw, False, lo, hi, scores, exp_bits, key_bits, o)
            else:
                _run(q, n, k[g], v[g], bf16, lo, hi, scores, exp_bits, key_bits, o)
            r += n


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _widen(bits, n, out):  # pragma: no cover (compiled)
    """out[:n] = the bf16 rows bits[:n] (int16 bits) as fp32: exact, the top half of each fp32."""
    wide = out.view(np.uint32)
    for j in range(n):
        for c in range(bits.shape[1]):
            wide[j, c] = np.uint32(np.uint16(bits[j, c])) << 16


numba_cache.one_compiler(globals())  # after every kernel above: one process compiles, the others load
