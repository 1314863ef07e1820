"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral), built on the backend's seams.

Per token: the router's logits (`backend.linear`, replicated), fp32 probabilities
(`backend.log_softmax`), the top k experts with ties broken by expert index (a stable descending sort:
row-local, exact), their gates (renormalised to sum to 1 where the model says so, summed in a fixed
order). The experts then run in one of two layouts: in decode steps (one token per request) and with
few tokens, every expert computes every token (one batched product per projection: static shapes, so a
CUDA graph can capture the step; the rows nobody chose are computed and dropped); otherwise each expert
computes only the rows routed to it (the rows sorted by expert: one product per expert, or on GPU under
the invariant backends one grouped launch over every expert's run, `kernels/grouped_mm.py`). The experts'
gate / up products are column-parallel (each rank holds its slice of every expert's intermediate
dimension); the down projection and each token's weighted sum of its experts' outputs are one
row-parallel step (`backend.expert_down`), reduced across ranks like any row-parallel layer. Under the
invariant backends a row's products do not depend on the other rows, so the two layouts give the same
bits (tested). A backend that reduces the down projection along a tree (bio+tbik: `expert_leaf_plan`)
gets the down weights stored leaf-major, [E, leaves, N, leaf], and every leaf's products at once: one
batched product over (expert, leaf) in decode steps, one product per expert over its leaves otherwise.

The routing of every token (expert ids, gates, and the margin between the k-th and the (k+1)-th router
probability) is handed back with the layer's output for the run's routing records.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.backends.kernels import grouped_mm
from detaudit.builtin.arch import ModelConfig
from detaudit.builtin.layers import TPContext

DENSE_TOKENS = 64  # up to this many tokens (and in every decode step) every expert sees every token
# every leaf of every expert in one product while its fp32 output, [E * leaves, T, N], stays within this;
# beyond it (large decode batches) one product a leaf: the same products, a leaves-th of the memory
LEAF_BATCH_BYTES = 512 << 20
# a prefill layout holds its expert products at once (gate / up [T*k, 2I/C] and the activation in the model
# dtype, the fp32 down outputs [leaves, T, k, N]); past this a long prefill runs the layer in pieces of
# tokens (every op after the router is a token's own: the same bits, a piece's memory)
PREFILL_BYTES = 4 << 30

_NAMES = {  # style -> (module prefix, gate, up, down)
    "qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
    "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
}


class Routing:
    """The routing of the tokens of one forward step, one entry per MoE layer in layer order: expert ids
    [T, k] (int64), gates [T, k] (fp32), margin [T] (fp32). `forced` [L, T, k] (routing replay): rows
    holding expert ids (not -1) use those experts instead of the router's top k, with the router's own
    probabilities as gates."""

    def __init__(self, forced: Tensor | None = None) -> None:
        self.experts: list[Tensor] = []
        self.gates: list[Tensor] = []
        self.margins: list[Tensor] = []
        self.forced = forced

    def forced_for_next(self) -> Tensor | None:
        """The forced experts of the next MoE layer to route, or None."""
        return None if self.forced is None else self.forced[len(self.experts)]

    def add(self, experts: Tensor, gates: Tensor, margin: Tensor) -> None:
        self.experts.append(experts)
        self.gates.append(gates)
        self.margins.append(margin)

    def rows(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
        """The routing of the step's token rows `rows` [N], layer-major per row: experts and gates
        [N, L*k], margins [N, L]; None for a model without MoE layers."""
        if not self.experts:
            return None
        n = rows.shape[0]
        experts = torch.stack([e[rows] for e in self.experts], 1).reshape(n, -1)
        gates = torch.stack([g[rows] for g in self.gates], 1).reshape(n, -1)
        return experts, gates, torch.stack([m[rows] for m in self.margins], 1)


class MoE:
    def __init__(self, i: int, cfg: ModelConfig, load, ctx: TPContext, ops) -> None:
        spec = cfg.moe
        prefix, gate_name, up_name, down_name = _NAMES[spec.style]
        p = f"model.layers.{i}.{prefix}."
        self.ctx, self.ops, self.spec = ctx, ops, spec
        self.name = p + "experts"
        self.router = load.full(p + "gate.weight")  # [E, H], replicated
        ranks = len(ctx.local_ranks)
        gate_up: list[list[Tensor]] = [[] for _ in range(ranks)]
        down: list[list[Tensor]] = [[] for _ in range(ranks)]
        for e in range(spec.num_experts):
            q = f"{p}experts.{e}."
            gates, ups = load.shards(q + gate_name + ".weight", 0), load.shards(q + up_name + ".weight", 0)
            for r, (g, u, d) in enumerate(zip(gates, ups, load.shards(q + down_name + ".weight", 1))):
                gate_up[r].append(torch.cat([g, u]))
                down[r].append(d)
        # per rank this process holds: [E, 2 I/C, H] (gate rows, then up rows) and [E, H, I/C], or
        # leaf-major [E, leaves, H, leaf] where the backend reduces the down projection along a tree
        self.gate_up = [torch.stack(w) for w in gate_up]
        self.down = [torch.stack(w) for w in down]
        plan = getattr(ctx.backend, "expert_leaf_plan", None)
        self.leaves: tuple[int, int] | None = None
        if plan is not None:
            leaf, leaves = self.leaves = plan(self.down[0].shape[-1], ctx.size, self.name)
            self.down = [d.view(d.shape[0], d.shape[1], leaves, leaf).transpose(1, 2).contiguous() for d in self.down]

    def route(self, h: Tensor, forced: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
        """(expert ids [T, k], gates [T, k] fp32, margin [T] fp32) of each row of h; rows of `forced`
        holding expert ids take those experts (gates: the router's probabilities of them)."""
        b, k = self.ctx.backend, self.spec.top_k
        probs = b.log_softmax(b.linear(h, self.router)).exp()  # [T, E] fp32
        ranked, experts = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties: lower index first
        top = ranked[:, :k]
        margin = top[:, -1] - ranked[:, k] if k < ranked.shape[1] else top[:, -1]
        if forced is not None:
            replay = forced[:, :1] >= 0
            experts = torch.where(replay, forced, experts[:, :k])
            top = torch.where(replay, probs.gather(1, experts.clamp(min=0)), top)
        if self.spec.norm_topk_prob:
            total = top[:, :1]
            for j in range(1, k):  # a fixed order of additions
                total = total + top[:, j : j + 1]
            top = top / total
        return experts[:, :k], top, margin

    def __call__(self, h: Tensor, routing: Routing, decode: bool = False) -> Tensor:
        """This layer's residual delta for h[T, H] (a partial where the residual add rounds it, as
        `RowParallelLinear` returns). `decode`: one token per request (the every-expert layout)."""
        ctx, b = self.ctx, self.ctx.backend
        experts, gates, margin = self.route(h, routing.forced_for_next())
        routing.add(experts, gates, margin)
        t, step = h.shape[0], h.shape[0]
        if decode or t <= DENSE_TOKENS:
            layout = Dense
        else:
            layout = Grouped if hasattr(b, "expert_runs_matmul") and grouped_mm.usable(h) else Sorted
            # per (token, slot) row: its fp32 down outputs (per leaf) and its gate / up output and activation
            leaves, inter = (self.leaves[1] if self.leaves else 1), self.gate_up[0].shape[1] // 2
            row = leaves * h.shape[1] * 4 + 3 * inter * h.element_size()
            pieces = -(-t * experts.shape[1] * row // PREFILL_BYTES)
            step = -(-t // pieces)
        step = max(step, 1)  # no tokens: one empty piece
        partials = []
        for r in range(len(self.gate_up)):
            outs = [
                layout(self, h[s : s + step], experts[s : s + step], r).down(gates[s : s + step])
                for s in range(0, max(t, 1), step)
            ]
            partials.append(outs[0] if len(outs) == 1 else torch.cat(outs))
        if ctx.emulated:
            return b.combine(partials, ctx.dtype)
        if ctx.group is None:  # TP 1 in process: the residual add rounds the partial (the combine of one)
            return partials[0]
        return b.all_reduce(partials[0], ctx.group, ctx.dtype)


class Dense:
    """Every expert computes every token: x[E, T, H] (a broadcast view), one batched product each."""

    def __init__(self, moe: MoE, h: Tensor, experts: Tensor, rank: int) -> None:
        self.b, self.down_w, self.moe = moe.ctx.backend, moe.down[rank], moe
        t = h.shape[0]
        x = h.unsqueeze(0).expand(moe.spec.num_experts, t, h.shape[1])
        self.act = _silu(moe, self.b.expert_linear(x, moe.gate_up[rank]))  # [E, T, I/C]
        self.experts, self.tokens = experts, torch.arange(t, device=h.device)[:, None]
        self.index = experts * t + self.tokens  # token t's j-th expert's row

    def down(self, gates: Tensor) -> Tensor:
        def product() -> Tensor:
            return self._chosen(self.b.expert_matmul(self.act, self.down_w))

        def leaf_products() -> Tensor:  # [leaves, T, k, N]
            e, t, _ = self.act.shape
            (leaf, leaves), n = self.moe.leaves, self.down_w.shape[-2]
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

        fn = leaf_products if self.moe.leaves else product
        return self.b.expert_down(fn, gates, self.moe.ctx.size, self.act.shape[-1], self.moe.name)

    def _chosen(self, y: Tensor) -> Tensor:
        """The (token, slot) rows [T, k, N] of every expert's outputs y[E, T, N]."""
        return y.reshape(-1, y.shape[-1])[self.index]


class Sorted:
    """Each expert computes the rows routed to it: the T*k (token, slot) rows sorted by expert, one
    product per expert over its contiguous run."""

    def __init__(self, moe: MoE, h: Tensor, experts: Tensor, rank: int) -> None:
        self.b, self.moe, self.rank = moe.ctx.backend, moe, rank
        t, k = experts.shape
        flat = experts.reshape(-1)  # row t*k + j: token t's j-th expert
        self.order = torch.sort(flat, stable=True).indices  # by expert, tokens in order within one
        counts = torch.bincount(flat, minlength=moe.spec.num_experts).tolist()  # (a host sync: prefill only)
        self.runs = [(e, sum(counts[:e]), c) for e, c in enumerate(counts) if c]  # (expert, start, rows)
        x = h[self.order // k]
        w = moe.gate_up[rank]
        self.act = _silu(moe, torch.cat([self.b.expert_linear(x[s : s + n], w[e]) for e, s, n in self.runs]))
        self.shape = (t, k)

    def down(self, gates: Tensor) -> Tensor:
        w = self.moe.down[self.rank]

        def product() -> Tensor:
            return self._in_token_order(
                torch.cat([self.b.expert_matmul(self.act[s : s + n], w[e]) for e, s, n in self.runs])
            )

        def leaf_products() -> Tensor:
            leaf, leaves = self.moe.leaves
            y = torch.cat([self._leaves(self.act[s : s + n], w[e], leaf, leaves) for e, s, n in self.runs], 1)
            return self._in_token_order(y)

        fn = leaf_products if self.moe.leaves else product
        return self.b.expert_down(fn, gates, self.moe.ctx.size, self.act.shape[-1], self.moe.name)

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

    def __init__(self, moe: MoE, h: Tensor, experts: Tensor, rank: int) -> None:
        self.b, self.moe, self.rank = moe.ctx.backend, moe, rank
        t, k = self.shape = tuple(experts.shape)
        self.runs = grouped_mm.Runs(experts, moe.spec.num_experts, grouped_mm.BLOCK_M)
        src = (self.runs.order // k).to(torch.int32)  # sorted row -> its token's row of h
        gate_up = self.b.expert_runs_matmul(
            h, src, moe.gate_up[rank], self.runs, self.runs.identity, t * k, out_dtype=h.dtype
        )
        self.act = _silu(moe, gate_up)  # [T*k, I/C], rows sorted by expert

    def down(self, gates: Tensor) -> Tensor:
        w, (t, k) = self.moe.down[self.rank], self.shape

        def product() -> Tensor:  # [T, k, N], or with leaf-major weights [leaves, T, k, N]
            dst = self.runs.order.to(torch.int32)
            y = self.b.expert_runs_matmul(self.act, self.runs.identity, w, self.runs, dst, t * k)
            return y.view(*y.shape[:-2], t, k, y.shape[-1])

        return self.b.expert_down(product, gates, self.moe.ctx.size, self.act.shape[-1], self.moe.name)


def _silu(moe: MoE, gate_up: Tensor) -> Tensor:
    """silu(gate) * up of an expert product whose last dim holds the gate half, then the up half."""
    half = gate_up.shape[-1] // 2
    flat = gate_up.reshape(-1, gate_up.shape[-1])
    return moe.ops.silu_mul(flat[:, :half], flat[:, half:]).view(*gate_up.shape[:-1], half)
