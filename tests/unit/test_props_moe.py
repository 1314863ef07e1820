"""Property tests (hypothesis) of the mixture-of-experts layer (`builtin/moe.py` on the backends' seams),
asserted on fp32 bits (`torch.equal`), on each CPU product path (`cpu_path`): the routing (router
product, fp32 probabilities, top k with ties to the lower expert, gates renormalised in a fixed order),
the experts' products and each token's weighted sum of its experts (`expert_down`).

The layer is built by its own constructor from weights held in memory (a loader of a dict: what the
checkpoint loader hands it), expert widths I = 8 leaf with leaf from 1 (I / C = 1 at TP 8), and run on
emulated TP, its partials combined in fp32 (`TPContext.dtype` fp32, whatever the weights' dtype). For
every drawn shape:
- bio+tbik: the layer's fp32 output has TP 1's bits at TP 2, 4 and 8;
- both backends: every token's output, routing and gates have the same bits with the token alone, and
  in the every-expert layout (decode), the chosen-rows layout (prefill) and the one-product-per-leaf
  layout (large decode batches)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from detaudit.backends import experts, get_backend
from detaudit.backends.base import TPContext
from detaudit.builtin import moe
from detaudit.builtin.arch import MoESpec

from .props_common import DTYPES, PROPS, bits, spread


class _Weights:
    """The loader's interface (`full`, `shards` along a dim, for every rank of an emulated group) over a
    dict of full tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor], ctx: TPContext) -> None:
        self.tensors, self.ctx = tensors, ctx

    def full(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def shards(self, name: str, dim: int) -> list[torch.Tensor]:
        return [s.contiguous() for s in self.tensors[name].chunk(self.ctx.size, dim)]


def _layer(backend: str, c: int, e: int, k: int, hidden: int, inter: int, norm: bool, dtype, seed: int) -> moe.MoE:
    p = "model.layers.0.mlp."
    w = {p + "gate.weight": spread(e, hidden, seed=seed, dtype=dtype)}
    for j in range(e):
        q = f"{p}experts.{j}."
        w[q + "gate_proj.weight"] = spread(inter, hidden, seed=seed + 3 * j + 1, dtype=dtype)
        w[q + "up_proj.weight"] = spread(inter, hidden, seed=seed + 3 * j + 2, dtype=dtype)
        w[q + "down_proj.weight"] = spread(hidden, inter, seed=seed + 3 * j + 3, dtype=dtype)
    ctx = TPContext(get_backend(backend), c, 0, emulated=True, dtype=torch.float32)  # combine in fp32
    spec = MoESpec(e, k, inter, norm, (True,), "qwen3_moe")
    return moe.MoE(0, SimpleNamespace(moe=spec), _Weights(w, ctx), ctx)


def _run(layer: moe.MoE, h: torch.Tensor, decode: bool):
    routing = moe.Routing()
    with layer.ctx.backend.activate():
        out = layer(h, routing, decode=decode)
    return out, routing


def _same_routing(a: moe.Routing, b: moe.Routing, rows: slice, what: str) -> None:
    for field in ("experts", "gates", "margins"):
        bits(getattr(b, field)[0], getattr(a, field)[0][rows], f"{what}: routing {field}")


@settings(PROPS, max_examples=10)
@given(
    backend=st.sampled_from(["bio", "bio+tbik"]),
    t=st.integers(1, 33),
    e=st.integers(2, 9),
    k=st.integers(1, 4),
    hidden=st.sampled_from([1, 8, 17, 64]),
    leaf=st.integers(1, 7),
    norm=st.booleans(),
    dtype=DTYPES,
    seed=st.integers(0, 2**20),
    data=st.data(),
)
def test_moe_layer_tp_layout_and_batch_invariant(backend, t, e, k, hidden, leaf, norm, dtype, seed, data, cpu_path):
    k = min(k, e)
    inter = 8 * leaf
    h = spread(t, hidden, seed=seed + 999, dtype=dtype)
    one = _layer(backend, 1, e, k, hidden, inter, norm, dtype, seed)
    ref, routing = _run(one, h, decode=True)  # the every-expert layout
    assert ref.dtype == torch.float32 and routing.gates[0].dtype == torch.float32
    assert routing.experts[0].shape == (t, k)
    saved = experts.DENSE_TOKENS, experts.LEAF_BATCH_BYTES
    try:
        experts.DENSE_TOKENS = 0  # every prefill takes the chosen-rows layout
        out, r = _run(one, h, decode=False)
        bits(out, ref, "chosen-rows layout")
        _same_routing(routing, r, slice(None), "chosen-rows layout")
        experts.DENSE_TOKENS, experts.LEAF_BATCH_BYTES = saved[0], 0  # one product a leaf
        bits(_run(one, h, decode=True)[0], ref, "one product a leaf")
    finally:
        experts.DENSE_TOKENS, experts.LEAF_BATCH_BYTES = saved
    i = data.draw(st.integers(0, t - 1), "a token alone")
    out, r = _run(one, h[i : i + 1], decode=True)
    bits(out, ref[i : i + 1], f"token {i} alone")
    _same_routing(routing, r, slice(i, i + 1), f"token {i} alone")
    if backend == "bio+tbik":
        for c in (2, 4, 8):
            out, r = _run(_layer(backend, c, e, k, hidden, inter, norm, dtype, seed), h, decode=True)
            bits(out, ref, f"TP {c} (expert width {inter // c} a rank)")
            _same_routing(routing, r, slice(None), f"TP {c}")


def _in_slot_order(top: torch.Tensor, order) -> torch.Tensor:
    total = top[:, order[0]]
    for j in order[1:]:
        total = total + top[:, j]
    return total


@pytest.mark.parametrize("k", [4, 6])
@pytest.mark.parametrize("norm", [True, False])
def test_routing_ties_go_to_the_lower_expert_and_gates_add_in_order(norm, k):
    """Equal router rows tie exactly: the lower expert wins, whatever the row's neighbours; renormalised
    gates are p_j / (((p_0 + p_1) + p_2) + ...), the sum in slot order (the rows here tell that order from
    the reverse one and, at top 6, from the library's row sum, which adds in another order)."""
    layer = _layer("bio", 1, 8, k, 16, 8, norm, torch.float32, 5)
    router = layer.router
    router[4] = router[1]  # experts 1 and 4 always tie
    # small inputs against the router's spread weights: logits of a few units, so the top k's
    # probabilities are all far from 0 and their sums show the order of their additions
    h = torch.randn(64, 16, generator=torch.Generator().manual_seed(11)) * 1e-3
    experts, gates, _ = layer.route(h)
    probs = layer.ctx.backend.log_softmax(layer.ctx.backend.linear(h, router)).exp()
    top = probs.gather(1, experts)
    forward = _in_slot_order(top, range(k))
    assert not torch.equal(forward, _in_slot_order(top, range(k - 1, -1, -1)))
    assert k < 6 or not torch.equal(forward, top.sum(-1))
    bits(gates, top / forward[:, None] if norm else top, "gates")
    both = (experts == 1).any(1) & (experts == 4).any(1)
    assert both.any()
    first = (experts == 1).int().argmax(1) < (experts == 4).int().argmax(1)  # expert 1's slot before 4's
    assert first[both].all()


@pytest.mark.parametrize("k, n", [(3, 9), (8, 64)])
@pytest.mark.parametrize("backend", ["bio", "bio+tbik"])
def test_each_token_sums_its_experts_in_slot_order(backend, k, n):
    """bio: a token's output is ((g_0 y_0 + g_1 y_1) + g_2 y_2) + ..., its experts' fp32 products weighted
    and added in slot order; bio+tbik: the same per leaf, the leaves then added pairwise along the tree
    (the inputs here tell slot order from its reverse. A library product over the slots is not asserted
    to differ: at top 8 of 64 columns MKL's AVX-512 kernels on an Intel Xeon add with fused multiply-adds
    (other bits, which this test then tells apart), but on an AVX2-only CPU, and on an AVX-512 BF16 EPYC
    under torch 2.13, the batched product adds in slot order, a multiply then an add: the same bits)."""
    b = get_backend(backend)
    t, leaves = 16, 4
    y = spread(leaves, t, k, n, seed=2)
    gates = torch.rand(t, k, generator=torch.Generator().manual_seed(3))

    def in_order(y3, order):  # y3[T, k, N]
        out = y3[:, order[0]] * gates[:, order[0], None]
        for j in order[1:]:
            out = out + y3[:, j] * gates[:, j, None]
        return out

    slots, backwards = list(range(k)), list(range(k - 1, -1, -1))
    if backend == "bio":
        got = b.expert_down(lambda: y[0], gates, 1, 8)
        want, reverse = in_order(y[0], slots), in_order(y[0], backwards)
    else:  # 4 leaves: this rank's subtree at TP 2 of a K of 8 leaves

        def tree(p):
            return (p[0] + p[1]) + (p[2] + p[3])

        got = b.expert_down(lambda: y, gates, 2, 8)
        per = [in_order(y[j], slots) for j in range(leaves)]
        want, reverse = tree(per), tree([in_order(y[j], backwards) for j in range(leaves)])
        assert not torch.equal(want, ((per[0] + per[1]) + per[2]) + per[3])  # the leaves' order shows too
    assert not torch.equal(want, reverse)
    bits(got, want, f"{backend}: weighted sum in slot order")


def test_routing_rows_are_layer_major():
    """A position's routing record holds its MoE layers one after another, each layer's top k in slot
    order (layer-major), for the rows asked, in their order; 3 layers of top 2 (layers != top k, so
    slot-major grouping could not pass for it)."""
    routing = moe.Routing()
    for layer in range(3):
        ids = torch.arange(5)[:, None] * 100 + layer * 10 + torch.arange(2)  # token t, layer l, slot j: 100t+10l+j
        routing.add(ids, ids.float() / 1000, ids[:, 0].float())
    experts, gates, margins = routing.rows(torch.tensor([3, 1]))
    want = torch.tensor([[300, 301, 310, 311, 320, 321], [100, 101, 110, 111, 120, 121]])
    assert torch.equal(experts, want) and torch.equal(gates, want.float() / 1000)
    assert torch.equal(margins, torch.tensor([[300.0, 310.0, 320.0], [100.0, 110.0, 120.0]]))
    assert moe.Routing().rows(torch.tensor([0])) is None  # a dense model records no routing
