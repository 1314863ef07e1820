"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral), built on the backend's seams.

Per token: the router's logits (`backend.linear`, replicated), fp32 probabilities
(`backend.log_softmax`), the top k experts with ties broken by expert index (a stable descending sort:
row-local, exact), their gates (renormalised to sum to 1 where the model says so, summed in a fixed
order). The tokens routed to each expert are laid out as one batch per expert, x3[E, R, H]: in decode
steps and with few tokens every token goes to every expert (R = T: static shapes, so a CUDA graph can
capture the step; the rows nobody chose are computed and dropped), otherwise the chosen rows only (R =
the busiest expert's count, zero rows padding the others). The experts' gate / up products are column-parallel
(each rank holds its slice of every expert's intermediate dimension); the down projection and each
token's weighted sum of its experts' outputs are one row-parallel step (`backend.expert_down`), reduced
across ranks like any row-parallel layer. Under the invariant backends a row's products do not depend on
R or on the other rows, so the two layouts give the same bits.

The routing of every token (expert ids, gates, and the margin between the k-th and the (k+1)-th router
probability) is handed back with the layer's output for the run's routing records.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.builtin.arch import ModelConfig
from detaudit.builtin.layers import TPContext

DENSE_TOKENS = 64  # up to this many tokens (and in every decode step) every expert sees every token

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
        # per rank this process holds: [E, 2 I/C, H] (gate rows, then up rows) and [E, H, I/C]
        self.gate_up = [torch.stack(w) for w in gate_up]
        self.down = [torch.stack(w) for w in down]

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
        `RowParallelLinear` returns). `decode`: one token per request (the dense layout, whatever T)."""
        ctx, b = self.ctx, self.ctx.backend
        experts, gates, margin = self.route(h, routing.forced_for_next())
        routing.add(experts, gates, margin)
        x3, index = self._layout(h, experts, dense=decode or h.shape[0] <= DENSE_TOKENS)
        partials = []
        for r, (w_gate_up, w_down) in enumerate(zip(self.gate_up, self.down)):
            gu = b.expert_linear(x3, w_gate_up)  # [E, R, 2 I/C]
            half = gu.shape[-1] // 2
            flat = gu.reshape(-1, gu.shape[-1])
            act = self.ops.silu_mul(flat[:, :half], flat[:, half:]).view(gu.shape[0], gu.shape[1], half)
            partials.append(b.expert_down(act, w_down, index, gates, ctx.size, self.name))
        if ctx.emulated:
            return b.combine(partials, ctx.dtype)
        if ctx.group is None:  # TP 1 in process: the residual add rounds the partial (the combine of one)
            return partials[0]
        return b.all_reduce(partials[0], ctx.group, ctx.dtype)

    def _layout(self, h: Tensor, experts: Tensor, dense: bool) -> tuple[Tensor, Tensor]:
        """x3[E, R, H], the rows each expert computes, and index[T, k]: the row (in E * R) holding
        token t's j-th expert's output."""
        n_exp = self.spec.num_experts
        t, k = experts.shape
        if dense:  # every expert sees every token: static shapes
            x3 = h.unsqueeze(0).expand(n_exp, t, h.shape[1])
            index = experts * t + torch.arange(t, device=h.device)[:, None]
            return x3, index
        flat = experts.reshape(-1)  # [T*k], row-major: token t's choices at t*k .. t*k + k - 1
        order = torch.sort(flat, stable=True).indices  # grouped by expert, tokens in order within one
        counts = torch.bincount(flat, minlength=n_exp)
        rows = int(counts.max())  # (a host sync: prefill only)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(flat)
        slot[order] = torch.arange(flat.numel(), device=h.device) - starts[flat[order]]
        x3 = torch.zeros((n_exp, rows, h.shape[1]), dtype=h.dtype, device=h.device)
        x3[flat, slot] = h.repeat_interleave(k, dim=0)
        return x3, (flat * rows + slot).view(t, k)
