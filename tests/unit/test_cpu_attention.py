"""The compiled CPU attention's pieces (numba, the `cpu` extra): its exp gives an element the same bits
in a vector lane and in the scalar remainder, close to fp64's exp, and its scores, vectorized across
keys, are bit for bit the lane-ordered dot product `_dot` that RMSNorm's statistics also use."""

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


@pytest.mark.parametrize("d", [7, 16, 64, 100])
def test_scores_are_the_lane_ordered_dot_products(d):
    """`_scores` (a row's scores over keys lo..hi, vectorized across the keys) adds exactly what `_dot`
    adds, in the same order, for every key: the same bits."""
    rng = np.random.default_rng(d)
    q = rng.standard_normal(d).astype(np.float32)
    keys = (rng.standard_normal((50, d)) * rng.uniform(1e-3, 1e3, (50, 1))).astype(np.float32)
    keys_t = np.ascontiguousarray(keys.T)
    acc = np.empty((ca.LANES, 50), np.float32)
    for lo, hi in ((0, 49), (13, 13), (5, 40)):
        dest = np.empty(hi - lo + 1, np.float32)
        ca._scores(q, keys_t, lo, hi, acc, dest)
        want = np.array([ca._dot(q, keys[j]) for j in range(lo, hi + 1)], np.float32)
        assert np.array_equal(dest.view(np.uint32), want.view(np.uint32)), (lo, hi)
