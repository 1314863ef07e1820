"""Rotary embedding and SiLU-and-mul inside vLLM for `bio` / `bio+tbik`, on CPU and GPU alike: the
built-in engine's own functions, so that a vLLM rollout and the built-in engine compute these steps of
every token with the same ops (vLLM's C++ / CUDA kernels would round elsewhere).

- Rotary: detaudit's `Rotary` / `apply_rotary` (fp32 angles, rotate-half in the model dtype) instead of
  vLLM's kernel and its precomputed cos / sin cache; the angles once per forward pass, as the built-in
  engine computes them once per step (`_step_cache`); on GPU q and k each in one launch
  (`row_ops.rotary_rows`: `fused.rope_rows`, the bits of the op-by-op rotary). Only vLLM's plain
  `RotaryEmbedding` (the default, unscaled full-width neox rotary) is replaced; building any other
  rotary class (Llama-3 / YaRN / linear scaling, M-RoPE, partial rotary, ...) under the plugin fails,
  naming it, instead of running vLLM's kernel unseen.
- SiLU-and-mul: the backend's `silu_mul`, what the built-in engine's MLP runs (on GPU the fused kernel,
  the bits of `F.silu(gate) * up`; on CPU bio's position-independent formula).

Both classes replace vLLM's through its out-of-tree registration (`CustomOp.register_oot`) and override
`forward` itself, so vLLM's per-platform dispatch (its CUDA kernel, a compiled native path) never runs.
"""

from __future__ import annotations

_ROW_OPS: dict = {}  # (backend, device) -> the backend's row ops there


def row_ops(backend, device):
    """The backend's row ops on `device` (what the built-in engine runs there), made once per process:
    every patched layer of the plugin takes them from here."""
    ops = _ROW_OPS.get((backend, device))
    if ops is None:
        ops = _ROW_OPS[(backend, device)] = backend.row_ops(device)
    return ops


def install(backend, marker, tp_rank) -> None:
    _install_rotary(backend, marker, tp_rank)
    _install_silu_and_mul(backend, marker, tp_rank)


def _install_rotary(backend, marker, tp_rank) -> None:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding, RotaryEmbeddingBase

    from detaudit.builtin.layers import Rotary

    class DetauditRotaryEmbedding(RotaryEmbedding):
        """The default (unscaled) rotary embedding as the built-in engine computes it."""

        def forward(self, positions, query, key=None):
            if not self.is_neox_style or self.rotary_dim != self.head_size:
                raise NotImplementedError(
                    f"detaudit {backend.name}: only full-width rotate-half (neox) rotary runs through the plugin "
                    f"(this layer: neox={self.is_neox_style}, rotary_dim {self.rotary_dim} of {self.head_size})"
                )
            marker.op("rotary", tp_rank())
            if not hasattr(self, "_detaudit_rotary"):
                self._detaudit_rotary = Rotary(self.head_size, float(self.base), positions.device)
            pos = positions.flatten()
            angles = (self.head_size, float(self.base), query.dtype)  # (`key` is the keys)
            cos, sin = _step_cache(angles, positions, lambda: self._detaudit_rotary.cos_sin(pos[None], query.dtype))
            cos, sin = cos[0, 0], sin[0, 0]  # [T, D]
            ops = row_ops(backend, query.device)

            def rotate(x):  # on GPU one launch (`fused.rope_rows`), apply_rotary's bits
                return ops.rotary_rows(x.reshape(pos.shape[0], -1), cos, sin, self.head_size).view(x.shape)

            return rotate(query), (rotate(key) if key is not None else None)

        forward_native = forward_cpu = forward_cuda = forward

    CustomOp.register_oot(DetauditRotaryEmbedding, name="RotaryEmbedding")

    base_init = RotaryEmbeddingBase.__init__

    def init(self, *args, **kwargs):
        if not isinstance(self, DetauditRotaryEmbedding):
            raise NotImplementedError(
                f"detaudit {backend.name}: vLLM's {type(self).__name__} (a rotary embedding other than the "
                "default unscaled one) is not covered by the detaudit plugin"
            )
        base_init(self, *args, **kwargs)

    RotaryEmbeddingBase.__init__ = init


_STEP: dict = {}  # (head size, base, dtype) -> (forward context, positions, (cos, sin)) of the last call


def _step_cache(key, positions, compute):
    """cos / sin of `positions`, computed once per forward pass rather than once per layer: every layer of
    a step passes the same `positions` tensor, and the values depend only on it (the same ops, so the
    same bits, in fewer kernels). A pass is vLLM's forward context, a new object per forward (warm-up and
    graph-capture passes included), held here with the positions so neither identity can be reused
    while the entry lives: a capture never picks up tensors computed outside it. Outside a forward
    context nothing is kept."""
    from vllm.forward_context import get_forward_context, is_forward_context_available

    ctx = get_forward_context() if is_forward_context_available() else None
    hit = _STEP.get(key)
    if ctx is not None and hit is not None and hit[0] is ctx and hit[1] is positions:
        return hit[2]
    value = compute()
    if ctx is not None:
        _STEP[key] = (ctx, positions, value)
    return value


def _install_silu_and_mul(backend, marker, tp_rank) -> None:
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.activation import SiluAndMul

    class DetauditSiluAndMul(SiluAndMul):
        def forward(self, x):
            marker.op("silu_and_mul", tp_rank())
            d = x.shape[-1] // 2
            gate, up = x[..., :d], x[..., d:]
            with backend.activate():
                out = backend.silu_mul(gate.reshape(-1, d), up.reshape(-1, d))
            return out.reshape(*x.shape[:-1], d)

        forward_native = forward_cpu = forward_cuda = forward

    CustomOp.register_oot(DetauditSiluAndMul, name="SiluAndMul")
