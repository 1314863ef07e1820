"""`bf16`'s mixture-of-experts experts on GPU as serving engines run them: the (token, slot) rows sorted
by expert on the device, then one grouped GEMM launch per projection over every expert's rows (torch's
grouped mm, `torch.nn.functional.grouped_mm` / `torch._grouped_mm`: CUTLASS bf16 kernels), in prefill
and decode alike. No host sync (the experts' row offsets stay on the device), so decode steps are
captured in CUDA graphs; no expert computes rows nobody routed to it.

As in vLLM's fused MoE: the gate / up product of each row's token in its expert, silu(gate) * up, the down
product, then each token's k outputs weighted by its gates and summed (`NativeBackend.expert_down`: in the
model dtype, by torch's sum), then the TP all-reduce. The row order inside an expert (tokens in order,
a stable sort) and the grouped kernel's tiling are the library's: the bits of a row may depend on how
many rows its expert got, as in a deployment (what the audit measures for bf16).

torch runs its grouped mm without a host sync only in its CUTLASS path: bf16 operands and output on a
GPU of compute capability 9.x or 10.x (H100, H200, B200); elsewhere torch loops over the experts after
copying the offsets to the host, so `usable` keeps today's layouts there (`backends/experts.py`). On
CPU torch's grouped mm is that loop: the tests run `run` there to check the sorting, offsets and
scatter back against the per-expert layouts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from detaudit.backends import experts as layouts

_grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def usable(h: Tensor, w: layouts.ExpertWeights) -> bool:
    """Whether torch's grouped mm runs h's experts in one launch without a host sync: bf16 on a GPU of
    compute capability 9.x / 10.x (its CUTLASS path), operands it takes (`aligned`)."""
    if _grouped_mm is None or not h.is_cuda or h.dtype != torch.bfloat16 or not aligned(h, w):
        return False
    return torch.cuda.get_device_capability(h.device)[0] in (9, 10)


def aligned(h: Tensor, w: layouts.ExpertWeights) -> bool:
    """Whether every operand's rows are whole multiples of 16 bytes, as torch's grouped mm requires: the
    hidden size and a rank's expert intermediate size (the activation's and the down weight's rows)."""
    n = 16 // h.element_size()
    return h.shape[1] % n == 0 and (w.gate_up[0].shape[1] // 2) % n == 0


def describe() -> str:
    name = "torch.nn.functional.grouped_mm" if hasattr(F, "grouped_mm") else "torch._grouped_mm"
    return (
        f"GPU, bf16, compute capability 9.x / 10.x: (token, slot) rows sorted by expert on the device, one "
        f"{name} launch (CUTLASS) per projection over every expert's rows, prefill and decode (no host "
        "sync, decode in CUDA graphs), outputs in bf16; elsewhere: every expert on every token by torch.bmm in "
        "decode and up to 64 tokens, one F.linear per expert over its rows in prefill"
    )


def grouped(x: Tensor, w: Tensor, offs: Tensor) -> Tensor:
    """x[R, K] (rows sorted by expert) times each expert's w[E, N, K]^T over its rows: [R, N] in x's dtype.
    `offs` [E] int32: the end of each expert's rows. w's transposed view is column-major, the layout
    torch's kernel reads without a copy."""
    return _grouped_mm(x, w.transpose(1, 2), offs=offs)


def run(backend, h: Tensor, experts: Tensor, gates: Tensor, w: layouts.ExpertWeights, ctx, name: str = "") -> Tensor:
    """The MoE layer's residual delta for h[T, H], as `Backend.experts` returns it: each local rank's
    experts by grouped products, each token's outputs combined by `backend.expert_down`, reduced across
    the TP ranks. A prefill whose products would pass `layouts.PREFILL_BYTES` runs in pieces of tokens
    (every op after the router is a token's own)."""
    t, k = experts.shape
    inter = w.gate_up[0].shape[1] // 2
    row = (3 * inter + 2 * h.shape[1]) * h.element_size()  # gate / up, activation, down and its scatter
    step = max(1, -(-t // max(1, -(-t * k * row // layouts.PREFILL_BYTES))))
    partials = []
    for r in range(len(w.gate_up)):
        outs = [
            _piece(backend, h[s : s + step], experts[s : s + step], gates[s : s + step], w, r, ctx.size, name)
            for s in range(0, max(t, 1), step)
        ]
        partials.append(outs[0] if len(outs) == 1 else torch.cat(outs))
    return ctx.reduce(partials)


def _piece(backend, h: Tensor, experts: Tensor, gates: Tensor, w, rank: int, tp_size: int, name: str) -> Tensor:
    t, k = experts.shape
    flat = experts.reshape(-1)  # row t*k + j: token t's j-th expert
    by_expert, order = torch.sort(flat, stable=True)  # sorted row -> (token, slot) row
    # the end of each expert's rows, on the device (torch.bincount would read its size back to the host)
    ids = torch.arange(w.num_experts, device=flat.device, dtype=by_expert.dtype)
    offs = torch.searchsorted(by_expert, ids, right=True).to(torch.int32)
    gate_up = grouped(h[order // k], w.gate_up[rank], offs)  # [T*k, 2 I/C]: gate, then up
    half = gate_up.shape[1] // 2
    act = backend.silu_mul(gate_up[:, :half], gate_up[:, half:])

    def product() -> Tensor:  # [T, k, H], (token, slot) order
        y = grouped(act, w.down[rank], offs)
        return torch.empty_like(y).index_copy_(0, order, y).view(t, k, -1)

    return backend.expert_down(product, gates, tp_size, act.shape[-1], name)
