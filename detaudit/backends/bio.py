"""`bio`: batch-invariant ops. Every reduction has a fixed shape and order, so a request's outputs do
not depend on how many other requests share its batch (see `kernels/fixed.py`):

- matmul / linear: CPU fixed-shape block products (bf16 operands with fp32 accumulation on CPUs with
  AVX-512 BF16, fp32 elsewhere: `kernels/cpu_bf16.py`, decided once per machine); GPU one persistent
  Triton kernel with one fixed tile config per dtype, no split-K, fp32 accumulation, fp32 inputs in
  IEEE precision (no TF32);
- RMSNorm and log-softmax: row-local, the row sum as a fixed-shape product with a ones vector (CPU) or
  one program per row (GPU; RMSNorm with the residual add in one kernel, `kernels/fused.py`);
- attention: KV cache updated before attention (the engine); GPU and CPU without numba: KV split into
  chunks of a fixed size (`SPLIT` keys, never a fixed number of chunks), fp32 online softmax, unseen
  chunks are exact no-ops; CPU with numba: one compiled kernel, each query row alone over the keys it
  sees (`kernels/cpu_attention.py`);
- TP all-reduce: the fp32 partials summed in rank order, cast once (deterministic, but the K split still
  depends on C: `bio` is batch invariant, not TP invariant; that is `bio+tbik`); moved by an all-gather
  (small messages) or a reduce-scatter by all-to-all then an all-gather of the cast slices, and on GPU
  groups by peer memory over NVLink (`allreduce.fixed_order_all_reduce`): the same additions every way.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from detaudit.backends import register_backend
from detaudit.backends.allreduce import allreduce_mode, describe_allreduce, fixed_order_all_reduce, sequential_sum
from detaudit.backends.base import Backend, ProcessGroup, library_versions
from detaudit.backends.kernels import (
    cpu_calls,
    cpu_gemm,
    fixed,
    fused,
    grouped_mm,
    triton_attn,
    triton_mm,
    triton_paged,
)
from detaudit.backends.row_ops import CompiledOps, fused_or_torch

SPLIT = 64  # keys per attention chunk


@register_backend("bio")
class BioBackend(Backend):
    name = "bio"
    # a product's column is computed alone (no reduction follows the column tiling), so merged q / k / v
    # and gate / up products give the same bits as separate ones (`backends/row_ops.py`)
    COLUMN_INVARIANT = True
    WHOLE_CACHE_EXACT = True  # the attention walks only the keys each row's position reaches
    REDUCE_ORDER = "rank"  # `_reduce`'s order, as the peer all-reduce kernels name it

    def __init__(self) -> None:
        super().__init__()
        self.allreduce = allreduce_mode()

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return fixed.matmul(x, weight, out_dtype=x.dtype)

    def row_partial(self, x: Tensor, weight: Tensor, tp_size: int, name: str = "") -> Tensor:
        return fixed.matmul(x, weight)  # fp32 partial

    def row_output(self, x: Tensor, weight: Tensor, dtype: torch.dtype, name: str = "") -> Tensor:
        return fixed.matmul(x, weight, out_dtype=dtype)  # the partial's store rounds once, like the cast

    def combine(self, partials: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
        if len(partials) == 1:  # TP 1: the fp32 partial, cast once (sequential_sum's copy changes no bit)
            return partials[0].float().to(dtype)
        return sequential_sum([p.float() for p in partials], dtype)

    def all_reduce(self, partial: Tensor, group: ProcessGroup, dtype: torch.dtype) -> Tensor:
        return fixed_order_all_reduce(partial, group, dtype, self._reduce, self.allreduce, self.REDUCE_ORDER)

    def row_group(self, x: Tensor, weight: Tensor, group: ProcessGroup, dtype: torch.dtype, name: str = "") -> Tensor:
        """A real-TP row-parallel layer: `all_reduce(row_partial(x, w))`, bit for bit. Where the group's
        peer transport takes the size (GPU prefill), the matmul runs a slice owner's rows at a time and
        each slice travels while the next is computed (`peer.PeerTransport.row_all_reduce`), or, where the
        backend has a routed matmul (`routed_partial`), the matmul stores each owner's rows in its area;
        the rows' values do not depend on how the rows are cut or where they are stored (the matmul is
        batch invariant)."""
        if self.allreduce in ("auto", "peer") and x.is_cuda and x.dim() == 2:
            x = x if x.is_contiguous() else x.contiguous()
            out = group.peer_row_all_reduce(
                x.shape[0],
                weight.shape[0],
                dtype,
                self.REDUCE_ORDER,
                lambda r0, r1: self.row_partial(x[r0:r1], weight, group.size, name),
                x.device,
                lambda: self.routed_partial(x, weight, group.size, name),
            )
            if out is not None:
                return out
        return self.all_reduce(self.row_partial(x, weight, group.size, name), group, dtype)

    def routed_partial(self, x: Tensor, weight: Tensor, tp_size: int, name: str = ""):
        """`write` where this backend's row partial can store its tile rows (128 rows each) into places
        the all-reduce chooses (`peer.PeerTransport.routed_all_reduce`), else None (bio's matmul has no
        routed epilogue)."""
        return None

    def _reduce(self, partials: Sequence[Tensor]) -> Tensor:
        """The cross-rank sum of fp32 partials, in fp32 (cast by the caller): rank order."""
        return sequential_sum(partials, torch.float32)

    def expert_linear(self, x: Tensor, w: Tensor) -> Tensor:
        return self.expert_matmul(x, w).to(x.dtype)

    def expert_matmul(self, x: Tensor, w: Tensor) -> Tensor:
        """fp32 products whose row bits do not depend on the other rows (however many the expert got), the
        same for one expert's rows (x[R, K], the chosen-rows layout) as for every expert's at once
        (x[E, R, K], the every-expert layout): on CPU both are `fixed.expert_matmul`'s fp32 block products
        (`fixed.matmul` would give bf16 rows to the bf16 micro-kernel, whose sums have other bits, and
        which layout a prefill takes depends on how many tokens share its step)."""
        if x.dim() == 3:
            return fixed.expert_matmul(x, w)
        return fixed.matmul(x, w) if x.is_cuda else fixed.expert_matmul(x[None], w[None])[0]

    def expert_runs_matmul(
        self,
        x: Tensor,
        src: Tensor,
        w: Tensor,
        runs: grouped_mm.Runs,
        dst: Tensor,
        out_rows: int,
        out_dtype: torch.dtype = torch.float32,
    ) -> Tensor:
        """Every expert's rows in one launch (GPU, `grouped_mm.usable`): the bits of `expert_matmul` on
        each expert's run, rows gathered from x[src] and stored at dst; leaf-major weights give every
        leaf apart (see `grouped_mm.grouped`)."""
        return grouped_mm.grouped(x, src, w, runs, dst, out_rows, out_dtype)

    def grouped_experts(self, h: Tensor) -> bool:
        return grouped_mm.usable(h)

    def expert_down(self, product, gates: Tensor, tp_size: int, k_local: int, name: str = "") -> Tensor:
        """Every expert's fp32 partial product of its rows, then each token's experts weighted and summed in
        top-k order in fp32 (on GPU in one kernel, the same ops)."""
        y = product()
        return grouped_mm.weighted_tree(y, gates) if grouped_mm.sums_usable(y) else weighted_experts(y, gates)

    def row_ops(self, device):
        return fused_or_torch(self, device, CompiledOps)  # its GPU rms_norm is the fused kernel

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        return fixed.silu_mul(gate, up)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if fused.usable(x):  # GPU: one program per row, the row's sum of squares in one fixed order
            return fused.rms_norm(x, weight, eps)[0]
        return _rms_norm(x, weight, eps)

    def attention_plan(self, q_pos: Tensor, kv_len: int, window: int | None = None) -> dict:
        """A per-step memo for `attention` (one per forward step, passed to every layer): the query rows'
        positions in the kernel's layout, computed once per step instead of once per layer."""
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
        return fixed.attention(q, k, v, q_pos, scale, SPLIT, window, plan)

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
        if not triton_attn.supported(query):  # the GPU kernel's bits; the CPU formulation has others
            return None
        return triton_paged.paged_attention(
            query, key_cache, value_cache, block_table, query_start_loc, seq_lens, max_query_len, scale, SPLIT, out
        )

    def log_softmax(self, logits: Tensor) -> Tensor:
        z = logits.float()
        z = z - z.amax(-1, keepdim=True)
        return z - torch.log(fixed.row_sum(torch.exp(z)))

    def describe(self) -> dict[str, str]:
        return {
            "backend": self.name,
            **fixed.describe_cpu(),
            "matmul_gpu": "Triton kernels (persistent; SWAP=1: one bf16 / fp16 product of up to 32 rows, "
            f"operands swapped, a program a tile), no split-K, fp32 accumulate; {triton_mm.describe()}",
            "silu_mul": "fp32 gate / (1 + exp(-gate)), rounded to the model dtype, * up; CPU: the compiled row "
            "kernel (cpu_kernels) where it runs, else exp by torch's vml kernel, the same code for every element",
            "rms_norm": "fp32; row sum of squares: CPU a fixed-shape product with ones; GPU one Triton program per "
            "row (residual add fused), BLOCK fp32 lanes in order then one tree",
            "log_softmax": "fp32; row max, then the row sum of exp as for rms_norm",
            "attention": f"KV chunks of {SPLIT} keys, fp32 online softmax, masked chunks exact no-ops "
            "(GPU: one Triton kernel, a program a block of BLOCK_R=16 query rows, WIDE_R=32 in 16-bit "
            "prefill, a row's bits the same in either; CPU: see cpu_kernels)",
            "all_reduce": "fp32 partials summed in rank order, cast once",
            "experts": "per expert, its routed rows' batch-invariant products (fp32 accumulate); each token's "
            "experts weighted and summed in top-k order in fp32",
            "experts_cpu": "fp32 block products in every layout (one expert's rows or every expert's at once)",
            "experts_gpu": grouped_mm.describe(),
            "all_reduce_impl": describe_allreduce(self.allreduce),
            "tf32": "off",
            **library_versions(),
        }


def weighted_experts(y: Tensor, gates: Tensor) -> Tensor:
    """sum_j gates[t, j] * y[..., t, j, :] for every token t, in j order, in fp32: y[..., T, k, N] (fp32)
    -> [..., T, N] (leading dims, such as tree leaves, each get the same elementwise ops)."""
    out = y[..., 0, :] * gates[:, :1]
    for j in range(1, gates.shape[1]):
        out = out + y[..., j, :] * gates[:, j : j + 1]
    return out


def _rms_compiled(x: Tensor, eps: float) -> Tensor | None:
    """fp32 x * rsqrt(mean(x^2) + eps) by the compiled row kernel (`kernels/cpu_rows.py`), or None where
    it does not run (no numba, DETAUDIT_CPU_COMPILED=off, a dtype other than bf16 / fp32)."""
    rows = cpu_calls.compiled("cpu_rows")
    if rows is None or x.dtype not in (torch.bfloat16, torch.float32):
        return None
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty(x2.shape, dtype=torch.float32)
    bf16 = x.dtype == torch.bfloat16
    xn, on = (x2.view(torch.int16) if bf16 else x2).numpy(), out.numpy()

    def part(lo: int, hi: int) -> None:  # a row's bits are the row's alone: any split gives the same
        rows.rms_rows(xn[lo:hi], bf16, eps, on[lo:hi])

    with cpu_gemm.profiled("detaudit::cpu_rms_rows"):
        cpu_calls.rows("rms", part, x2.shape[0], xn, None, on, bf16, eps)
    return out.view(x.shape)


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """bio's RMSNorm: fp32 x * rsqrt(mean(x^2) + eps) (on CPU the compiled row kernel where it runs, else op
    by op with the row sum of squares by `fixed.row_sum`), cast, * weight."""
    y = _rms_compiled(x, eps) if x.device.type == "cpu" else None
    if y is None:
        xf = x.float()
        var = fixed.row_sum(xf * xf) / x.shape[-1]
        y = xf * torch.rsqrt(var + eps)
    return (y.to(x.dtype) * weight) if x.dtype != torch.float32 else y * weight
