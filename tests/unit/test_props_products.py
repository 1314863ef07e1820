"""Property tests (hypothesis) of the invariant products and of the TP all-reduce, asserted on fp32 bits
(`torch.equal` of the fp32 results, never after a bf16 cast), over shapes that include narrow and odd
ones: K per rank from 1 to thousands and no multiple of any block, odd N, 1 to 33 rows; on each CPU
product path (`cpu_path`). Inputs span six decades, so a change in the order of any sum shows in the
bits (test_orders_differ_on_these_inputs checks that on a fixed draw).

- `fixed.matmul`: a row's bits do not depend on the rows beside it (a prefix, a row alone), nor a
  column's on the columns sharing its product (a column-parallel shard of any width); accurate to fp32;
- bio+tbik's row-parallel product (`row_partial` -> `combine`): TP 1, 2, 4, 8 give the same fp32 bits,
  each rank's raw fp32 partial is batch invariant, and `row_output` rounds TP 1's tree once;
- each fixed-order all-reduce transport (gather, scatter, nccl, auto) on C ranks emulated by threads
  (`fake_group`, a fake for the ordering logic; the gloo path: tests/integration/test_tbik_dist.py):
  every rank gets the fp32 (and bf16) bits of the backend's in-process combine: bio's rank order,
  bio+tbik's tree, and for bio+tbik TP 1's product."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detaudit.backends import allreduce, get_backend
from detaudit.backends.kernels import fixed, tree

from .fake_group import run_ranks
from .props_common import DTYPES, LEAF, PROPS, ROWS, SEEDS, K, N, bits, spread


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|error| of an fp32 sum of K rounded products, elementwise: (K + 1) u sum |x w| (u = 2^-24)."""
    return (x.shape[-1] + 1) * 2.0**-24 * (x.double().abs() @ w.double().abs().t()) + 1e-30


@settings(PROPS, max_examples=12)
@given(m=ROWS, k=K, n=N, dtype=DTYPES, seed=SEEDS, data=st.data())
def test_matmul_row_and_column_bits(m, k, n, dtype, seed, data, cpu_path):
    x, w = spread(m, k, seed=seed, dtype=dtype), spread(n, k, seed=seed + 1, dtype=dtype)
    full = fixed.matmul(x, w)
    assert full.dtype == torch.float32
    j = data.draw(st.integers(1, m), "prefix rows")
    bits(fixed.matmul(x[:j], w), full[:j], f"the first {j} rows")
    i = data.draw(st.integers(0, m - 1), "a row alone")
    bits(fixed.matmul(x[i : i + 1], w), full[i : i + 1], f"row {i} alone")
    c0 = data.draw(st.integers(0, n - 1), "first column")
    c1 = data.draw(st.integers(c0 + 1, n), "end column")
    bits(fixed.matmul(x, w[c0:c1]), full[:, c0:c1], f"columns {c0}:{c1} as their own product")
    bits(fixed.matmul(x, w, out_dtype=dtype), full.to(dtype), "rounded once to the model dtype")
    assert ((full.double() - x.double() @ w.double().t()).abs() <= fp32_bound(x, w)).all()


def shards(x: torch.Tensor, w: torch.Tensor, c: int):
    k = w.shape[1] // c
    return [(x[..., r * k : (r + 1) * k], w[:, r * k : (r + 1) * k]) for r in range(c)]


@settings(PROPS, max_examples=12)
@given(m=ROWS, leaf=LEAF, n=N, dtype=DTYPES, seed=SEEDS, data=st.data())
def test_tree_tp_and_batch_invariant(m, leaf, n, dtype, seed, data, cpu_path):
    """TP 1, 2, 4, 8 (K per rank = 8 leaf / C, down to 1): the fp32 combine of the ranks' fp32 partials
    has TP 1's bits, and so have its rows computed alone."""
    b = get_backend("bio+tbik")
    x, w = spread(m, 8 * leaf, seed=seed, dtype=dtype), spread(n, 8 * leaf, seed=seed + 1, dtype=dtype)
    ref = b.row_output(x, w, torch.float32)
    bits(b.combine([b.row_partial(x, w, 1)], torch.float32), ref, "TP 1's combine")
    bits(b.row_output(x, w, dtype), ref.to(dtype), "row_output rounds the tree once")
    i = data.draw(st.integers(0, m - 1), "a row alone")
    for c in (2, 4, 8):
        parts = [b.row_partial(xs, ws, c) for xs, ws in shards(x, w, c)]
        assert all(p.dtype == torch.float32 for p in parts)
        bits(b.combine(parts, torch.float32), ref, f"TP {c}")
        bits(b.combine(parts, dtype), ref.to(dtype), f"TP {c} rounded once")
        for r, (xs, ws) in enumerate(shards(x[i : i + 1], w, c)):  # a rank's raw partial of one row
            bits(b.row_partial(xs, ws, c), parts[r][i : i + 1], f"TP {c} rank {r}: row {i} alone")
    assert ((ref.double() - x.double() @ w.double().t()).abs() <= fp32_bound(x, w)).all()


def _all_reduce_on_threads(name: str, mode: str, x, w, c: int, dtype) -> list[torch.Tensor]:
    def rank(group):
        b = get_backend(name)
        b.allreduce = mode
        xs, ws = shards(x, w, c)[group.rank]
        return b.row_group(xs, ws, group, dtype)

    return run_ranks(c, rank)


@settings(PROPS, max_examples=25)
@given(
    name=st.sampled_from(["bio", "bio+tbik"]),
    mode=st.sampled_from(["gather", "scatter", "nccl", "auto"]),
    c=st.sampled_from([1, 2, 4, 8]),
    m=ROWS,
    leaf=st.integers(1, 24),
    n=N,
    dtype=DTYPES,
    small=st.booleans(),
    seed=SEEDS,
)
def test_all_reduce_transports_give_the_combine_bits(name, mode, c, m, leaf, n, dtype, small, seed, cpu_path):
    """Every rank's all-reduce of its fp32 partial has the bits of the backend's combine of all partials
    in process (bio: rank order; bio+tbik: the tree, i.e. TP 1's product), in fp32 and in bf16; `small`
    moves nccl's gather / scatter switch below the partial's size, so both of its branches run."""
    x, w = spread(m, 8 * leaf, seed=seed), spread(n, 8 * leaf, seed=seed + 1)
    b = get_backend(name)
    want = b.combine([b.row_partial(xs, ws, c) for xs, ws in shards(x, w, c)], dtype)
    if name == "bio+tbik":
        bits(want, b.row_output(x, w, dtype), f"TP {c} combine vs TP 1")
    saved = allreduce.GATHER_MAX_BYTES
    allreduce.GATHER_MAX_BYTES = 4 if small else saved
    try:
        outs = _all_reduce_on_threads(name, mode, x, w, c, dtype)
    finally:
        allreduce.GATHER_MAX_BYTES = saved
    for r, out in enumerate(outs):
        bits(out, want, f"{name} {mode} C={c} rank {r}")


@pytest.mark.parametrize("c", [4, 8])
def test_orders_differ_on_these_inputs(c):
    """The inputs above tell the orders apart: the rank-order sum and the tree of C fp32 partials differ
    in their bits (so a transport or combine that added in the other order would fail the properties)."""
    x, w = spread(9, 8 * 5, seed=3), spread(31, 8 * 5, seed=4)
    tbik = get_backend("bio+tbik")
    parts = [tbik.row_partial(xs, ws, c) for xs, ws in shards(x, w, c)]
    assert not torch.equal(allreduce.sequential_sum(parts, torch.float32), tree.tree_sum(parts))
