"""Attention inside vLLM-CPU for `bio` / `bio+tbik`, computed by the built-in engine's own function, so
that a vLLM rollout and a built-in trainer compute every token from the same ops (and vLLM's own kernel
cannot bring in a dependence on the thread count or the batch). Rotary and SiLU-and-mul: `token_ops`
(CPU and GPU alike); attention on GPU: `gpu_attn`.

- Attention: the KV cache keeps vLLM's paged blocks but a plain layout written by detaudit
  (`key_cache[block, head, offset]`), and attention gathers each request's keys in order and runs the
  backend's fixed-split attention (`fixed.attention`) over them, all requests of a step in one call
  (that function is batch, length and prefill/decode invariant).
"""

from __future__ import annotations

import torch


def install(backend, marker, tp_rank) -> None:
    _install_attention(backend, marker, tp_rank)


def _kv_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(key, value) views [blocks, kv heads, block size, head dim] of vLLM's CPU cache tensor."""
    blocks, heads, size, _ = kv_cache.shape
    return kv_cache.view(blocks, heads, size * 2, -1).chunk(2, dim=2)


def _gather(cache: torch.Tensor, block_table: torch.Tensor, lens: list[int]) -> torch.Tensor:
    """[requests, kv heads, max len, head dim]: each request's keys (or values) in position order,
    zero past its own length (the built-in cache holds zeros there too)."""
    size = cache.shape[2]
    longest = max(lens)
    blocks = -(-longest // size)
    out = cache[block_table[: len(lens), :blocks]]  # [R, blocks, heads, size, D]
    out = out.permute(0, 2, 1, 3, 4).reshape(len(lens), cache.shape[1], blocks * size, -1)[:, :, :longest].clone()
    for i, n in enumerate(lens):
        out[i, :, n:] = 0
    return out


def _install_attention(backend, marker, tp_rank) -> None:
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends import cpu_attn

    impl = cpu_attn.CPUAttentionBackendImpl

    def supported(self) -> None:
        if (
            self.attn_type != AttentionType.DECODER
            or self.alibi_slopes is not None
            or self.sliding_window != -1
            or self.logits_soft_cap
            or self.sinks is not None
            or self.is_fp8_kv_cache
        ):
            raise NotImplementedError(
                f"detaudit {backend.name}: only plain causal decoder attention (no ALiBi, sliding "
                "window, soft cap, sinks or fp8 KV cache) runs through the invariant attention"
            )

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        supported(self)
        k_cache, v_cache = _kv_views(kv_cache)
        slots = slot_mapping[: key.shape[0]].long()
        keep = slots >= 0  # padded tokens carry slot -1
        blk, off = slots[keep] // k_cache.shape[2], slots[keep] % k_cache.shape[2]
        k_cache[blk, :, off] = key[: slots.shape[0]][keep]
        v_cache[blk, :, off] = value[: slots.shape[0]][keep]

    def forward(
        self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None
    ):
        if attn_metadata is None:  # warm-up
            return output
        supported(self)
        if output_scale is not None or output_block_scale is not None or not attn_metadata.causal:
            raise NotImplementedError(
                f"detaudit {backend.name}: attention with fused output quantization or "
                "non-causal masks is not supported"
            )
        marker.op("attention", tp_rank())
        starts = attn_metadata.query_start_loc.tolist()
        lens = attn_metadata.seq_lens.tolist()
        k_cache, v_cache = _kv_views(kv_cache)
        keys = _gather(k_cache, attn_metadata.block_table, lens)
        values = _gather(v_cache, attn_metadata.block_table, lens)
        steps = max(starts[i + 1] - starts[i] for i in range(len(lens)))
        q = query.new_zeros(len(lens), query.shape[1], steps, query.shape[2])
        pos = torch.zeros(len(lens), steps, dtype=torch.long)
        for i, n in enumerate(lens):  # a request's queries are the last tokens of its sequence
            t = starts[i + 1] - starts[i]
            q[i, :, :t] = query[starts[i] : starts[i + 1]].transpose(0, 1)
            pos[i, :t] = torch.arange(n - t, n)
        with backend.activate():
            out = backend.attention(q, keys, values, pos, self.scale)  # [R, heads, steps, D]
        for i in range(len(lens)):
            t = starts[i + 1] - starts[i]
            output[starts[i] : starts[i + 1]] = out[i, :, :t].transpose(0, 1)
        return output

    impl.do_kv_cache_update = do_kv_cache_update
    impl.forward = forward
