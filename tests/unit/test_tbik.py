"""`bio+tbik`: the row-parallel output is bitwise identical for C = 1, 2, 4, 8 (emulated shards), compared
on the fp32 combine of the ranks' fp32 partials (a bf16 cast would hide an order change). The tree tests
run on each CPU product path this machine has (`cpu_path`); the property test over narrow and odd shapes
is in test_props_products.py, real TP over gloo in tests/integration/test_tbik_dist.py."""

from __future__ import annotations

import pytest
import torch

from detaudit.backends import get_backend
from detaudit.backends.kernels import tree
from detaudit.errors import DetauditError


def _shards(x, w, c):
    k = w.shape[1] // c
    return [x[..., r * k : (r + 1) * k] for r in range(c)], [w[:, r * k : (r + 1) * k] for r in range(c)]


def row_parallel(backend, x, w, c, dtype=torch.float32):
    """The combine of the C ranks' fp32 partials, in fp32 unless told otherwise."""
    xs, ws = _shards(x, w, c)
    parts = [backend.row_partial(a, b, c, name="t") for a, b in zip(xs, ws)]
    assert all(p.dtype == torch.float32 for p in parts)
    return backend.combine(parts, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # the model's dtype (products: fp32 either way)
@pytest.mark.parametrize("k,n", [(1536, 576), (576, 576), (6144, 64)])  # o_proj / down_proj shapes, non-power-of-two K
def test_model_shapes_tp_and_batch_invariant(k, n, dtype, cpu_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(33, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    b = get_backend("bio+tbik")
    ref = row_parallel(b, x, w, 1)
    for c in (2, 4, 8):
        out = row_parallel(b, x, w, c)
        assert torch.equal(out, ref)
        assert torch.equal(row_parallel(b, x[:5], w, c), ref[:5])  # and batch invariant
        assert torch.equal(row_parallel(b, x, w, c, torch.bfloat16), ref.to(torch.bfloat16))  # rounded once


def test_bio_alone_is_not_tp_invariant(cpu_path):
    """Negative control: without the tree, the K split changes the fp32 bits."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1536, generator=g).bfloat16()
    w = torch.randn(576, 1536, generator=g).bfloat16()
    bio = get_backend("bio")
    ref = row_parallel(bio, x, w, 1)
    assert any(not torch.equal(row_parallel(bio, x, w, c), ref) for c in (2, 4, 8))


def test_accuracy_vs_fp64(cpu_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 1536, generator=g).bfloat16()
    w = torch.randn(576, 1536, generator=g).bfloat16()
    ref = x.double() @ w.double().t()
    ours = tree.tree_matmul(x, w, 1).double()
    assert (ours - ref).abs().max() <= 1e-4 * ref.abs().max()


def test_bad_k_names_the_layer():
    b = get_backend("bio+tbik")
    with pytest.raises(DetauditError, match="model.layers.3.mlp.down_proj.*multiple of 8"):
        b.row_partial(torch.zeros(2, 10), torch.zeros(4, 10), 1, name="model.layers.3.mlp.down_proj")
    with pytest.raises(DetauditError, match="TP sizes 1, 2, 4, 8"):
        b.row_partial(torch.zeros(2, 8), torch.zeros(4, 8), 3, name="x")


def test_tree_sum_order():
    parts = [torch.tensor([v]) for v in (1e8, 1.0, -1e8, 1.0)]  # fp32: (1e8 + 1) + (-1e8 + 1) = 0
    assert tree.tree_sum(parts).item() == 0.0
    with pytest.raises(ValueError):
        tree.tree_sum(parts[:3])


@pytest.mark.parametrize("name", ["bio", "bio+tbik"])
def test_bad_allreduce_mode(monkeypatch, name):
    monkeypatch.setenv("DETAUDIT_ALLREDUCE", "ring")
    with pytest.raises(DetauditError, match="auto, nccl, gather, scatter, peer"):
        get_backend(name)
