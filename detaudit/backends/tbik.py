"""`bio+tbik`: BIO plus Tree-Based Invariant Kernels. Row-parallel layers (o_proj, down_proj) are a
tree matmul over one fixed 8-block tree and the TP all-reduce adds the ranks' fp32 subtrees along the
top of the same tree, so their output is bitwise identical for TP 1, 2, 4 and 8 (see `kernels/tree.py`).
The all-reduce moves the subtrees as bio's does (`allreduce.fixed_order_all_reduce`: peer memory on GPU
groups; elsewhere an all-gather for small messages, a reduce-scatter by all-to-all and an all-gather of
the cast slices otherwise; the same additions every way)."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from detaudit.backends import register_backend
from detaudit.backends.bio import BioBackend, weighted_experts
from detaudit.backends.kernels import grouped_mm, tree


@register_backend("bio+tbik", "tbik")
class TbikBackend(BioBackend):
    name = "bio+tbik"
    REDUCE_ORDER = "tree"

    def row_partial(self, x: Tensor, weight: Tensor, tp_size: int, name: str = "") -> Tensor:
        return tree.tree_matmul(x, weight, tp_size, name)

    def routed_partial(self, x: Tensor, weight: Tensor, tp_size: int, name: str = ""):
        return tree.routed(x, weight, tp_size, name)

    def row_output(self, x: Tensor, weight: Tensor, dtype: torch.dtype, name: str = "") -> Tensor:
        return tree.tree_matmul(x, weight, 1, name, out_dtype=dtype)  # the whole tree, rounded in the store

    def combine(self, partials: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
        return tree.tree_sum([p.float() for p in partials]).to(dtype)

    def expert_leaf_plan(self, k_local: int, tp_size: int, name: str = "") -> tuple[int, int]:
        """(leaf size, leaves on this rank) of the experts' down projection: the engine stores those
        weights leaf-major, [E, leaves, N, leaf], so that every leaf of every expert is one product."""
        return tree.leaf_plan(k_local, tp_size, name)

    def expert_down(self, product, gates: Tensor, tp_size: int, k_local: int, name: str = "") -> Tensor:
        """The down projection's K is the tree's: each leaf's expert products are weighted and summed
        over the token's experts (as bio does over the whole K), and the leaves' sums are added along
        this rank's subtree; the all-reduce adds the ranks' subtrees along the top. Each leaf is computed
        and weighted the same way at every TP size, so the layer is TP invariant."""
        leaves = product()  # [leaves, T, k, N]
        if leaves.dim() != 4 or leaves.shape[0] != tree.leaf_plan(k_local, tp_size, name)[1]:
            raise AssertionError(f"{name}: {leaves.shape[0]} leaves of expert products, not this rank's plan")
        if grouped_mm.sums_usable(leaves):  # GPU: the weighted sums and the tree in one kernel, the same ops
            return grouped_mm.weighted_tree(leaves, gates)
        return tree.pairwise(weighted_experts(leaves, gates))

    def _reduce(self, partials: Sequence[Tensor]) -> Tensor:
        return tree.tree_sum(list(partials))

    def describe(self) -> dict[str, str]:
        return {
            **super().describe(),
            "backend": self.name,
            **tree.describe(),
            "all_reduce": "fp32 subtrees combined pairwise along the top of the same tree, cast once",
            "experts": "per tree leaf of the down projection, every expert's fp32 leaf products, weighted and "
            "summed over the token's experts in top-k order; leaves added along the tree",
        }
