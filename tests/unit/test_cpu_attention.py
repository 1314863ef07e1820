"""The compiled CPU attention's pieces (numba, the `cpu` extra): its exp gives an element the same bits
in a vector lane and in the scalar remainder, close to fp64's exp; its fused multiply-add is IEEE's,
a * b + c rounded once (against an exact numpy reference, itself checked against rational arithmetic);
its 16-lane loops (`cpu_lanes`) and the scalar `_fused_dot` are bit for bit the lane-ordered fused dot
product and the key-ordered fused weighted sum; `attend` is its docstring's operations, on the vector
path and the scalar one."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import require

require("numba", "cpu")  # skipped only where the cpu extra is not installed; broken, it fails
from detaudit.backends.kernels import cpu_attention as ca  # noqa: E402


def _exp(x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    ca.exp_rows(x, out)
    return out


def test_exp_bits_do_not_depend_on_the_row_length_or_the_element_place():
    rng = np.random.default_rng(0)
    x = np.concatenate([-rng.exponential(8, 4093), -rng.uniform(0, 100, 4093), [0, -0.0, -87.5, -88.5]])
    x = x.astype(np.float32)
    whole = _exp(x[None])[0]  # vector lanes, a remainder of 2
    for length in (1, 3, 7, 8, 9, 15, 16, 17, 31, 64):  # every place in and after a vector
        cut = x[: x.size // length * length]
        assert np.array_equal(_exp(cut.reshape(-1, length)).ravel().view(np.uint32), whole[: cut.size].view(np.uint32))


def test_exp_accuracy_against_fp64():
    rng = np.random.default_rng(1)
    x = np.concatenate([-rng.exponential(8, 50000), -rng.uniform(0, 87.3, 50000)]).astype(np.float32)
    got, want = _exp(x[None])[0].astype(np.float64), np.exp(x.astype(np.float64))
    normal = want >= 2.0**-126
    assert normal.mean() > 0.99
    assert (np.abs(got - want)[normal] / want[normal]).max() <= 2.0**-23  # within 2 ulp of the fp32 result
    assert np.abs(got - want)[~normal].max() < 2.0**-126
    assert _exp(np.array([[0.0, -0.0]], np.float32)).tolist() == [[1.0, 1.0]]
    low = _exp(np.array([[-88.0, -100.0, -np.inf, np.nan]], np.float32))[0]
    assert low[:3].tolist() == [0.0, 0.0, 0.0] and np.isnan(low[3])  # below 2^-126: 0 (e^-88 = 6e-39)


from fractions import Fraction  # noqa: E402

import numba  # noqa: E402
import torch  # noqa: E402

from detaudit.backends.kernels import cpu_lanes as cl  # noqa: E402


@numba.njit(error_model="numpy")
def _lane_dots(q, k, bf16, out):  # pragma: no cover (compiled)
    """out[j] = the lane intrinsics' dot of q with k[j], one key at a time (four at a time: `_row_dots`)."""
    blocks, step = q.shape[0] // 16, k.strides[0]
    for j in range(k.shape[0]):
        at = k.ctypes.data + j * step
        if bf16:
            out[j] = cl.dot_bf16(q.ctypes.data, at, blocks)
        else:
            out[j] = cl.dot_f32(q.ctypes.data, at, blocks)


@numba.njit(error_model="numpy")
def _row_dots(qs, k, bf16, out):  # pragma: no cover (compiled)
    """out[i, j] for j up to a multiple of 4: the rows of qs [n, D] with k[j], four keys at a time for all
    the rows in one call (n <= ROWS)."""
    blocks, step = qs.shape[1] // 16, k.strides[0]
    for j in range(0, k.shape[0] - 3, 4):
        at = k.ctypes.data + j * step
        dest = out.ctypes.data + 4 * j
        if bf16:
            cl.dots4_bf16(qs.ctypes.data, qs.strides[0], at, step, blocks, dest, out.strides[0], qs.shape[0])
        else:
            cl.dots4_f32(qs.ctypes.data, qs.strides[0], at, step, blocks, dest, out.strides[0], qs.shape[0])


@numba.njit(error_model="numpy")
def _scalar_dots(q, k, out):  # pragma: no cover (compiled)
    lanes = np.empty(16, np.float32)
    for j in range(k.shape[0]):
        out[j] = ca._fused_dot(q, k[j], lanes)


@numba.njit(error_model="numpy")
def _compiled_fma(a, b, c, out):  # pragma: no cover (compiled)
    for i in range(a.shape[0]):
        out[i] = cl.fma(a[i], b[i], c[i])


def _fma(a, b, c) -> np.ndarray:
    """a * b + c rounded once to fp32, in numpy: the product is exact in fp64 (24 + 24 bits), the sum is
    rounded to odd in fp64 (its error by TwoSum; where inexact, the neighbour with an odd last bit), and a
    sum rounded to odd 29 bits wider than fp32 rounds to nearest fp32 as the exact sum does (Boldo and
    Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to odd",
    IEEE Trans. Computers, 2008)."""
    a, b, c = (np.asarray(x, np.float32).astype(np.float64) for x in (a, b, c))
    p = a * b
    s = p + c
    z = s - p
    err = (p - (s - z)) + (c - z)  # s + err == p + c exactly
    bits = s.view(np.int64)
    away = (err > 0) == (s > 0)  # the exact sum lies beyond s, away from zero: the next larger magnitude
    odd = np.where((err != 0) & (bits % 2 == 0), bits + np.where(away, 1, -1), bits)
    return odd.view(np.float64).astype(np.float32)


def _nearest_f32(x: Fraction) -> np.float32:
    """The fp32 nearest the rational x (ties to an even last bit), from fp32's three candidates."""
    f = np.float32(float(x))
    cands = [np.nextafter(f, np.float32(-np.inf)), f, np.nextafter(f, np.float32(np.inf))]
    return min(cands, key=lambda y: (abs(Fraction(float(y)) - x), int(np.float32(y).view(np.uint32)) % 2))


def _fused_dots(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """Each row of k's score with q as the attention makes it: lane i % 16 = q[i] * k[i] + lane (`_fma`)
    from +0, in order, then the lanes pairwise (0+8, 0+4, 0+2, 0+1) in fp32."""
    lanes = np.zeros((k.shape[0], 16), np.float32)
    for i in range(k.shape[1]):
        lanes[:, i % 16] = _fma(q[i], k[:, i], lanes[:, i % 16])
    width = 8
    while width:
        lanes[:, :width] = lanes[:, :width] + lanes[:, width : 2 * width]
        width //= 2
    return lanes[:, 0]


def test_fma_rounds_once():
    """`cpu_lanes.fma` is a * b + c rounded once: where the rounded product then the add gives 0, it gives
    2^-24; on magnitudes far apart, its bits are the numpy reference's, and the reference is the exact
    rational result rounded to nearest fp32 (cases where a product rounded first would differ among
    them)."""
    a = np.float32(1 + 2.0**-12)
    c = np.float32(-(1 + 2.0**-11))
    assert np.float32(a * a) + c == 0  # the product rounded first loses its 2^-24
    got = np.empty(1, np.float32)
    _compiled_fma(np.array([a]), np.array([a]), np.array([c]), got)
    assert got[0] == np.float32(2.0**-24) == _fma(a, a, c)
    rng = np.random.default_rng(0)
    n = 3000
    x, y = (rng.standard_normal(n) * 2.0 ** rng.integers(-20, 20, n) for _ in range(2))
    z = -(x * y) * (1 + rng.standard_normal(n) * 2.0 ** rng.integers(-30, 0, n))  # near cancellation
    z[::3] = rng.standard_normal(n)[::3] * 2.0 ** rng.integers(-60, 60, n)[::3]
    x, y, z = (v.astype(np.float32) for v in (x, y, z))
    want = _fma(x, y, z)
    got = np.empty(n, np.float32)
    _compiled_fma(x, y, z, got)
    assert np.array_equal(_bits(got), _bits(want))
    assert not np.array_equal(_bits(x * y + z), _bits(want))  # a case where unfused differs
    exact = [_nearest_f32(Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))) for a, b, c in zip(x, y, z)]
    assert np.array_equal(_bits(np.array(exact, np.float32)), _bits(want))


@numba.njit(error_model="numpy")
def _weighted(out, e, v, lo, hi, bf16):  # pragma: no cover (compiled)
    """The lanes' weighted sums of the rows of out [n, D] with the weights e [n, L] (n <= ROWS)."""
    args = (out.ctypes.data, out.strides[0], e.ctypes.data, e.strides[0], v.ctypes.data, v.strides[0])
    if bf16:
        cl.weighted_bf16(*args, lo, hi, out.shape[1] // 16, out.shape[0])
    else:
        cl.weighted_f32(*args, lo, hi, out.shape[1] // 16, out.shape[0])


def _bf16_bits(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x rounded to bf16: its int16 bits and its fp32 values."""
    b = torch.from_numpy(x).bfloat16()
    return b.view(torch.int16).numpy(), b.float().numpy()


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("d", [16, 64, 128, 80, 40])
def test_lane_dots_are_the_lane_ordered_dot_products(d):
    """The 16-lane intrinsics (one key, or four keys whose trees share shuffles) and the scalar
    `_fused_dot` make exactly the lane-ordered fused dot (`_fused_dots`), on fp32 keys and on bf16 bits:
    the same bits, over magnitudes where another order of the additions rounds otherwise."""
    rng = np.random.default_rng(d)
    q = (rng.standard_normal(d) * rng.uniform(1e-3, 1e3, d)).astype(np.float32)
    keys = (rng.standard_normal((203, d)) * rng.uniform(1e-3, 1e3, (203, 1))).astype(np.float32)
    halves, rounded = _bf16_bits(keys)
    for bf16, k, values in ((False, keys, keys), (True, halves, rounded)):
        want = _fused_dots(q, values)
        scalar = np.empty(203, np.float32)
        _scalar_dots(q, values, scalar)
        assert np.array_equal(_bits(scalar), _bits(want))
        if d % 16:
            continue
        got = np.full(203, np.nan, np.float32)
        _lane_dots(q, k, bf16, got)
        assert np.array_equal(_bits(got), _bits(want)), bf16
        fours = np.full((1, 203), np.nan, np.float32)
        _row_dots(q[None], k, bf16, fours)
        assert np.array_equal(_bits(fours[0, :200]), _bits(want[:200])), bf16


@pytest.mark.parametrize("d", [16, 64, 128])
def test_rows_sharing_keys_get_each_rows_dots(d):
    """1 to ROWS query rows (apart by more than D) given the same four keys in one call: each row's
    dots are its own lane-ordered fused dots, written to its own row of the output, nothing past them."""
    rng = np.random.default_rng(d + 1)
    keys = (rng.standard_normal((41, d)) * rng.uniform(1e-3, 1e3, (41, 1))).astype(np.float32)
    halves, rounded = _bf16_bits(keys)
    for rows in range(1, cl.ROWS + 1):
        qs = (rng.standard_normal((rows, d + 7)) * rng.uniform(1e-3, 1e3, (rows, 1))).astype(np.float32)[:, :d]
        for bf16, k, values in ((False, keys, keys), (True, halves, rounded)):
            room = np.full((rows, 45), np.nan, np.float32)
            _row_dots(qs, k, bf16, room)
            want = np.stack([_fused_dots(q, values[:40]) for q in qs])
            assert np.array_equal(_bits(room[:, :40]), _bits(want)), (rows, bf16)
            assert np.isnan(room[:, 40:]).all()


@pytest.mark.parametrize("d", [16, 64, 80, 128])
def test_lane_weighted_sum_adds_each_key_in_order(d):
    """out = e[j] * v[j] + out, fused, for keys lo..hi, one key after the other (`_fma` is the reference):
    the same bits whichever blocks of lanes share a pass over the keys, for 1 to ROWS rows sharing it
    (each row its own weights and output, rows apart by more than D: the strides are honoured)."""
    rng = np.random.default_rng(d)
    v = (rng.standard_normal((90, d)) * rng.uniform(1e-3, 1e3, (90, 1))).astype(np.float32)
    halves, rounded = _bf16_bits(v)
    for rows in range(1, cl.ROWS + 1):
        e = rng.uniform(0, 1, (rows, 95)).astype(np.float32)[:, :90]
        for bf16, vs, values in ((False, v, v), (True, halves, rounded)):
            start = rng.standard_normal((rows, d + 3)).astype(np.float32)[:, :d]
            want = start.copy()
            for j in range(7, 84):
                want = _fma(e[:, j : j + 1], values[j], want)
            room = np.full((rows, d + 5), np.nan, np.float32)
            got = room[:, :d]
            got[:] = start
            _weighted(got, e, vs, 7, 83, bf16)
            assert np.array_equal(_bits(got), _bits(want)), (rows, bf16)
            assert np.isnan(room[:, d:]).all()  # nothing written past a row's D elements


def _attention_reference(qs, pos, k, v, window):
    """The module docstring's operations, one at a time in numpy fp32 (`_fused_dots` for the scores)."""
    g_count, rows, d = qs.shape
    out = np.empty_like(qs)
    for g in range(g_count):
        for r in range(rows):
            p = pos[g, r]
            lo, hi = max(p - window + 1 if window else 0, 0), min(p, k.shape[1] - 1)
            scores = _fused_dots(qs[g, r], k[g, lo : hi + 1])
            weights = _exp((scores - scores.max())[None])[0]
            total, acc = np.float32(0), np.zeros(d, np.float32)
            for j in range(hi - lo + 1):
                total = np.float32(total + weights[j])
                acc = _fma(weights[j], v[g, lo + j], acc)
            out[g, r] = acc / total
    return out


@pytest.mark.parametrize("d, window", [(64, 0), (64, 5), (48, 0), (40, 0), (72, 4), (128, 3)])
@pytest.mark.parametrize("bf16", [False, True])
def test_attend_is_the_documented_operations(d, window, bf16):
    """`attend`'s bits are its docstring's operations made one at a time (fp32 scores by `_fused_dots`, their
    max, exp(score - max) in fp32, the sum and the weighted values in key order, one division): on the
    16-lane path (D a multiple of 16), on the scalar one (D = 40, 72 are not), and on the scalar one
    again where the query rows are not contiguous. The cache is read as the team passes it: the first L
    rows of a longer cache."""
    rng = np.random.default_rng(d + window)
    g, rows, length = 3, 6, 23
    qs = (rng.standard_normal((g, rows, d)) * 3).astype(np.float32)
    k = (rng.standard_normal((g, length + 9, d)) * rng.uniform(0.1, 3, (g, length + 9, 1))).astype(np.float32)
    v = rng.standard_normal((g, length + 9, d)).astype(np.float32)
    pos = rng.integers(0, length, (g, rows)).astype(np.int64)
    (k_bits, k), (v_bits, v) = (_bf16_bits(x) if bf16 else (x, x) for x in (k, v))
    k_bits, k, v_bits, v = (x[:, :length] for x in (k_bits, k, v_bits, v))  # rows (length + 9) * D apart
    want = _attention_reference(qs, pos, k, v, window)
    out = np.full_like(qs, np.nan)
    ca.attend(qs, pos, k_bits, v_bits, bf16, window, out)
    assert np.array_equal(_bits(out), _bits(want))
    wide = np.zeros((g, rows, 2 * d), np.float32)
    wide[:, :, ::2] = qs  # every other element: the rows' elements 8 bytes apart (the scalar path)
    strided = np.full_like(qs, np.nan)
    ca.attend(wide[:, :, ::2], pos, k_bits, v_bits, bf16, window, strided)
    assert np.array_equal(_bits(strided), _bits(want))


@pytest.mark.parametrize("bf16, window", [(False, 0), (True, 3)])
def test_a_row_that_sees_no_key_is_nan_and_leaves_the_others_alone(bf16, window):
    """A query before every key (position -1 or lower) has no visible key: 0 / 0, NaN, as softmax over
    nothing; the other rows of its head keep their bits."""
    rng = np.random.default_rng(5)
    qs = rng.standard_normal((2, 4, 32)).astype(np.float32)
    k, v = (rng.standard_normal((2, 9, 32)).astype(np.float32) for _ in range(2))
    (k_bits, k), (v_bits, v) = (_bf16_bits(x) if bf16 else (x, x) for x in (k, v))
    pos = np.array([[3, -1, -5, 8], [0, 2, -2, 7]], np.int64)
    out = np.zeros_like(qs)
    ca.attend(qs, pos, k_bits, v_bits, bf16, window, out)
    assert np.isnan(out[pos < 0]).all()
    want = _attention_reference(qs, np.maximum(pos, 0), k, v, window)
    assert np.array_equal(_bits(out[pos >= 0]), _bits(want[pos >= 0]))


@pytest.mark.parametrize("rows", [5, 14])
@pytest.mark.parametrize("d, window, bf16", [(64, 0, True), (64, 4, True), (40, 0, True), (64, 0, False)])
def test_rows_at_one_position_keep_their_own_bits(rows, d, window, bf16):
    """Query rows at one position (a KV head's query heads) run side by side in runs of up to RUN
    (`_run`), and from WIDEN_ROWS rows a head's bf16 keys and values are widened once: every row keeps
    the bits of the documented operations, in runs of 1 to RUN + 1 rows, a run of rows that see no key
    among them, and on the vector and scalar paths."""
    rng = np.random.default_rng(rows + d + window)
    g, length = 2, 19
    qs = (rng.standard_normal((g, rows, d)) * 3).astype(np.float32)
    k = (rng.standard_normal((g, length + 5, d)) * rng.uniform(0.1, 3, (g, length + 5, 1))).astype(np.float32)
    v = rng.standard_normal((g, length + 5, d)).astype(np.float32)
    runs = [5, 1, 4, 3, 2]  # run lengths (5: a run of RUN and one of 1), cut at `rows` below
    pos_row = np.concatenate([np.full(n, p) for n, p in zip(runs, [3, 0, -1, 9, 12])])[:rows]
    pos = np.stack([pos_row, pos_row[::-1]]).astype(np.int64)
    (k_bits, k), (v_bits, v) = (_bf16_bits(x) if bf16 else (x, x) for x in (k, v))
    k_bits, k, v_bits, v = (x[:, :length] for x in (k_bits, k, v_bits, v))
    out = np.full_like(qs, 7.0)
    ca.attend(qs, pos, k_bits, v_bits, bf16, window, out)
    assert np.isnan(out[pos < 0]).all()
    want = _attention_reference(qs, np.maximum(pos, 0), k, v, window)
    assert np.array_equal(_bits(out[pos >= 0]), _bits(want[pos >= 0]))
    if bf16 and rows >= ca.WIDEN_ROWS:  # each row alone (no run, nothing widened) gives the same bits
        alone = np.full_like(qs, 7.0)
        for r in range(rows):
            ca.attend(qs[:, r : r + 1], pos[:, r : r + 1], k_bits, v_bits, bf16, window, alone[:, r : r + 1])
        assert np.array_equal(_bits(alone[pos >= 0]), _bits(out[pos >= 0]))


AVX2 = "+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+lzcnt,+movbe,+popcnt,+sse4.2,-avx512f,-avx512bw,-avx512vl,-avx512dq"


@pytest.mark.slow
def test_avx2_code_scores_a_row_at_a_time_with_the_same_bits(tmp_path):
    """Compiled for AVX2 (16 vector registers: `SCORE_ROWS` is 1, a run's rows scored one at a time) the
    attention gives the documented operations' bits, as the AVX-512 code does: this module's runs-of-rows
    test (D 64, no window, a bf16 cache: the vector path, widened and not) in a process whose
    numba targets Haswell's features (its own cache folder)."""
    import os
    import platform
    import subprocess
    import sys

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 feature names")
    env = {**os.environ, "NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": AVX2, "NUMBA_CACHE_DIR": str(tmp_path)}
    probe = "from detaudit.backends.kernels import cpu_lanes; print(cpu_lanes.SCORE_ROWS)"
    assert subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True).stdout.strip() == "1"
    test = f"{__file__}::test_rows_at_one_position_keep_their_own_bits"  # runs of 1 to RUN + 1 rows
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", "-k", "64-0-True", test]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stdout[-3000:]
