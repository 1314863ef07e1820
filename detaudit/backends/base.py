"""The Backend protocol: how every reduction of a forward pass is computed.

A backend decides how matmuls, RMSNorm, log-softmax, attention and the tensor-parallel (TP)
all-reduce are computed. The engine's layers call these methods explicitly; nothing else in the
engine performs a reduction that can change with batch size or TP size.

Shapes and conventions:
- `linear(x, w)`: x[..., K] @ w[N, K]^T, returned in x.dtype. Column-parallel and replicated layers.
- `row_partial(x, w, tp_size)`: this rank's partial sum of a row-parallel layer (o_proj, down_proj);
  x[..., K/C], w[N, K/C]; `name` is the layer's name, for error messages. The dtype of the partial is the
  backend's choice (tbik keeps fp32).
- `row_output(x, w, dtype)`: a TP-1 row-parallel layer's whole product rounded once to `dtype`, bit for
  bit `combine([row_partial(x, w, 1)], dtype)`, in one kernel where the backend can (the GPU kernels
  round in their store: an fp32 output tile is never written).
- `combine(partials, dtype)`: the fixed-order reduction of all C partials, given in rank order.
  Used by emulated TP directly and, after an all-gather, by the default `all_reduce`. The combine of
  one partial must be the partial cast to `dtype`, bit for bit.
- `all_reduce(partial, group, dtype)`: the single TP seam in real TP mode.
- optional `row_all_reduce(x, w, group, dtype, name)`: a real-TP row-parallel layer in one call, bit for
  bit `all_reduce(row_partial(x, w, C), group, dtype)`, for backends that overlap the two (bio's peer
  transport sends each owner's rows while the next are computed).
- mixture-of-experts layers (a backend without these cannot run MoE models): `expert_linear(x, w)` is an
  expert's column-parallel product (gate / up) of its rows, x[R, K] @ w[N, K]^T, or of every expert at
  once, x[E, R, K] @ w[E, N, K]^T, in x's dtype; `expert_matmul(x, w)` the same shapes for the down
  projection, in the backend's partial dtype; `expert_down(product, gates, tp_size, k_local, name)` the
  row-parallel down projection and each token's weighted sum of its experts' outputs: the engine's
  `product()` returns every (token, slot) output [T, k, N] over this rank's K (`expert_matmul` of the
  rows routed to each expert), or, for a backend with `expert_leaf_plan(k_local, tp_size, name)` ->
  (leaf, leaves), whose down weights the engine stores leaf-major, each leaf's outputs [leaves, T, k, N];
  `gates[T, k]` are fp32. It returns this rank's partial [T, N], which `combine` / `all_reduce` reduce
  like a row-parallel layer's.
- `silu_mul(gate, up)`: the MLP's activation, silu(gate) * up in gate's dtype; gate is often a strided
  column slice of a merged gate / up product, whose width changes with the TP size.
- `attention(q, k, v, q_pos, scale, window=None)`: q[B, Hq, T, D]; k, v[B, Hkv, L, D] are the KV cache, already
  holding the new tokens; q_pos[B, T] are the queries' absolute positions; key j is visible to a query
  at position p iff j <= p; with `window` (sliding-window attention, passed only for layers that have
  one) iff p - window < j <= p. Returns [B, Hq, T, D] in q.dtype.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor


@runtime_checkable
class ProcessGroup(Protocol):
    """A TP process group. Implementations live in detaudit.builtin.dist (the only place that talks
    to torch.distributed)."""

    rank: int
    size: int

    def all_gather(self, t: Tensor) -> Tensor: ...  # [C, *t.shape], rank order
    def all_reduce_sum(self, t: Tensor) -> Tensor: ...
    def all_to_all(self, t: Tensor) -> Tensor: ...  # t[C, ...]: row j to rank j; rows received, rank order


@runtime_checkable
class Backend(Protocol):
    name: str

    def activate(self) -> contextlib.AbstractContextManager[None]: ...
    def linear(self, x: Tensor, weight: Tensor) -> Tensor: ...
    def row_partial(self, x: Tensor, weight: Tensor, tp_size: int, name: str = "") -> Tensor: ...
    def row_output(self, x: Tensor, weight: Tensor, dtype: torch.dtype, name: str = "") -> Tensor: ...
    def combine(self, partials: Sequence[Tensor], dtype: torch.dtype) -> Tensor: ...
    def all_reduce(self, partial: Tensor, group: ProcessGroup, dtype: torch.dtype) -> Tensor: ...
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor: ...
    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor: ...  # silu(gate) * up, in gate's dtype
    # optional flag: `FUSED_ROW_OPS = True` where `rms_norm` on GPU is `kernels.fused.rms_norm`: the
    # engine's GPU fast path (`builtin.ops.FusedOps`) then adds the residual inside that kernel and norms
    # Qwen3's q / k heads inside its rotary kernel, with those bits; `COLUMN_INVARIANT = True` where
    # `linear`'s column bits do not depend on the product's width: the engine then merges q / k / v and
    # gate / up into one product on CPU too
    def attention(
        self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, window: int | None = None
    ) -> Tensor: ...
    def log_softmax(self, logits: Tensor) -> Tensor: ...
    def describe(self) -> dict[str, str]: ...


class TorchFlags:
    """Re-entrant activation shared by all backends: pins the global torch numeric switches that
    can silently change results (TF32, reduced-precision reductions) and restores them in `finally`.
    Nesting is counted per instance, so an inner exit never undoes an outer activation."""

    _lock = threading.RLock()

    def __init__(self) -> None:
        self._depth = 0
        self._saved: dict[str, object] = {}

    @contextlib.contextmanager
    def activate(self) -> Iterator[None]:
        with self._lock:
            if self._depth == 0:
                self._saved = _read_flags()
                _write_flags(
                    {
                        "matmul_tf32": False,
                        "cudnn_tf32": False,
                        "bf16_reduced": False,
                        "fp16_reduced": False,
                    }
                )
            self._depth += 1
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    _write_flags(self._saved)

    @property
    def active(self) -> bool:
        return self._depth > 0


def _read_flags() -> dict[str, object]:
    m = torch.backends.cuda.matmul
    return {
        "matmul_tf32": m.allow_tf32,
        "cudnn_tf32": torch.backends.cudnn.allow_tf32,
        "bf16_reduced": m.allow_bf16_reduced_precision_reduction,
        "fp16_reduced": m.allow_fp16_reduced_precision_reduction,
    }


def _write_flags(flags: dict[str, object]) -> None:
    m = torch.backends.cuda.matmul
    m.allow_tf32 = bool(flags["matmul_tf32"])
    torch.backends.cudnn.allow_tf32 = bool(flags["cudnn_tf32"])
    m.allow_bf16_reduced_precision_reduction = bool(flags["bf16_reduced"])
    m.allow_fp16_reduced_precision_reduction = bool(flags["fp16_reduced"])


ALLREDUCE_ENV = "DETAUDIT_ALLREDUCE"  # how fixed-order all-reduces move data (`fixed_order_all_reduce`)
ALLREDUCE_MODES = ("auto", "nccl", "gather", "scatter", "peer")
GATHER_MAX_BYTES = 1 << 20  # auto: below this many fp32 bytes per rank, one all-gather (latency-bound)


def allreduce_mode() -> str:
    from detaudit.errors import DetauditError

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

    - `peer`: the group's peer-memory transport (GPU groups: `builtin/peer.py`, `kernels/peer_reduce.py`):
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
        peer = getattr(group, "peer_all_reduce", None)
        out = peer(p, dtype, order, required=mode == "peer") if peer is not None else None
        if out is not None:
            return out
        if mode == "peer" and not (p.is_cuda and torch.cuda.is_current_stream_capturing()):
            from detaudit.errors import DetauditError

            raise DetauditError(
                f"{ALLREDUCE_ENV}=peer: this TP group has no peer-memory transport (detaudit's NCCL groups only)"
            )
    if mode == "gather" or (mode != "scatter" and p.numel() * 4 < GATHER_MAX_BYTES) or p.numel() < c:
        return reduce(list(group.all_gather(p).unbind(0))).to(dtype)
    flat = p.view(-1)
    n = flat.numel()
    per = -(-n // c)
    if per * c != n:
        flat = torch.nn.functional.pad(flat, (0, per * c - n))
    mine = group.all_to_all(flat.view(c, per))  # [C, per]: slice `rank` of every rank's partial
    reduced = reduce(list(mine.unbind(0))).to(dtype)
    return group.all_gather(reduced).view(-1)[:n].view(partial.shape)


def sequential_sum(partials: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
    """(((p0 + p1) + p2) + ...) in rank order, in the partials' dtype, then cast."""
    acc = partials[0] if len(partials) > 1 else partials[0].clone()  # (the first add allocates the sum)
    for p in partials[1:]:
        acc = acc + p
    return acc.to(dtype)


def library_versions() -> dict[str, str]:
    out = {"torch": torch.__version__}
    if torch.cuda.is_available():
        out["cuda"] = str(torch.version.cuda)
        out["gpu"] = torch.cuda.get_device_name(0)
    try:
        import triton

        out["triton"] = triton.__version__
    except Exception:  # triton is optional (GPU only)
        pass
    return out
