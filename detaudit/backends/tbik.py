"""`bio+tbik`: BIO plus Tree-Based Invariant Kernels. Row-parallel layers (o_proj, down_proj) are a
tree matmul over one fixed 8-block tree and the TP all-reduce adds the ranks' fp32 subtrees along the
top of the same tree, so their output is bitwise identical for TP 1, 2, 4 and 8 (see `kernels/tree.py`).

Two all-reduce implementations give the same bits (`DETAUDIT_TBIK_ALLREDUCE`):
- `gather` (default): all-gather the C fp32 subtrees, pairwise tree sum on every rank;
- `a2a`: all-to-all so each rank holds 1/C of every subtree, tree sum of that slice, all-gather the
  slices: the bytes a ring all-reduce moves.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from detaudit.backends import register_backend
from detaudit.backends.base import ProcessGroup
from detaudit.backends.bio import BioBackend
from detaudit.backends.kernels import tree
from detaudit.errors import DetauditError

ALLREDUCE_MODES = ("gather", "a2a")


@register_backend("bio+tbik", "tbik")
class TbikBackend(BioBackend):
    name = "bio+tbik"

    def __init__(self, allreduce: str | None = None) -> None:
        super().__init__()
        self.allreduce = allreduce or os.environ.get("DETAUDIT_TBIK_ALLREDUCE", "gather")
        if self.allreduce not in ALLREDUCE_MODES:
            raise DetauditError(
                f"DETAUDIT_TBIK_ALLREDUCE must be one of {', '.join(ALLREDUCE_MODES)}, got {self.allreduce!r}"
            )

    def row_partial(self, x: Tensor, weight: Tensor, tp_size: int, name: str = "") -> Tensor:
        return tree.tree_matmul(x, weight, tp_size, name)

    def combine(self, partials: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
        return tree.tree_sum([p.float() for p in partials]).to(dtype)

    def all_reduce(self, partial: Tensor, group: ProcessGroup, dtype: torch.dtype) -> Tensor:
        partial = partial.float().contiguous()
        if self.allreduce == "gather":
            return self.combine(group.all_gather(partial), dtype)
        return tree_all_reduce_a2a(partial, group).to(dtype)

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "backend": self.name, **tree.describe(), "tree_all_reduce_impl": self.allreduce}


def tree_all_reduce_a2a(partial: Tensor, group: ProcessGroup) -> Tensor:
    """Reduce-scatter by all-to-all (rank i gets slice i of every subtree), tree sum of the slice,
    all-gather of the summed slices. Elementwise the same additions as the gather version."""
    c = group.size
    flat = partial.reshape(-1)
    n = flat.numel()
    per = -(-n // c)
    padded = torch.zeros(per * c, dtype=flat.dtype, device=flat.device)
    padded[:n] = flat
    mine = group.all_to_all(list(padded.view(c, per).unbind(0)))  # [slice r of rank 0, ..., of rank C-1]
    reduced = tree.tree_sum(list(mine))
    return torch.cat(group.all_gather(reduced.contiguous()))[:n].view_as(partial)
