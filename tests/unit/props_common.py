"""What the property tests (test_props_*.py) share: hypothesis settings and strategies, inputs whose sums
show their order in the bits, and the bitwise comparison."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

# cpu_path is chosen once per test, not per example: the health check's concern does not apply
PROPS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
ROWS = st.integers(1, 33)
K = st.one_of(st.integers(1, 40), st.integers(41, 3000))  # 1 .. thousands, mostly no multiple of a block
LEAF = st.one_of(st.integers(1, 6), st.integers(7, 400))  # K / 8: K per rank at TP 8 from 1
N = st.integers(1, 97)
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])
SEEDS = st.integers(0, 2**31 - 1)


def spread(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    """Normal values scaled by 10^-3 .. 10^2, element by element: sums whose order shows in the bits."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-3, 3, shape, generator=g)).to(dtype)


def bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype, want.dtype, got.shape, want.shape)
    if not torch.equal(got, want):
        diff = (got.float() - want.float()).abs()
        raise AssertionError(f"{what}: {int((diff > 0).sum())} of {diff.numel()} differ, max {diff.max().item():.3g}")
