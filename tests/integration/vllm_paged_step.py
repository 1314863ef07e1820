"""Run with TRITON_INTERPRET=1 (by test_vllm_plugin_parts.py): the CUDA attention backend's forward
(`detaudit.vllm.gpu_attn.DetauditAttentionImpl.forward`) on one step of vLLM's shape, its kernels under
the Triton interpreter on CPU tensors, against `backend.attention` over each request's own contiguous
cache (the built-in engine's attention on GPU, the same kernels). Prints "ok" or exits with the failure.

The step mixes a prefill, a decode and a chunked prefill; pages are in shuffled order; every cache slot
no request owns holds NaN (the kernel multiplies masked keys' zero weights by their values: a stale NaN
read there would poison the row); two padded rows of the output no query owns must stay as they were.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import torch

from detaudit.backends import get_backend
from detaudit.backends.kernels import triton_attn
from detaudit.vllm import gpu_attn


class _Marker:
    def __init__(self):
        self.ops = set()

    def op(self, name, tp_rank=None):
        self.ops.add(name)


def main() -> None:
    triton_attn.supported = lambda q: True  # the interpreter runs the GPU kernels on CPU tensors
    backend = get_backend("bio")
    marker = _Marker()
    gpu_attn._STATE.update(backend=backend, marker=marker, tp_rank=lambda: 0)
    torch.manual_seed(0)
    heads, kv_heads, d, block, blocks = 4, 2, 16, 16, 12
    scale = d**-0.5
    requests = [(0, 5), (20, 1), (7, 4)]  # (tokens already in the cache, new tokens this step)
    cache = torch.full((blocks, 2, block, kv_heads, d), float("nan"), dtype=torch.bfloat16)
    order = torch.randperm(blocks).tolist()
    table = torch.zeros(len(requests), 4, dtype=torch.int32)
    seqs, queries, starts = [], [], [0]
    for i, (ctx, new) in enumerate(requests):
        n = ctx + new
        k = torch.randn(n, kv_heads, d).to(torch.bfloat16)
        v = torch.randn(n, kv_heads, d).to(torch.bfloat16)
        mine = [order.pop() for _ in range(-(-n // block))]
        table[i, : len(mine)] = torch.tensor(mine)
        for j in range(n):  # what vLLM's cache write leaves: every token of the sequence in its slot
            cache[mine[j // block], 0, j % block] = k[j]
            cache[mine[j // block], 1, j % block] = v[j]
        seqs.append((k, v))
        queries.append(torch.randn(new, heads, d).to(torch.bfloat16))
        starts.append(starts[-1] + new)
    query = torch.cat(queries)
    meta = SimpleNamespace(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in requests], dtype=torch.int32),
        block_table=table,
        max_query_len=max(n for _, n in requests),
        use_cascade=False,
        causal=True,
        mm_prefix_range_tensor=None,
        rswa_window=None,
    )
    impl = gpu_attn.DetauditAttentionImpl.__new__(gpu_attn.DetauditAttentionImpl)
    impl.scale = scale
    # vLLM hands the layer's output as [tokens, heads * D]; two padded rows no query owns
    output = torch.full((query.shape[0] + 2, heads * d), 7.0, dtype=torch.bfloat16)
    impl.forward(None, query, None, None, cache, meta, output)
    out = output.view(-1, heads, d)
    for i, (ctx, new) in enumerate(requests):
        k, v = seqs[i]
        n = ctx + new
        length = 40  # the built-in engine's cache: the sequence, then zeros
        kc = torch.zeros(1, kv_heads, length, d, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        kc[0, :, :n], vc[0, :, :n] = k.transpose(0, 1), v.transpose(0, 1)
        q = queries[i].transpose(0, 1)[None]
        pos = torch.arange(ctx, n)[None]
        with backend.activate():
            want = backend.attention(q, kc, vc, pos, scale)[0].transpose(0, 1)
        got = out[starts[i] : starts[i + 1]]
        if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
            sys.exit(f"FAILED: request {i} differs from the built-in engine's attention")
    if not bool((output[-2:] == 7.0).all()):
        sys.exit("FAILED: rows no query owns were written")
    if marker.ops != {"attention"}:
        sys.exit(f"FAILED: markers {marker.ops}")
    print("ok")


if __name__ == "__main__":
    main()
