"""The mixture-of-experts MLP (Qwen3-MoE, Mixtral): its router, and its experts through the backend.

Per token: the router's logits (`backend.linear`, replicated), fp32 probabilities
(`backend.log_softmax`), the top k experts with ties broken by expert index (a stable descending sort:
row-local, exact), their gates (renormalised to sum to 1 where the model says so, summed in a fixed
order). The experts are one backend call (`backend.experts`, `backends/experts.py`: the layouts, the
down projection with each token's weighted sum, the TP reduction), over the weights the backend laid
out at load (`backend.expert_weights`: leaf-major down weights where it reduces along a tree).

The routing of every token (expert ids, gates, and the margin between the k-th and the (k+1)-th router
probability) is handed back with the layer's output for the run's routing records.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.backends.base import TPContext
from detaudit.builtin.arch import ModelConfig

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
    def __init__(self, i: int, cfg: ModelConfig, load, ctx: TPContext) -> None:
        spec = cfg.moe
        prefix, gate_name, up_name, down_name = _NAMES[spec.style]
        p = f"model.layers.{i}.{prefix}."
        self.ctx, self.spec = ctx, spec
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
        # per rank this process holds: [E, 2 I/C, H] (gate rows, then up rows) and [E, H, I/C], as the
        # backend lays them out
        self.weights = ctx.backend.expert_weights(
            [torch.stack(w) for w in gate_up], [torch.stack(w) for w in down], ctx, self.name
        )

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
        `RowParallelLinear` returns). `decode`: one token per request (on CPU, the every-expert layout)."""
        experts, gates, margin = self.route(h, routing.forced_for_next())
        routing.add(experts, gates, margin)
        return self.ctx.backend.experts(h, experts, gates, self.weights, self.ctx, decode, self.name)
