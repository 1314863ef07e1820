"""Attention inside vLLM on CUDA for `bio` / `bio+tbik`: an attention backend of its own, registered with
vLLM's attention-backend registry as `CUSTOM` (`vllm.v1.attention.backends.registry.register_backend`)
and selected by the engine (`attention_backend="CUSTOM"`, the server's `--attention-backend CUSTOM`).
vLLM's own choice on Hopper (FlashAttention 3, then FlashInfer, then its Triton kernel) splits the KV
sequence by the batch's shape; this one runs the backend's fixed-split attention (`backend.attention`:
on GPU the Triton kernel `kernels/triton_attn`) that the built-in engine runs.

- The KV cache is vLLM's paged cache in its Triton backend's layout ([blocks, 2, block size, KV heads,
  head dim]), written by vLLM's copy kernel (`triton_reshape_and_cache_flash`: every key and value
  stored as it is, no arithmetic); the metadata builder is the Triton backend's.
- Each step, every request's keys and values are gathered in position order into [requests, KV heads,
  longest, head dim], zero past each request's length (where the built-in engine's cache holds zeros),
  its queries into [requests, heads, longest query, head dim] with their positions, and one
  `backend.attention` call computes the step. That function's result for a query row depends only on
  the row, its position and the keys it sees (chunks a row cannot see are exact no-ops), so this gives
  the bits of the built-in engine's attention for the same tokens, whatever the batch and however
  vLLM's scheduler packs prefill and decode into the step.
- What it does not cover is refused when the layer is built, by name: ALiBi, sliding windows, soft
  caps, sinks, quantized KV caches, shared KV caches, encoder / cross attention, cascade attention,
  fused output quantization.

The gather costs two copies of the visible KV per layer and step (on top of the kernel's own reads):
the price of reusing the built-in engine's kernel unchanged rather than a second kernel reading
through the block table, whose bits would have to be shown equal to it. CUDA graphs are off under the
plugin (the engine runs vLLM eager: the step's lengths are read on the host).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadataBuilder,
)

CLASS_PATH = f"{__name__}.DetauditAttentionBackend"
_STATE: dict = {}  # the detaudit backend, the plugin's marker and the TP-rank getter (set by `register`)


def register(backend, marker, tp_rank) -> None:
    """Make `AttentionBackendEnum.CUSTOM` this backend in this process (vLLM loads the plugin, and so
    calls this, in every process that builds a model)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    _STATE.update(backend=backend, marker=marker, tp_rank=tp_rank)
    register_backend(AttentionBackendEnum.CUSTOM, CLASS_PATH)


class DetauditAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    # the step's lengths are read on the host (`_plan`): no graph capture
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.NEVER


class DetauditAttentionBackend(TritonAttentionBackend):
    supported_kv_cache_dtypes: ClassVar[list] = ["auto", "bfloat16", "float16", "float32"]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"  # vLLM maps a backend's name to its registry member

    @staticmethod
    def get_impl_cls() -> type["DetauditAttentionImpl"]:
        return DetauditAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[DetauditAttentionMetadataBuilder]:
        return DetauditAttentionMetadataBuilder

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return attn_type == AttentionType.DECODER

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False


def _refuse(what: str) -> None:
    name = _STATE["backend"].name if _STATE else "plugin"
    raise NotImplementedError(
        f"detaudit {name}: {what} is not covered by the invariant attention (only plain causal decoder "
        "attention over an unquantized KV cache runs through it)"
    )


class DetauditAttentionImpl(TritonAttentionImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if not _STATE:
            raise RuntimeError("detaudit's attention backend was selected but the detaudit plugin is not active")
        for bad, what in (
            (self.attn_type != AttentionType.DECODER, f"attention type {self.attn_type}"),
            (self.alibi_slopes is not None, "ALiBi"),
            (tuple(self.sliding_window) != (-1, -1), "a sliding window"),
            (bool(self.logits_soft_cap), "a logits soft cap"),
            (self.sinks is not None, "attention sinks"),
            (self.kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"), "a quantized KV cache"),
            (self.kv_sharing_target_layer_name is not None, "a KV cache shared with another layer"),
            (getattr(self, "chunk_lookback", -1) != -1, "chunked lookback"),
        ):
            if bad:
                _refuse(what)

    def forward(
        self,
        layer,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attn_metadata is None:  # vLLM's profiling run
            return output.fill_(0)
        if output_scale is not None or output_block_scale is not None:
            _refuse("fused output quantization")
        if attn_metadata.use_cascade:
            _refuse("cascade attention")
        if attn_metadata.causal is not True:
            _refuse("non-causal attention")
        if attn_metadata.mm_prefix_range_tensor is not None or attn_metadata.rswa_window is not None:
            _refuse("multimodal prefix ranges / windowed prefixes")
        backend, marker = _STATE["backend"], _STATE["marker"]
        marker.op("attention", _STATE["tp_rank"]())
        plan = _plan(attn_metadata, kv_cache.shape[2])
        key_cache, value_cache = kv_cache.unbind(1)  # [blocks, block size, KV heads, D]
        keys, values = (_gather(c, plan) for c in (key_cache, value_cache))
        q = query[plan["q_index"]].masked_fill(~plan["q_valid"][..., None, None], 0)  # [R, steps, H, D]
        with backend.activate():
            out = backend.attention(q.transpose(1, 2), keys, values, plan["q_pos"], self.scale)  # [R, H, steps, D]
        output[plan["q_rows"]] = out.transpose(1, 2)[plan["q_valid"]]
        return output


def _gather(cache: torch.Tensor, plan: dict) -> torch.Tensor:
    """[R, KV heads, longest, D]: each request's keys (or values) in position order, zero past its length."""
    rows = cache[plan["kv_block"], plan["kv_offset"]]  # [R, L, KV heads, D]
    return rows.masked_fill(~plan["kv_valid"][..., None, None], 0).transpose(1, 2).contiguous()


def _plan(meta, block_size: int) -> dict:
    """The step's index tensors, made once per step (the metadata object is shared by every layer of
    the step) from the lengths read on the host."""
    hit = getattr(meta, "_detaudit_plan", None)
    if hit is not None:
        return hit
    starts = meta.query_start_loc.tolist()
    n = len(starts) - 1
    lens = meta.seq_lens[:n].tolist()
    dev = meta.query_start_loc.device
    t = torch.tensor([starts[i + 1] - starts[i] for i in range(n)], device=dev)
    seq = torch.tensor(lens, device=dev)
    steps, longest = int(max(starts[i + 1] - starts[i] for i in range(n))), int(max(lens))
    s = torch.arange(steps, device=dev)
    q_valid = s[None, :] < t[:, None]  # [R, steps]
    q_index = torch.where(q_valid, meta.query_start_loc[:n, None].long() + s[None, :], 0)
    # a request's queries are the last t of its sequence: positions len - t .. len - 1
    q_pos = torch.where(q_valid, seq[:, None] - t[:, None] + s[None, :], 0)
    j = torch.arange(longest, device=dev)
    kv_valid = j[None, :] < seq[:, None]  # [R, L]
    blocks = meta.block_table[:n, j // block_size].long()
    plan = {
        "q_valid": q_valid,
        "q_index": q_index,
        "q_rows": q_index[q_valid],
        "q_pos": q_pos,
        "kv_valid": kv_valid,
        "kv_block": torch.where(kv_valid, blocks, 0),
        "kv_offset": (j % block_size)[None, :].expand(n, longest),
    }
    try:
        meta._detaudit_plan = plan
    except (AttributeError, TypeError):  # a frozen metadata class: recomputed per layer
        pass
    return plan
