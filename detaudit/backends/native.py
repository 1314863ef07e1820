"""`bf16`: whatever the stack does by default. cuBLAS / oneDNN GEMMs, PyTorch's SDPA attention, and
the library all-reduce (NCCL ring on GPU, gloo on CPU) in the model dtype. On GPU the row-local ops are
fused kernels, as a serving engine's are: RMSNorm with the residual add (`kernels/fused.py`), and the
attention mask in additive form, built once per step; mixture-of-experts layers run one grouped GEMM per
projection (`native_moe.py`)."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from detaudit.backends import native_moe, register_backend
from detaudit.backends.allreduce import sequential_sum
from detaudit.backends.base import Backend, ProcessGroup, library_versions
from detaudit.backends.kernels import fused
from detaudit.backends.row_ops import fused_or_torch


@register_backend("bf16", "native")
class NativeBackend(Backend):
    name = "bf16"

    def __init__(self) -> None:
        super().__init__()
        self._transposed: dict[int, tuple[Tensor, Tensor]] = {}  # id(weight) -> (weight, weight.t())

    def _product(self, x: Tensor, weight: Tensor) -> Tensor:
        """`F.linear(x, weight)` without a bias. For a 2-D CUDA input, the `torch.mm(x, weight.t())` it
        runs there (the same call, so the same cuBLAS problem and bits), with the transposed view made
        once per weight: eager decode is host-bound, and F.linear's extra dispatch layer and the
        per-call view cost about 5 of its 18-21 us per call on the GPU machines' hosts. The entry holds
        the weight itself, so its id
        cannot be reused while it is kept; the cache lives as long as this backend (one engine)."""
        if x.dim() != 2 or not x.is_cuda:
            return F.linear(x, weight)
        hit = self._transposed.get(id(weight))
        if hit is None or hit[0] is not weight:
            hit = self._transposed[id(weight)] = (weight, weight.t())
        return torch.mm(x, hit[1])

    def linear(self, x: Tensor, weight: Tensor) -> Tensor:
        return self._product(x, weight)

    def row_partial(self, x: Tensor, weight: Tensor, tp_size: int, name: str = "") -> Tensor:
        return self._product(x, weight)

    def row_output(self, x: Tensor, weight: Tensor, dtype: torch.dtype, name: str = "") -> Tensor:
        return self._product(x, weight).to(dtype)

    def combine(self, partials: Sequence[Tensor], dtype: torch.dtype) -> Tensor:
        # Emulated TP: rank-order sequential sum. A real ring all-reduce adds in an order that
        # depends on the tensor size and rank count; emulation cannot reproduce it.
        if len(partials) == 1:  # TP 1: the partial itself, cast (sequential_sum's copy changes no bit)
            return partials[0].to(dtype)
        return sequential_sum(partials, dtype)

    def all_reduce(self, partial: Tensor, group: ProcessGroup, dtype: torch.dtype) -> Tensor:
        return group.all_reduce_sum(partial).to(dtype)

    def experts(self, h: Tensor, experts: Tensor, gates: Tensor, weights, ctx, decode: bool, name: str = "") -> Tensor:
        """On GPUs where torch's grouped mm runs without a host sync, as serving engines run experts: one
        grouped launch per projection, prefill and decode (`native_moe`); elsewhere (CPU) the contract's
        layouts over the products below."""
        if native_moe.usable(h, weights):
            return native_moe.run(self, h, experts, gates, weights, ctx, name)
        return super().experts(h, experts, gates, weights, ctx, decode, name)

    def expert_linear(self, x: Tensor, w: Tensor) -> Tensor:
        # (not `_product`: an expert's weight is a fresh view of the stacked experts at every call)
        return torch.bmm(x, w.transpose(1, 2)) if x.dim() == 3 else F.linear(x, w)

    expert_matmul = expert_linear  # the down projection's products: in the model dtype too

    def expert_down(self, product, gates: Tensor, tp_size: int, k_local: int, name: str = "") -> Tensor:
        """As serving engines combine experts natively: the outputs in the model dtype, each weighted and
        the token's experts summed by the library's reduction."""
        y = product()  # [T, k, N]
        return (y * gates[..., None]).to(y.dtype).sum(dim=1)

    def row_ops(self, device):
        return fused_or_torch(self, device)  # its GPU rms_norm is the fused kernel

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        return fused.silu_mul(gate, up) if fused.usable(gate) else F.silu(gate) * up  # the same bits

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        if fused.usable(x):  # GPU: one program per row, as serving engines' fused RMSNorm kernels
            return fused.rms_norm(x, weight, eps)[0]
        # the same kernels as xf * rsqrt(mean(xf^2) + eps), cast, * weight; in place where the operand
        # is this call's own temporary (no allocation, the same elementwise results)
        xf = x.float()
        r = xf.pow(2).mean(-1, keepdim=True).add_(eps).rsqrt_()
        if x.dtype == torch.float32:
            return xf * r * weight
        return xf.mul_(r).to(x.dtype).mul_(weight)

    def attention_plan(self, q_pos: Tensor, kv_len: int, window: int | None = None) -> dict:
        """A per-step memo for `attention` (the engine makes one per forward step and passes it to every
        layer): the boolean mask, built once per step instead of once per layer."""
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
        mask = None if plan is None else plan.get("mask")
        if mask is None or mask.shape[-1] != k.shape[2]:
            keys = torch.arange(k.shape[2], device=q.device).view(1, 1, 1, -1)
            qp = q_pos.view(q_pos.shape[0], 1, -1, 1)
            mask = keys <= qp
            if window is not None:  # sliding window: p - window < j <= p
                mask = mask & (keys > qp - window)
            if q.is_cuda:
                # on GPU the additive form (0 / -inf in the model dtype), built once per step: SDPA's call
                # costs half the host time with it (35 vs 70 us on the H100 host, where the boolean mask is
                # converted on every call); a choice of bf16's, not an invariant (it gives other bits than
                # the boolean form at some shapes)
                mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
            if plan is not None:
                plan["mask"] = mask
        # grouped-query attention inside SDPA (no repeated copies of K/V, as serving engines do)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])

    def log_softmax(self, logits: Tensor) -> Tensor:
        return torch.log_softmax(logits.float(), dim=-1)

    def describe(self) -> dict[str, str]:
        return {
            "backend": self.name,
            "matmul": "F.linear (cuBLAS / oneDNN-MKL, library-chosen tiling)",
            "attention": "torch scaled_dot_product_attention (GPU: additive 0 / -inf mask in the model dtype)",
            "rms_norm": "fp32; CPU: torch mean over hidden; GPU: one Triton program per row, residual add fused "
            "(as serving engines' fused add + RMSNorm kernels)",
            "all_reduce": "library all-reduce (NCCL / gloo) in model dtype; emulated: rank-order sum",
            "experts": "outputs weighted and summed over the top-k by torch.sum in the model dtype; products: "
            + native_moe.describe(),
            "sdpa_backends": sdpa_backends(),
            "tf32": "off",
            **library_versions(),
        }


def sdpa_backends() -> str:
    """Which CUDA attention kernels PyTorch may pick for SDPA: on an H100 the default pick for decode
    shapes was not run-to-run deterministic, math-only was."""
    b = torch.backends.cuda
    flags = {
        "flash": b.flash_sdp_enabled(),
        "mem_efficient": b.mem_efficient_sdp_enabled(),
        "cudnn": getattr(b, "cudnn_sdp_enabled", lambda: False)(),
        "math": b.math_sdp_enabled(),
    }
    return " ".join(f"{k}={'on' if v else 'off'}" for k, v in flags.items())
