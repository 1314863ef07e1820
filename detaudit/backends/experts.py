"""The experts of a mixture-of-experts MLP after its router (`Backend.experts`), built on the backend's
expert products.

Decode steps (one token per request) and short prefills run every expert on every token (`Dense`: one
batched product per projection, static shapes, so a CUDA graph can capture the step; the rows nobody chose
are computed and dropped), except where the backend groups the experts' products (the invariant backends
on GPU) and the step has at most one (token, slot) row an expert: then the grouped layout reads only the
chosen experts' weights (no host sync, so graphed decode steps take it too). Longer prefills have each
expert compute only the rows routed to it (`Sorted`: the rows sorted by expert, one product per expert;
or, where the backend groups them, `Grouped`: one launch per projection over every expert's run,
`kernels/grouped_mm.py`). The experts' gate / up products are column-parallel (each rank holds its slice
of every expert's intermediate dimension); the down projection and each token's weighted sum of its
experts' outputs are one row-parallel step (`backend.expert_down`), reduced across ranks like any
row-parallel layer (`TPContext.reduce`). Under the invariant backends a row's products do not depend on
the other rows, so the layouts give the same bits (tested). A backend that reduces the down projection
along a tree (bio+tbik: `expert_leaf_plan`) gets the down weights stored leaf-major, [E, leaves, N, leaf],
and every leaf's products at once: one batched product over (expert, leaf) in the every-expert layout, one
launch storing each leaf apart in the grouped one, one product per expert over its leaves in the sorted
one.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from detaudit.backends.kernels import grouped_mm

DENSE_TOKENS = 64  # up to this many tokens (and in every decode step) every expert sees every token
# every leaf of every expert in one product while its fp32 output, [E * leaves, T, N], stays within this;
# beyond it (large decode batches) one product a leaf: the same products, a leaves-th of the memory
LEAF_BATCH_BYTES = 512 << 20
# a prefill layout holds its expert products at once (gate / up [T*k, 2I/C] and the activation in the model
# dtype, the fp32 down outputs [leaves, T, k, N]); past this a long prefill runs the layer in pieces of
# tokens (every op after the router is a token's own: the same bits, a piece's memory)
PREFILL_BYTES = 4 << 30


@dataclass
class ExpertWeights:
    """Per local rank: gate_up [E, 2 I/C, H] (gate rows, then up rows) and down [E, H, I/C], or leaf-major
    [E, leaves, H, leaf] where `leaves` = (leaf, leaves) is the backend's plan."""

    gate_up: list[Tensor]
    down: list[Tensor]
    leaves: tuple[int, int] | None
    num_experts: int

    @classmethod
    def of(cls, backend, gate_up: list[Tensor], down: list[Tensor], ctx, name: str) -> ExpertWeights:
        plan = backend.expert_leaf_plan(down[0].shape[-1], ctx.size, name)
        if plan is not None:
            leaf, leaves = plan
            down = [d.view(d.shape[0], d.shape[1], leaves, leaf).transpose(1, 2).contiguous() for d in down]
        return cls(gate_up, down, plan, gate_up[0].shape[0])


def run(backend, h: Tensor, experts: Tensor, gates: Tensor, w: ExpertWeights, ctx, decode: bool, name: str) -> Tensor:
    """The layer's residual delta for h[T, H] (a partial where the residual add rounds it, as
    `RowParallelLinear` returns): each local rank's experts in the layout the tokens call for, long
    prefills in pieces of tokens, reduced across the TP ranks."""
    t, step = h.shape[0], h.shape[0]
    if not (decode or t <= DENSE_TOKENS):
        layout = Grouped if backend.grouped_experts(h) else Sorted
    elif t * experts.shape[1] <= w.num_experts and backend.grouped_experts(h):
        layout = Grouped  # few rows: only the chosen experts' weights are read, not every expert's
    else:
        layout = Dense
    if layout is not Dense:
        # per (token, slot) row: its fp32 down outputs (per leaf) and its gate / up output and activation
        leaves, inter = (w.leaves[1] if w.leaves else 1), w.gate_up[0].shape[1] // 2
        row = leaves * h.shape[1] * 4 + 3 * inter * h.element_size()
        pieces = max(1, -(-t * experts.shape[1] * row // PREFILL_BYTES))
        step = -(-t // pieces)
    step = max(step, 1)  # no tokens: one empty piece
    partials = []
    for r in range(len(w.gate_up)):
        outs = [
            layout(backend, w, r, name, h[s : s + step], experts[s : s + step]).down(gates[s : s + step], ctx.size)
            for s in range(0, max(t, 1), step)
        ]
        partials.append(outs[0] if len(outs) == 1 else torch.cat(outs))
    return ctx.reduce(partials)


def _silu(backend, gate_up: Tensor) -> Tensor:
    """silu(gate) * up of an expert product whose last dim holds the gate half, then the up half."""
    half = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, gate_up.shape[-1])
    return backend.silu_mul(flat[:, :half], flat[:, half:]).view(*gate_up.shape[:-1], half)


class Dense:
    """Every expert computes every token: x[E, T, H] (a broadcast view), one batched product each."""

    def __init__(self, b, w: ExpertWeights, rank: int, name: str, h: Tensor, experts: Tensor) -> None:
        self.b, self.down_w, self.leaves, self.name = b, w.down[rank], w.leaves, name
        t = h.shape[0]
        x = h.unsqueeze(0).expand(w.num_experts, t, h.shape[1])
        self.act = _silu(b, b.expert_linear(x, w.gate_up[rank]))  # [E, T, I/C]
        self.experts, self.tokens = experts, torch.arange(t, device=h.device)[:, None]
        self.index = experts * t + self.tokens  # token t's j-th expert's row

    def down(self, gates: Tensor, tp_size: int) -> Tensor:
        def product() -> Tensor:
            return self._chosen(self.b.expert_matmul(self.act, self.down_w))

        def leaf_products() -> Tensor:  # [leaves, T, k, N]
            e, t, _ = self.act.shape
            (leaf, leaves), n = self.leaves, self.down_w.shape[-2]
            if e * leaves * t * n * 4 > LEAF_BATCH_BYTES:  # one product a leaf (its K slice of every expert)
                mm = self.b.expert_matmul
                return torch.stack(
                    [
                        self._chosen(mm(self.act[..., j * leaf : (j + 1) * leaf], self.down_w[:, j]))
                        for j in range(leaves)
                    ]
                )
            x = self.act.view(e, t, leaves, leaf).transpose(1, 2).reshape(e * leaves, t, leaf)
            y = self.b.expert_matmul(x, self.down_w.view(e * leaves, n, leaf))  # [E * leaves, T, N]
            # only the chosen rows, leaf-major: row (expert * leaves + leaf) * T + token of y
            j = torch.arange(leaves, device=y.device)[:, None, None]
            return y.reshape(-1, n)[(self.experts * leaves + j) * t + self.tokens]

        fn = leaf_products if self.leaves else product
        return self.b.expert_down(fn, gates, tp_size, self.act.shape[-1], self.name)

    def _chosen(self, y: Tensor) -> Tensor:
        """The (token, slot) rows [T, k, N] of every expert's outputs y[E, T, N]."""
        return y.reshape(-1, y.shape[-1])[self.index]


class Sorted:
    """Each expert computes the rows routed to it: the T*k (token, slot) rows sorted by expert, one
    product per expert over its contiguous run."""

    def __init__(self, b, w: ExpertWeights, rank: int, name: str, h: Tensor, experts: Tensor) -> None:
        self.b, self.down_w, self.leaves, self.name = b, w.down[rank], w.leaves, name
        t, k = experts.shape
        flat = experts.reshape(-1)  # row t*k + j: token t's j-th expert
        self.order = torch.sort(flat, stable=True).indices  # by expert, tokens in order within one
        counts = torch.bincount(flat, minlength=w.num_experts).tolist()  # (a host sync: prefill only)
        self.runs = [(e, sum(counts[:e]), c) for e, c in enumerate(counts) if c]  # (expert, start, rows)
        x = h[self.order // k]
        gu = w.gate_up[rank]
        self.act = _silu(b, torch.cat([b.expert_linear(x[s : s + n], gu[e]) for e, s, n in self.runs]))
        self.shape = (t, k)

    def down(self, gates: Tensor, tp_size: int) -> Tensor:
        w = self.down_w

        def product() -> Tensor:
            return self._in_token_order(
                torch.cat([self.b.expert_matmul(self.act[s : s + n], w[e]) for e, s, n in self.runs])
            )

        def leaf_products() -> Tensor:
            leaf, leaves = self.leaves
            y = torch.cat([self._leaves(self.act[s : s + n], w[e], leaf, leaves) for e, s, n in self.runs], 1)
            return self._in_token_order(y)

        fn = leaf_products if self.leaves else product
        return self.b.expert_down(fn, gates, tp_size, self.act.shape[-1], self.name)

    def _in_token_order(self, y: Tensor) -> Tensor:
        """y[..., T*k, N], rows sorted by expert -> [..., T, k, N] in (token, slot) order."""
        out = torch.empty_like(y)
        out[..., self.order, :] = y
        return out.view(*y.shape[:-2], *self.shape, -1)

    def _leaves(self, x: Tensor, w: Tensor, leaf: int, leaves: int) -> Tensor:
        """[leaves, R, N]: an expert's rows x[R, leaves * leaf] times each leaf w[j] [N, leaf]. On GPU one
        product batched over the leaves (a strided view of x); on CPU one product a leaf, the 2-D path
        the other layouts' rows are checked against."""
        if x.is_cuda:
            return self.b.expert_matmul(x.view(x.shape[0], leaves, leaf).transpose(0, 1), w)
        return torch.stack([self.b.expert_matmul(x[:, j * leaf : (j + 1) * leaf], w[j]) for j in range(leaves)])


class Grouped:
    """`Sorted`'s products on GPU under the invariant backends, each projection one launch over every
    expert's run (`backend.expert_runs_matmul`): gate / up reads the tokens' rows of h in place, down
    writes every (token, slot) row, of every leaf, at its place. No host sync, no gather or reorder of
    rows; the same bits as `Sorted` (a row's products do not depend on the other rows)."""

    def __init__(self, b, w: ExpertWeights, rank: int, name: str, h: Tensor, experts: Tensor) -> None:
        self.b, self.down_w, self.name = b, w.down[rank], name
        t, k = self.shape = tuple(experts.shape)
        self.runs = grouped_mm.Runs(experts, w.num_experts)
        src = (self.runs.order // k).to(torch.int32)  # sorted row -> its token's row of h
        gate_up = b.expert_runs_matmul(h, src, w.gate_up[rank], self.runs, self.runs.identity, t * k, out_dtype=h.dtype)
        self.act = _silu(b, gate_up)  # [T*k, I/C], rows sorted by expert

    def down(self, gates: Tensor, tp_size: int) -> Tensor:
        t, k = self.shape

        def product() -> Tensor:  # [T, k, N], or with leaf-major weights [leaves, T, k, N]
            dst = self.runs.order.to(torch.int32)
            y = self.b.expert_runs_matmul(self.act, self.runs.identity, self.down_w, self.runs, dst, t * k)
            return y.view(*y.shape[:-2], t, k, y.shape[-1])

        return self.b.expert_down(product, gates, tp_size, self.act.shape[-1], self.name)
