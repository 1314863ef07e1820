"""The backend contract: how every reduction of a forward pass is computed.

`Backend` declares every ability a model layer may use, each with its default; a backend subclasses it
and overrides what it computes its own way. Model layers make one call each and never ask what a
backend can do (the model of vLLM's `quant_method`: a layer calls `self.quant_method.apply(...)`):

- `linear(x, w)`: x[..., K] @ w[N, K]^T in x.dtype: column-parallel and replicated layers;
- `row_parallel(x, shards, ctx, name)`: a row-parallel layer (o_proj, down_proj) whole: this process's
  K-slices' products and their TP combine (`combine` in emulated TP, `row_output` at TP 1 in process,
  `all_reduce` of `row_partial` in real TP), rounded once to `ctx.dtype`;
- `experts(h, experts, gates, weights, ctx, decode, name)`: a mixture-of-experts MLP after its router,
  over the weights `expert_weights` laid out for this backend (`backends/experts.py`);
- `row_ops(device)`: the per-token steps between the products (add + RMSNorm, q / k norm +
  rotary + cache write, silu * up), PyTorch ops around this backend's reductions or one fused GPU kernel
  each (`backends/row_ops.py`);
- `replays_decode(device, tp, routes)` / `capture(forward)`: whether the built-in engine records a CPU
  decode step once and replays it, and the recorder (`kernels/cpu_replay.py`; `WHOLE_CACHE_EXACT`);
- `attention(q, k, v, q_pos, scale, window, plan)` with a per-step memo `attention_plan(...)`;
  `paged_attention(...)`: the same function over vLLM's paged KV cache and ragged query runs, read in
  place on the device (the vLLM plugin's attention on CUDA); None where the backend has no such kernel;
- `rms_norm`, `silu_mul`, `log_softmax`: row-local;
- `describe()`: how it computes, for the manifest; `activate()`: its numeric switches, restored in
  `finally`, re-entrant.

The pieces `row_parallel` and the experts are built from, which emulated TP, the vLLM plugin, the
benchmarks and the tests also call:
- `row_partial(x, w, tp_size, name)`: this rank's partial sum of a row-parallel layer, x[..., K/C],
  w[N, K/C]; its dtype is the backend's choice (bio and bio+tbik keep fp32);
- `row_output(x, w, dtype, name)`: a TP-1 layer's product rounded once to `dtype`, bit for bit
  `combine([row_partial(x, w, 1)], dtype)`, in one kernel where the backend can;
- `combine(partials, dtype)`: the fixed-order reduction of all C partials, in rank order; the combine of
  one partial is the partial cast to `dtype`, bit for bit;
- `all_reduce(partial, group, dtype)`: the same reduction across real TP ranks (the one TP seam);
- experts: `expert_linear(x, w)` (gate / up of an expert's rows, x[R, K] @ w[N, K]^T, or of every expert,
  x[E, R, K] @ w[E, N, K]^T, in x's dtype), `expert_matmul(x, w)` (the same shapes for the down
  projection, in the backend's partial dtype), `expert_down(product, gates, tp_size, k_local, name)`
  (the down projection and each token's weighted sum over its experts: `product()` gives every (token,
  slot) output [T, k, N], or, where `expert_leaf_plan` is not None, every tree leaf's [leaves, T, k, N];
  gates [T, k] fp32), `expert_leaf_plan(k_local, tp_size, name)` ((leaf, leaves) where the down
  projection's K is reduced along a tree, else None), `grouped_experts(h)` (whether every expert's rows
  go in one launch per projection, `expert_runs_matmul`).

Conventions: `attention`'s q[B, Hq, T, D]; k, v[B, Hkv, L, D] are the KV cache, already holding the new
tokens; q_pos[B, T] the queries' absolute positions; key j is visible to a query at p iff j <= p, with a
sliding `window` iff p - window < j <= p. `silu_mul`'s gate is often a strided column slice of a merged
gate / up product, whose width changes with the TP size.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from detaudit.backends import experts as layouts
from detaudit.backends.kernels import cpu_replay
from detaudit.backends.row_ops import TorchOps

ReplayUnsupported = cpu_replay.ReplayUnsupported  # (`capture`'s refusal, for the engine)


class ProcessGroup:
    """A TP process group: `builtin/dist.py`'s `TorchGroup` (the only place, with the peer transport
    `backends/peer.py`, that talks to torch.distributed). A group without a peer-memory transport keeps
    the defaults below (None: the caller moves the partials through the group's collectives)."""

    rank: int
    size: int

    def all_gather(self, t: Tensor) -> Tensor:  # [C, *t.shape], rank order
        raise NotImplementedError

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        raise NotImplementedError

    def all_to_all(self, t: Tensor) -> Tensor:  # t[C, ...]: row j to rank j; rows received, rank order
        raise NotImplementedError

    def peer_all_reduce(self, p: Tensor, dtype: torch.dtype, order: str, required: bool = False) -> Tensor | None:
        """The fixed-order all-reduce of fp32 `p` over peer memory, or None where the group has none."""
        return None

    def peer_row_all_reduce(
        self, m: int, n: int, dtype: torch.dtype, order: str, rows_partial, device: torch.device, routed=None
    ) -> Tensor | None:
        """A row-parallel layer's product and all-reduce with the transfer overlapped, or None."""
        return None


@dataclass
class TPContext:
    """Where a layer runs: its backend, the TP size C, this process's rank (0 in emulated mode), whether
    this process computes every rank's shards (emulated), its process group (real TP; None at TP 1 in
    process) and the model dtype."""

    backend: Backend
    size: int
    rank: int
    emulated: bool
    group: ProcessGroup | None = None
    dtype: torch.dtype = torch.bfloat16

    @property
    def local_ranks(self) -> range:
        """Ranks whose shards this process holds."""
        return range(self.size) if self.emulated else range(self.rank, self.rank + 1)

    def reduce(self, partials: list[Tensor]) -> Tensor:
        """This process's partials (one per local rank) reduced across the TP group: the backend's
        combine in emulated TP, its all-reduce in real TP; at TP 1 in process the partial itself (the
        caller's residual add rounds it, bit for bit the combine of one partial)."""
        b = self.backend
        if self.emulated:
            return b.combine(partials, self.dtype)
        if self.group is None:
            return partials[0]
        return b.all_reduce(partials[0], self.group, self.dtype)


class Backend:
    """The contract (see the module docstring). `name`: the registry name; `COLUMN_INVARIANT`: a
    column's bits of `linear` do not depend on how many columns share the product (merged q / k / v and
    gate / up then give the same bits as separate products, so the engine merges them on CPU too);
    `REDUCE_ORDER`: the order the fixed-order all-reduce adds in ("rank" or "tree", as the peer kernels
    name them); `WHOLE_CACHE_EXACT`: attention over a whole cache gives the bits of attention over the slots
    up to the furthest position (slots past a query's position are never added), so a CPU decode step can
    be captured once over the whole cache and replayed (`builtin.graphs.replayed_step`)."""

    name = "?"
    COLUMN_INVARIANT = False
    REDUCE_ORDER = "rank"
    WHOLE_CACHE_EXACT = False

    def __init__(self) -> None:
        self._flags = TorchFlags()

    def activate(self) -> contextlib.AbstractContextManager[None]:
        return self._flags.activate()

    def describe(self) -> dict[str, str]:
        raise NotImplementedError

    # ---- products
    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        raise NotImplementedError

    def row_partial(self, x: Tensor, weight: Tensor, tp_size: int, name: str = "") -> Tensor:
        raise NotImplementedError

    def row_output(self, x: Tensor, weight: Tensor, dtype: torch.dtype, name: str = "") -> Tensor:
        return self.combine([self.row_partial(x, weight, 1, name)], dtype)

    def combine(self, partials: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def all_reduce(self, partial: Tensor, group: ProcessGroup, dtype: torch.dtype) -> Tensor:
        raise NotImplementedError

    def row_parallel(self, x: Tensor, shards: Sequence[Tensor], ctx: TPContext, name: str = "") -> Tensor:
        """A row-parallel layer: x[..., K/C * local ranks] times this process's weight shards, combined
        across the TP ranks, in ctx.dtype."""
        if ctx.emulated:
            k = shards[0].shape[1]
            parts = [self.row_partial(x[..., i * k : (i + 1) * k], w, ctx.size, name) for i, w in enumerate(shards)]
            return self.combine(parts, ctx.dtype)
        if ctx.group is None:  # TP 1 in process (a TP-1 process group, DETAUDIT_TP1_GROUP, all-reduces)
            return self.row_output(x, shards[0], ctx.dtype, name)
        return self.row_group(x, shards[0], ctx.group, ctx.dtype, name)

    def row_group(self, x: Tensor, weight: Tensor, group: ProcessGroup, dtype: torch.dtype, name: str = "") -> Tensor:
        """A real-TP rank's row-parallel layer, bit for bit `all_reduce(row_partial(x, w, C))`; a backend
        may overlap the two."""
        return self.all_reduce(self.row_partial(x, weight, group.size, name), group, dtype)

    # ---- mixture of experts (`backends/experts.py`)
    def expert_weights(self, gate_up: list[Tensor], down: list[Tensor], ctx: TPContext, name: str = ""):
        """The experts' weights laid out for this backend, per local rank: gate_up [E, 2 I/C, H] (gate rows,
        then up rows), down [E, H, I/C] (leaf-major [E, leaves, H, leaf] where `expert_leaf_plan` says)."""
        return layouts.ExpertWeights.of(self, gate_up, down, ctx, name)

    def experts(
        self, h: Tensor, experts: Tensor, gates: Tensor, weights, ctx: TPContext, decode: bool, name: str = ""
    ) -> Tensor:
        """The MLP's output for h[T, H] given each token's experts [T, k] and fp32 gates [T, k], reduced
        across the TP ranks (a partial at TP 1 in process, as `TPContext.reduce` says)."""
        return layouts.run(self, h, experts, gates, weights, ctx, decode, name)

    def expert_linear(self, x: Tensor, w: Tensor) -> Tensor:
        raise NotImplementedError(f"backend {self.name} runs no mixture-of-experts layer")

    def expert_matmul(self, x: Tensor, w: Tensor) -> Tensor:
        raise NotImplementedError(f"backend {self.name} runs no mixture-of-experts layer")

    def expert_down(self, product, gates: Tensor, tp_size: int, k_local: int, name: str = "") -> Tensor:
        raise NotImplementedError(f"backend {self.name} runs no mixture-of-experts layer")

    def expert_leaf_plan(self, k_local: int, tp_size: int, name: str = "") -> tuple[int, int] | None:
        return None

    def grouped_experts(self, h: Tensor) -> bool:
        return False

    def expert_runs_matmul(self, x, src, w, runs, dst, out_rows: int, out_dtype: torch.dtype = torch.float32):
        raise NotImplementedError(f"backend {self.name} has no grouped expert products")

    # ---- row-local steps
    def row_ops(self, device: torch.device):
        """The engine's per-token steps (`backends/row_ops.py`), chosen once per model load."""
        return TorchOps(self)

    def replays_decode(self, device: torch.device, tp: int, routes: bool) -> bool:
        """Whether the built-in engine records a CPU decode step once and replays it (`capture`): this
        backend's attention over the whole cache is exact (`WHOLE_CACHE_EXACT`), TP 1, no MoE routing, and
        DETAUDIT_CPU_REPLAY allows it (`kernels/cpu_replay.py`)."""
        return cpu_replay.wanted(device.type, self.WHOLE_CACHE_EXACT, tp, routes)

    def capture(self, forward):
        """`forward()` run once and recorded: a `cpu_replay.Replay` whose `run()` makes its calls again and
        returns its outputs. Raises `cpu_replay.ReplayUnsupported` where the step cannot be recorded."""
        return cpu_replay.capture(forward)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        raise NotImplementedError

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up

    def log_softmax(self, logits: Tensor) -> Tensor:
        raise NotImplementedError

    def attention_plan(self, q_pos: Tensor, kv_len: int, window: int | None = None) -> dict:
        """A memo shared by the layers of one forward step (same positions), passed to `attention`."""
        return {}

    def attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        q_pos: Tensor,
        scale: float,
        window: int | None = None,
        plan: dict | None = None,
    ) -> Tensor:
        raise NotImplementedError

    def paged_attention(
        self,
        query: Tensor,
        key_cache: Tensor,
        value_cache: Tensor,
        block_table: Tensor,
        query_start_loc: Tensor,
        seq_lens: Tensor,
        max_query_len: int,
        scale: float,
        out: Tensor,
    ) -> Tensor | None:
        """`attention` of a step's ragged query runs (query / out [tokens, Hq, D], request b's queries at
        query_start_loc[b] .. [b + 1], the last of its seq_lens[b] positions) over a paged cache
        (key_cache / value_cache [pages, page size, Hkv, D], request b's key j in page
        block_table[b, j // page size]), bit for bit `attention` over each request's keys in a contiguous
        cache; writes `out`'s query rows. None where this backend has no such kernel on out's device."""
        return None


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
