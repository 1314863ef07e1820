"""How the decoder's per-token steps between the products run, chosen once per model load by the
backend (`Backend.row_ops`): `TorchOps`, PyTorch ops around the backend's reductions, or `FusedOps`, the
GPU fast path (one Triton kernel per step, `kernels/fused.py`). The decoder's code is the same for both,
and so are the bits (tests/gpu and the interpreter checks compare the kernels with the PyTorch ops they
replace).

The steps:
- `add_norm(x, delta, norm)`: the residual sum s = x + delta (delta rounded to x's dtype first; x
  itself before the first layer) and its RMSNorm (`norm.weight`, `norm.eps`): (normed, s);
- `rope_store(q, k, v, step, cache, qk_norm)`: Qwen3's per-head q / k RMSNorm (`qk_norm`), the rotary
  embedding of q and k, and the writes of k and v into the cache rows `step.slots`; returns q as
  [B, Hq, T, D];
- `silu_mul(gate, up)`: the backend's silu(gate) * up.

With `merge_projections` the column-parallel layers compute q / k / v (and gate / up) as one product
per rank, as serving engines do on GPUs. On CPU the invariant backends merge too (`COLUMN_INVARIANT`: a
column's bits do not depend on how many columns share its product), which saves two products' fixed
costs per layer and changes no bit; bf16 keeps transformers' separate products there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.backends.kernels import fixed, fused


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """HF's rotate-half rotary embedding: elementwise products and one add per element, in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class TorchOps:
    # its steps are PyTorch ops and compiled CPU calls, which a CPU decode step's recording sees
    # (`kernels/cpu_replay.py`); FusedOps' Triton kernels (on CPU tensors: the interpreter) it would not
    REPLAYABLE = True

    def __init__(self, backend) -> None:
        self.backend = backend
        self.merge_projections = backend.COLUMN_INVARIANT

    def add_norm(self, x: Tensor, delta: Tensor | None, norm) -> tuple[Tensor, Tensor]:
        s = x if delta is None else x + delta.to(x.dtype)
        return self.backend.rms_norm(s, norm.weight, norm.eps), s

    def rope_store(self, q: Tensor, k: Tensor, v: Tensor, step, cache, qk_norm: tuple | None) -> Tensor:
        B, T, d = step.B, step.T, step.head_dim
        q, k = q.reshape(B, T, -1, d), k.reshape(B, T, -1, d)
        if qk_norm is not None:
            qw, kw, eps = qk_norm
            q, k = self.backend.rms_norm(q, qw, eps), self.backend.rms_norm(k, kw, eps)
        q = apply_rotary(q.transpose(1, 2), step.cos, step.sin)
        k = apply_rotary(k.transpose(1, 2), step.cos, step.sin)
        k_cache, v_cache = cache
        k_cache.view(-1, d).index_copy_(0, step.slots, k.transpose(1, 2).reshape(-1, d))
        v_cache.view(-1, d).index_copy_(0, step.slots, v.reshape(-1, d))
        return q

    def rotary_rows(self, x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor:
        """x[T, H*D] rotated by cos / sin[T, D], [T, H*D] (the vLLM plugin's rotary layer: q and k each
        alone, the cache written by vLLM)."""
        t = x.shape[0]
        return apply_rotary(x.reshape(t, -1, head_dim), cos[:, None], sin[:, None]).reshape(t, -1)

    def silu_mul(self, gate: Tensor, up: Tensor) -> Tensor:
        return self.backend.silu_mul(gate, up)


class FusedOps(TorchOps):
    """The same steps as one Triton kernel each (`kernels/fused.py`): the add + RMSNorm is the backend's
    own GPU RMSNorm kernel, the rotary kernel rounds where the PyTorch ops round (a head size it does not
    take goes op by op, with the same bits; silu * up is the backend's, on GPU `fused.silu_mul` already).
    Only for a backend whose GPU `rms_norm` is that kernel (`fused_or_torch`)."""

    REPLAYABLE = False

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self.merge_projections = True

    def add_norm(self, x: Tensor, delta: Tensor | None, norm) -> tuple[Tensor, Tensor]:
        y, s = fused.rms_norm(x, norm.weight, norm.eps, delta)
        return y, (x if s is None else s)

    def rope_store(self, q: Tensor, k: Tensor, v: Tensor, step, cache, qk_norm: tuple | None) -> Tensor:
        if not fused.rope_usable(q, step.head_dim):  # a head size the rotary kernel does not take
            return super().rope_store(q, k, v, step, cache, qk_norm)
        k_cache, v_cache = cache
        return fused.rope_store(
            q, k, v, step.cos, step.sin, k_cache, v_cache, step.slots, step.B, step.T, step.head_dim, qk_norm
        )

    def rotary_rows(self, x: Tensor, cos: Tensor, sin: Tensor, head_dim: int) -> Tensor:
        if not fused.rope_usable(x, head_dim):
            return super().rotary_rows(x, cos, sin, head_dim)
        return fused.rope_rows(x.reshape(x.shape[0], -1), cos, sin, head_dim)


class CompiledOps(TorchOps):
    """The PyTorch steps, but the residual add with its RMSNorm (`fixed.add_rms`) and the rotary embedding
    with the cache writes (without Qwen3's head norms, `fixed.rope_store`) as compiled rows, spread over
    threads where they are many, on CPU, with the same bits: the invariant backends', whose row kernels
    are compiled there already."""

    def add_norm(self, x: Tensor, delta: Tensor | None, norm) -> tuple[Tensor, Tensor]:
        out = fixed.add_rms(x, delta, norm.weight, norm.eps)
        return out if out is not None else super().add_norm(x, delta, norm)

    def rope_store(self, q: Tensor, k: Tensor, v: Tensor, step, cache, qk_norm: tuple | None) -> Tensor:
        if qk_norm is None:
            out = fixed.rope_store(q, k, v, step.cos, step.sin, step.pos, cache, step.head_dim)
            if out is not None:
                return out
        return super().rope_store(q, k, v, step, cache, qk_norm)


def fused_or_torch(backend, device, cpu: type[TorchOps] = TorchOps) -> TorchOps:
    """`FusedOps` where its kernels run (a CUDA device, Triton installed), `cpu` (`TorchOps`, or the
    invariant backends' `CompiledOps`) otherwise: for backends whose GPU RMSNorm is `fused.rms_norm` (bf16,
    bio, bio+tbik)."""
    return FusedOps(backend) if fused.usable(torch.empty(0, device=device)) else cpu(backend)
