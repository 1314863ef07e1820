"""How the fixed-order all-reduce of bio / bio+tbik moves the ranks' fp32 partials: every transport
gives every element the same additions, in the backend's order, so the choice changes speed, never bits.
"""

from __future__ import annotations

import os
from typing import Sequence

import torch
from torch import Tensor

from detaudit.backends.base import ProcessGroup
from detaudit.backends.kernels import peer_reduce
from detaudit.errors import DetauditError

ALLREDUCE_ENV = "DETAUDIT_ALLREDUCE"  # how fixed-order all-reduces move data (`fixed_order_all_reduce`)
ALLREDUCE_MODES = ("auto", "nccl", "gather", "scatter", "peer")
GATHER_MAX_BYTES = 1 << 20  # auto: below this many fp32 bytes per rank, one all-gather (latency-bound)


def allreduce_mode() -> str:
    mode = os.environ.get(ALLREDUCE_ENV, "auto")
    if mode not in ALLREDUCE_MODES:
        raise DetauditError(f"{ALLREDUCE_ENV} must be one of {', '.join(ALLREDUCE_MODES)}, got {mode[:20]!r}")
    return mode


def describe_allreduce(mode: str) -> str:
    """What `fixed_order_all_reduce` does in `mode`, for a backend's description (every way, the same bits)."""
    nccl = (
        f"all-gather of the fp32 partials below {GATHER_MAX_BYTES} bytes per rank, else reduce-scatter by "
        "all-to-all + all-gather of the cast slices"
    )
    peer = (
        "peer memory (push each slice to its owner, in prefills from 2^25 elements by copies of each owner's "
        "rows while the next are computed; reduce and cast one's own, read the others')"
    )
    return {
        "auto": f"auto: {peer} on detaudit's NCCL groups of 2, 4 or 8 ranks, else {nccl}",
        "nccl": f"nccl: {nccl}",
        "peer": f"peer: {peer}",
        "gather": "gather: all-gather of the fp32 partials, each rank reducing all of them",
        "scatter": "scatter: reduce-scatter by all-to-all + all-gather of the cast slices",
    }[mode]


def fixed_order_all_reduce(
    partial: Tensor, group: ProcessGroup, dtype: torch.dtype, reduce, mode: str = "auto", order: str = "rank"
) -> Tensor:
    """The ranks' fp32 partials summed by `reduce` (a fixed order over the C partials given in rank
    order: every element gets the same additions whatever the transport), cast once to `dtype`.
    `order` names that order for the peer kernels ("rank": `sequential_sum`, "tree": `tree.tree_sum`).

    - `peer`: the group's peer-memory transport (GPU groups: `backends/peer.py`, `kernels/peer_reduce.py`):
      each rank stores slice j of its partial into rank j's buffer, reduces and casts its own slice, and
      reads the cast slices of the others: the bytes of `scatter`, in three kernels and two device
      barriers; refused where the group has none (a size that does not fit while a CUDA graph is being
      captured goes by the `nccl` rule);
    - `gather`: all-gather every partial, reduce locally: one collective, C - 1 partials received
      (fp32) per rank: the latency-bound choice for small messages (decode);
    - `scatter`: reduce-scatter by all-to-all (rank r receives slice r of every partial), reduce the
      slice and cast it, all-gather the cast slices: (C-1)/C of the partial in fp32 plus (C-1)/C in
      `dtype` per rank, 1.5x the bytes of a bf16 ring all-reduce, C / 1.5 times fewer than `gather`;
    - `nccl`: `gather` below GATHER_MAX_BYTES of partial per rank, else `scatter`;
    - `auto`: `peer` where the group has it, else `nccl`."""
    p = partial.float().contiguous()
    c = group.size
    if mode in ("auto", "peer"):
        out = group.peer_all_reduce(p, dtype, order, required=mode == "peer")
        if out is not None:
            return out
        if mode == "peer" and not (p.is_cuda and torch.cuda.is_current_stream_capturing()):
            raise DetauditError(
                f"{ALLREDUCE_ENV}=peer: this TP group has no peer-memory transport (detaudit's NCCL groups only)"
            )
    if mode == "gather" or (mode != "scatter" and p.numel() * 4 < GATHER_MAX_BYTES) or p.numel() < c:
        parts = group.all_gather(p)
        return _sum_cast(parts.view(c, -1), dtype, reduce, order).view(partial.shape)
    flat = p.view(-1)
    n = flat.numel()
    per = -(-n // c)
    if per * c != n:
        flat = torch.nn.functional.pad(flat, (0, per * c - n))
    mine = group.all_to_all(flat.view(c, per))  # [C, per]: slice `rank` of every rank's partial
    reduced = _sum_cast(mine, dtype, reduce, order)
    return group.all_gather(reduced).view(-1)[:n].view(partial.shape)


def _sum_cast(parts: Tensor, dtype: torch.dtype, reduce, order: str) -> Tensor:
    """parts [C, per] fp32 -> `reduce` of the C rows, cast to `dtype`: on a GPU one Triton launch of the
    same additions in `order` (`peer_reduce.reduce_cast`: the sum stays in registers), else op by op."""
    if parts.is_cuda and peer_reduce.triton is not None and parts.is_contiguous():
        return peer_reduce.reduce_cast(parts, dtype, order)
    return reduce(list(parts.unbind(0))).to(dtype)


def sequential_sum(partials: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """(((p0 + p1) + p2) + ...) in rank order, in the partials' dtype, then cast."""
    acc = partials[0] if len(partials) > 1 else partials[0].clone()  # (the first add allocates the sum)
    for p in partials[1:]:
        acc = acc + p
    return acc.to(dtype)
