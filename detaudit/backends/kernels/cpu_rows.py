"""bio's row kernels on CPU, compiled (numba; imported only where it is installed): RMSNorm, silu * up, the
rotary embedding with its cache writes, the residual add + RMSNorm, the attention's queries scaled and
its output cast in the layers' layout, and the cast to bf16 of the leaves' sums.

RMSNorm: a row's sum of squares is `cpu_attention._dot(x, x)` (16 fp32 lanes, lane i % 16 in order, then
the lanes pairwise; every square rounded, then added), divided by K; then y = x * (1 / sqrt(var + eps)),
all in fp32. silu * up (`silu_mul`): element by element, exp by `cpu_attention.exp_shifted`. A row's bits
depend on nothing but the row, so prefill, decode, any batch and any TP size agree, and its rows can be
spread over threads (`cpu_calls.rows`). They replace the ~12 small ops of the fixed-shape-product path
(`bio._rms_norm`) and silu's six ops with one call each; the backend's description names them.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.extending import intrinsic

from detaudit.backends.kernels import numba_cache
from detaudit.backends.kernels.cpu_attention import _dot, exp_shifted, load

numba_cache.fresh()  # before any cache is loaded: a caller's cache holds its callees' code


@numba.njit(nogil=True, cache=True, error_model="numpy")
def rms_rows(x, bf16, eps, out):  # pragma: no cover (compiled)
    """x[M, K] (bf16 bits as int16 when `bf16`, else fp32) -> out[M, K] fp32 = x * rsqrt(mean(x^2) + eps)."""
    m, k = x.shape
    bits = np.empty(k, dtype=np.uint32)
    row = bits.view(np.float32)
    eps32 = np.float32(eps)
    for r in range(m):
        load(x[r], bf16, bits)
        _normalised(row, eps32, out[r])


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _normalised(row, eps32, out):
    """out[K] = row * (1 / sqrt(mean(row^2) + eps)) in fp32, the sum of squares by `_dot` (RMSNorm's rows:
    `rms_rows` and `add_rms` alike)."""
    k = row.shape[0]
    var = _dot(row, row) / np.float32(k)
    scale = np.float32(1) / np.sqrt(var + eps32)
    for i in range(k):
        out[i] = row[i] * scale


NEG_LIMIT = np.float32(-128)  # past it exp(-|g|) is 0 and silu's numerator g * 0 is -0 (for -inf as well)


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _to_bf16(vals, bits):
    """vals (fp32, its bits in `bits`, uint32) rounded to bf16 in place, to nearest even as torch rounds
    (NaN to 0x7FC0, c10::BFloat16's scalar rule; torch's vector code keeps other NaN bits), held as the top
    half of an fp32."""
    for i in range(vals.shape[0]):
        b = bits[i]
        if vals[i] != vals[i]:
            bits[i] = np.uint32(0x7FC00000)
        else:
            half = np.uint32(16)
            bits[i] = ((b + ((b >> half) & np.uint32(1)) + np.uint32(0x7FFF)) >> half) << half


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _put(dst, bf16, bits):
    """A row of fp32 values (their bits in `bits`; bf16 values where `bf16`) into dst[D]: int16 bf16 bits
    or fp32."""
    if bf16:
        for i in range(dst.shape[0]):
            dst[i] = bits[i] >> np.uint32(16)  # (an int16 store keeps the low 16 bits)
    else:
        row = bits.view(np.float32)
        for i in range(dst.shape[0]):
            dst[i] = row[i]


CAST_CHUNK = 1024  # `to_bf16`'s elements at a time (its buffer stays in the L1 cache)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def to_bf16(x, out):  # pragma: no cover (compiled)
    """x[N] fp32 rounded to bf16 into out[N] (int16 bits) as torch's cast rounds (`_to_bf16`)."""
    bits = np.empty(CAST_CHUNK, dtype=np.uint32)
    vals = bits.view(np.float32)
    n = x.shape[0]
    for lo in range(0, n, CAST_CHUNK):
        hi = min(lo + CAST_CHUNK, n)
        for i in range(hi - lo):
            vals[i] = x[lo + i]
        _to_bf16(vals[: hi - lo], bits[: hi - lo])
        _put(out[lo:hi], True, bits[: hi - lo])


@numba.njit(nogil=True, cache=True, error_model="numpy")
def silu_mul(gate, up, bf16, out):  # pragma: no cover (compiled)
    """out[M, N] = silu(gate) * up, element by element: gate, up [M, N] (any strides; bf16 bits as int16
    when `bf16`, else fp32), out int16 bf16 bits or fp32. silu(g) = g / (1 + e) for g >= 0, g * e / (1 + e)
    below, e = exp(-|g|) by `exp_shifted` (never overflows), in fp32; rounded to bf16 before and after the
    product with up where `bf16`, as `(silu(g).to(bf16) * up)` rounds (NaN: see `_to_bf16`)."""
    m, n = gate.shape
    g_bits = np.empty(n, dtype=np.uint32)
    u_bits = np.empty(n, dtype=np.uint32)
    s_bits = np.empty(n, dtype=np.uint32)
    g, u, s = g_bits.view(np.float32), u_bits.view(np.float32), s_bits.view(np.float32)
    e = np.empty(n, dtype=np.float32)
    exp_bits = np.empty(n, dtype=np.int32)
    one = np.float32(1)
    for r in range(m):
        load(gate[r], bf16, g_bits)
        load(up[r], bf16, u_bits)
        for i in range(n):
            e[i] = -abs(g[i])
        exp_shifted(e, np.float32(0), exp_bits)
        for i in range(n):
            x = g[i]
            num = x
            if x < 0:
                num = (NEG_LIMIT if x < NEG_LIMIT else x) * e[i]
            s[i] = num / (e[i] + one)
        if bf16:
            _to_bf16(s, s_bits)
            for i in range(n):
                s[i] = s[i] * u[i]
            _to_bf16(s, s_bits)
            _put(out[r], True, s_bits)
        else:
            for i in range(n):
                out[r, i] = s[i] * u[i]


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _rotate(src, c, s, bf16, x_bits, a_bits, b_bits, o_bits):
    """HF's rotate half of one head's row src[D] into o_bits: x * cos + rotate_half(x) * sin (rotate_half:
    [-x[D/2:], x[:D/2]]), each product and the sum rounded to bf16 where `bf16` (`_to_bf16`), as the
    PyTorch ops in the model dtype round; fp32 throughout otherwise."""
    load(src, bf16, x_bits)
    x, a, b = x_bits.view(np.float32), a_bits.view(np.float32), b_bits.view(np.float32)
    d = x.shape[0]
    half = d // 2
    for i in range(d):
        a[i] = x[i] * c[i]
        r = -x[i + half] if i < half else x[i - half]
        b[i] = r * s[i]
    if bf16:
        _to_bf16(a, a_bits)
        _to_bf16(b, b_bits)
    o = o_bits.view(np.float32)
    for i in range(d):
        o[i] = a[i] + b[i]
    if bf16:
        _to_bf16(o, o_bits)


# `rope_rows`' argument block (int64): per array, in ROPE_ARRAYS' order, its address then the strides of its
# leading dimensions in elements (its last dimension's is 1: the D values of a head, or pos's T); then the
# step's sizes
ROPE_ARRAYS = ("q", "k", "v", "cos", "sin", "pos", "k_cache", "v_cache", "q_out")
ROPE_SLOTS = 4  # an array's address and up to three strides
Q, K, V, COS, SIN, POS, K_CACHE, V_CACHE, Q_OUT = range(0, ROPE_SLOTS * len(ROPE_ARRAYS), ROPE_SLOTS)
STEPS, HQ, HKV, DIM = range(ROPE_SLOTS * len(ROPE_ARRAYS), ROPE_SLOTS * len(ROPE_ARRAYS) + 4)
ROPE_BLOCK = DIM + 1


@intrinsic
def _ptr(typingctx, addr, proto):
    """A pointer of proto's type (int16 bf16 bits, fp32, int64) to the address `addr`."""

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

    return types.CPointer(proto)(types.int64, proto), codegen


def rope_block(arrays) -> np.ndarray | None:
    """`rope_rows`' argument block for the numpy arrays `arrays` (ROPE_ARRAYS' order and shapes; the step's
    sizes read from q [B, T, Hq, D] and k [B, T, Hkv, D]), or None where one's last dimension is not
    contiguous. The block holds addresses: the arrays must outlive its use."""
    block = np.zeros(ROPE_BLOCK, dtype=np.int64)
    for slot, x in zip(range(0, ROPE_SLOTS * len(arrays), ROPE_SLOTS), arrays):
        lead = x.strides if slot == POS else x.strides[:-1]  # (pos has no D: both its strides lead)
        if slot != POS and x.strides[-1] != x.itemsize:
            return None
        block[slot] = x.ctypes.data
        block[slot + 1 : slot + 1 + len(lead)] = [s // x.itemsize for s in lead]
    (_, steps, hq, d), hkv = arrays[0].shape, arrays[1].shape[2]
    block[STEPS], block[HQ], block[HKV], block[DIM] = steps, hq, hkv, d
    return block


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _at(a, which, i, j, h, n, proto, item):
    """The n elements (`item` bytes each, of proto's type) of the array in slot `which` of the block `a`
    at leading indices (i, j, h)."""
    addr = a[which] + (i * a[which + 1] + j * a[which + 2] + h * a[which + 3]) * item
    return numba.carray(_ptr(addr, proto), (n,))


@numba.njit(nogil=True, cache=True, error_model="numpy")
def rope_rows(a, bf16, lo, hi):  # pragma: no cover (compiled)
    """Rows lo..hi of a step's rotary embedding and cache writes (`row_ops.TorchOps.rope_store` without
    Qwen3's head norms), the arrays in the block `a` (ROPE_ARRAYS; bf16 bits as int16 where `bf16`, else
    fp32): row r is (b, t) = divmod(r, STEPS); q[B, T, Hq, D] rotated into q_out[B, T, Hq, D], k[B, T, Hkv,
    D] rotated into k_cache[B, Hkv, L, D] and v into v_cache at row pos[b, t]; cos / sin [B, T, D]. An
    element's bits depend on its own x, cos and sin only, so rows can be made on any thread."""
    if bf16:
        _rope(a, lo, hi, True, np.int16(0), 2)
    else:
        _rope(a, lo, hi, False, np.float32(0), 4)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _rope(a, lo, hi, bf16, proto, item):  # pragma: no cover (compiled)
    nt, hq, hkv, d = a[STEPS], a[HQ], a[HKV], a[DIM]
    x_bits, a_bits = np.empty(d, dtype=np.uint32), np.empty(d, dtype=np.uint32)
    b_bits, o_bits = np.empty(d, dtype=np.uint32), np.empty(d, dtype=np.uint32)
    c_bits, s_bits = np.empty(d, dtype=np.uint32), np.empty(d, dtype=np.uint32)
    c, s = c_bits.view(np.float32), s_bits.view(np.float32)
    for r in range(lo, hi):
        bi, t = r // nt, r % nt
        load(_at(a, COS, bi, t, 0, d, proto, item), bf16, c_bits)
        load(_at(a, SIN, bi, t, 0, d, proto, item), bf16, s_bits)
        p = _at(a, POS, bi, t, 0, 1, np.int64(0), 8)[0]
        for h in range(hq):
            _rotate(_at(a, Q, bi, t, h, d, proto, item), c, s, bf16, x_bits, a_bits, b_bits, o_bits)
            _put(_at(a, Q_OUT, bi, t, h, d, proto, item), bf16, o_bits)
        for h in range(hkv):
            _rotate(_at(a, K, bi, t, h, d, proto, item), c, s, bf16, x_bits, a_bits, b_bits, o_bits)
            _put(_at(a, K_CACHE, bi, h, p, d, proto, item), bf16, o_bits)
            src, dst = _at(a, V, bi, t, h, d, proto, item), _at(a, V_CACHE, bi, h, p, d, proto, item)
            for i in range(d):
                dst[i] = src[i]


# `scaled_heads` / `heads_out`'s argument block (int64): the queries q[B, T, Hq, D] and the output o[B, T,
# Hq, D], each as its address then its strides over B, T and heads in elements (a head's D values
# contiguous), then Hkv, T, D, whether q and o hold bf16 bits (else fp32) and the scale's fp32 bits. The
# attention's rows of KV head g = b * Hkv + h are (t, j) for query head h * groups + j, position-major
# (`fixed.attention`'s layout): these two read and write them where the model's layers keep them
H_Q, H_OUT = 0, ROPE_SLOTS
H_KV, H_STEPS, H_DIM, H_BF16, H_SCALE = range(2 * ROPE_SLOTS, 2 * ROPE_SLOTS + 5)
HEADS_BLOCK = H_SCALE + 1


def heads_block(q, o, hkv: int, scale: float) -> np.ndarray:
    """The argument block of `scaled_heads` and `heads_out` for numpy q and o [B, T, Hq, D] (int16 bf16
    bits or fp32, both the same; a head's D values contiguous in each, else ValueError). The block holds
    addresses: the arrays must outlive its use."""
    block = np.zeros(HEADS_BLOCK, dtype=np.int64)
    for slot, x in ((H_Q, q), (H_OUT, o)):
        if x.strides[-1] != x.itemsize:
            raise ValueError(f"heads_block needs a head's values contiguous, got strides {x.strides}")
        block[slot] = x.ctypes.data
        block[slot + 1 : slot + 4] = [s // x.itemsize for s in x.strides[:-1]]
    _, t, _, d = q.shape
    block[H_KV], block[H_STEPS], block[H_DIM], block[H_BF16] = hkv, t, d, q.dtype == np.int16
    block[H_SCALE] = np.array([scale], dtype=np.float32).view(np.int32)[0]
    return block


@numba.njit(nogil=True, cache=True, error_model="numpy")
def scaled_heads(a, qs, lo, hi):  # pragma: no cover (compiled)
    """qs[g, t * groups + j] = q[b, t, h * groups + j] * scale in fp32 for the KV heads g = b * Hkv + h in
    lo..hi (the block `a`): each element one fp32 multiply rounded to fp32, `q.float() * scale`'s bits, read
    where the rotary left the queries instead of from a copy in the attention's layout. qs [G, T * groups,
    D]."""
    _heads_of(a, qs, lo, hi, True)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def heads_out(a, out, lo, hi):  # pragma: no cover (compiled)
    """o[b, t, h * groups + j] = out[g, t * groups + j] for the KV heads g = b * Hkv + h in lo..hi (the block
    `a`), rounded to bf16 as torch's cast rounds (`_to_bf16`) where o holds bf16: the attention's fp32
    output [G, T * groups, D] cast and put where o_proj reads it, instead of a transposed copy and a cast."""
    _heads_of(a, out, lo, hi, False)


@numba.njit(nogil=True, cache=True, error_model="numpy", inline="always")
def _heads_of(a, rows, lo, hi, inward):  # pragma: no cover (compiled)
    """`scaled_heads` (`inward`: q's rows scaled into `rows`) or `heads_out` (`rows` cast into o), at the
    element type the block says q and o hold."""
    if a[H_BF16] != 0:
        _heads(a, rows, lo, hi, inward, True, np.int16(0), 2)
    else:
        _heads(a, rows, lo, hi, inward, False, np.float32(0), 4)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _heads(a, rows, lo, hi, inward, bf16, proto, item):  # pragma: no cover (compiled)
    hkv, nt, d = a[H_KV], a[H_STEPS], a[H_DIM]
    groups = rows.shape[1] // nt
    scale_bits = np.empty(1, dtype=np.int32)
    scale_bits[0] = a[H_SCALE]
    s = scale_bits.view(np.float32)[0]
    bits = np.empty(d, dtype=np.uint32)
    row = bits.view(np.float32)
    for g in range(lo, hi):
        b, h = g // hkv, g % hkv
        for t in range(nt):
            for j in range(groups):
                mine = rows[g, t * groups + j]
                if inward:
                    load(_at(a, H_Q, b, t, h * groups + j, d, proto, item), bf16, bits)
                    for i in range(d):
                        mine[i] = row[i] * s
                else:
                    for i in range(d):
                        row[i] = mine[i]
                    if bf16:
                        _to_bf16(row, bits)
                    _put(_at(a, H_OUT, b, t, h * groups + j, d, proto, item), bf16, bits)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def add_rms(x, delta, add, weight, bf16, eps, s_out, y_out):  # pragma: no cover (compiled)
    """A step's residual add and RMSNorm (`row_ops.TorchOps.add_norm` under bio, as one call): s = x + delta
    (`add`; else s = x), rounded to bf16 where `bf16`, into s_out; y = s * (1 / sqrt(mean(s^2) + eps)) as
    `rms_rows` computes it, rounded to bf16 then times weight and rounded again where `bf16` (fp32 y *
    weight otherwise), into y_out. x, delta, s_out, y_out [M, K], weight [K]: bf16 bits as int16 where
    `bf16`, else fp32."""
    m, k = x.shape
    x_bits, d_bits, w_bits = np.empty(k, dtype=np.uint32), np.empty(k, dtype=np.uint32), np.empty(k, dtype=np.uint32)
    x32, d32, w32 = x_bits.view(np.float32), d_bits.view(np.float32), w_bits.view(np.float32)
    y_bits = np.empty(k, dtype=np.uint32)
    y32 = y_bits.view(np.float32)
    load(weight, bf16, w_bits)
    eps32 = np.float32(eps)
    for r in range(m):
        load(x[r], bf16, x_bits)
        if add:
            load(delta[r], bf16, d_bits)
            for i in range(k):
                x32[i] = x32[i] + d32[i]
            if bf16:
                _to_bf16(x32, x_bits)
        _put(s_out[r], bf16, x_bits)
        _normalised(x32, eps32, y32)
        if bf16:
            _to_bf16(y32, y_bits)
        for i in range(k):
            y32[i] = y32[i] * w32[i]
        if bf16:
            _to_bf16(y32, y_bits)
        _put(y_out[r], bf16, y_bits)


numba_cache.one_compiler(globals())  # after every kernel above: one process compiles, the others load
