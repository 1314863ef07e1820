"""Attention inside vLLM on CUDA for `bio` / `bio+tbik`: an attention backend of its own, registered with
vLLM's attention-backend registry as `CUSTOM` (`vllm.v1.attention.backends.registry.register_backend`)
and selected by the engine (`attention_backend="CUSTOM"`, the server's `--attention-backend CUSTOM`).
vLLM's own choice on Hopper (FlashAttention 3, then FlashInfer, then its Triton kernel) splits the KV
sequence by the batch's shape; this one runs the backend's fixed-split attention, the arithmetic of the
built-in engine's (`kernels/triton_attn`), over vLLM's pages (`kernels/triton_paged`).

- The KV cache is vLLM's paged cache in its Triton backend's layout ([blocks, 2, block size, KV heads,
  head dim]), written by vLLM's copy kernel (`triton_reshape_and_cache_flash`: every key and value
  stored as it is, no arithmetic); the metadata builder is the Triton backend's.
- Each layer's step is one launch of the backend's paged attention (`backend.paged_attention`: on GPU
  `kernels/triton_paged`), reading the queries where vLLM packed them, the keys and values in their
  pages through the block table and each request's lengths from the metadata, all on the device. A
  query row's result depends only on the row, its position and the keys it sees (chunks a row cannot
  see are exact no-ops), and the kernel's tiles hold the values a contiguous cache would (zero past a
  request's length), so this gives the bits of the built-in engine's attention for the same tokens,
  whatever the batch and however vLLM's scheduler packs prefill and decode into the step.
- Nothing is read on the host, so vLLM may capture whole decode steps as CUDA graphs
  (`AttentionCGSupport.UNIFORM_BATCH`: steps whose requests all have the same number of query tokens,
  one, or one plus the drafts when speculating; `engine_mode` asks for `FULL_DECODE_ONLY`).
  Prefill steps run eager.
- What it does not cover is refused by name, when the layer is built: ALiBi, sliding windows, soft
  caps, sinks, quantized KV caches, shared KV caches, encoder / cross attention, head sizes other than
  powers of two from 16 to 256 (the kernel's tile); at the first step: cascade attention, fused output
  quantization.
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
    # the kernel's grid is sized by the step's longest query run (`max_query_len`, a host integer the
    # metadata carries), so a captured graph serves steps of one uniform query length; everything
    # else it reads on the device
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_BATCH


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
            # the kernel's tile: a power of two, and 64 keys and values of it in two stages of shared memory
            (not 16 <= self.head_size <= 256 or self.head_size & (self.head_size - 1), f"head size {self.head_size}"),
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
        if not _STATE.get("captured") and query.is_cuda and torch.cuda.is_current_stream_capturing():
            _STATE["captured"] = True  # this rank's decode steps replay from CUDA graphs (the marker says so)
            marker.note("cuda_graph_captured", True)
        key_cache, value_cache = kv_cache.unbind(1)  # [pages, page size, KV heads, D]
        out = output.view(output.shape[0], *query.shape[1:]) if output.dim() == 2 else output  # [tokens, heads, D]
        with backend.activate():
            done = backend.paged_attention(
                query,
                key_cache,
                value_cache,
                attn_metadata.block_table,
                attn_metadata.query_start_loc,
                attn_metadata.seq_lens,
                attn_metadata.max_query_len,
                self.scale,
                out,
            )
        if done is None:
            _refuse(f"{query.dtype} queries of head size {query.shape[-1]} on {query.device}")
        return output
