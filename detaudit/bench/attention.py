"""`detaudit bench attention`: bio's GPU attention kernels against PyTorch's SDPA (FlashAttention on
Hopper) on one causal workload, per layout of a program's query rows: `block_r` rows a block (the tile's
M: 16 is the backends'; 64 and up change the MMA instruction) and `sub` blocks a program sharing each
chunk's key and value loads (each block computed as alone: its bits should not change).

Two kernels, the two engines' ones: `contiguous` (`triton_attn.attention_heads`: the built-in engine's, over
its [B, Hkv, L, D] cache) and `paged` (`triton_paged.paged_attention`: the vLLM plugin's, over vLLM's pages
and ragged query runs). Two workloads: `prefill` (every request's `tokens` positions at once) and `decode`
(one new position per request over `tokens` cached keys). Each row says whether its outputs are bitwise
those of the layout that defines the backends' bits (`BLOCK_R` = 16 rows, one block: `bits_as_default`;
the backends run `triton_attn.rows_per_block`, the settings name it), so a faster layout that keeps the
bits can be told from one that does not, whether the paged kernel's equal the contiguous one's, and
(prefill rows) whether each request's last position computed again as a decode step in the same layout
gives its prefill row's bits (`decode_bits_as_prefill`): a layout with other bits than 16 x 1 could
become the backends' only if it keeps this. SDPA reads the same keys (`enable_gqa`) and is timed in each
block's call (`vs_sdpa`: its time over the kernel's in that call); its own row is the median of those.
A block the GPU cannot hold is a row with its error. Times: median seconds per call of graph-replayed
calls (`bench.kernels._times`: no host launch overhead).
"""

from __future__ import annotations

from typing import Sequence

import pandas as pd
import torch
from torch import Tensor

from detaudit.backends.kernels import triton_attn, triton_paged
from detaudit.bench.kernels import _times

BLOCK_RS, SUBS = triton_attn.BLOCK_RS, triton_attn.SUBS
VARIANTS = ((16, 1), (16, 2), (16, 4), (32, 1), (32, 2), (64, 1), (128, 1))  # (block_r, sub)
WORKLOADS = ("prefill", "decode")
KERNELS = ("contiguous", "paged")
PAGE = 16  # vLLM's default page (block) size


def _inputs(workload: str, batch: int, tokens: int, hq: int, hkv: int, d: int, dtype, device: str, seed: int = 0):
    g = torch.Generator(device=device).manual_seed(seed)
    t = tokens if workload == "prefill" else 1
    q = torch.randn(batch, hq, t, d, device=device, generator=g).to(dtype)
    k = torch.randn(batch, hkv, tokens, d, device=device, generator=g).to(dtype)
    v = torch.randn(batch, hkv, tokens, d, device=device, generator=g).to(dtype)
    pos = torch.arange(tokens - t, tokens, device=device, dtype=torch.int32).expand(batch, t).contiguous()
    return q, k, v, pos


def _paged(q, k, v):
    """The same keys in vLLM's layout: request b's key j in page b * pages + j // PAGE, slot j % PAGE; its
    queries packed as [B * T, Hq, D]; lengths and run starts on the device."""
    batch, hkv, tokens, d = k.shape
    t = q.shape[2]
    pages = -(-tokens // PAGE)
    cache = torch.zeros(batch * pages, 2, PAGE, hkv, d, device=q.device, dtype=q.dtype)
    for i, x in enumerate((k, v)):
        padded = torch.nn.functional.pad(x, (0, 0, 0, pages * PAGE - tokens))  # [B, Hkv, pages * PAGE, D]
        cache[:, i] = padded.view(batch, hkv, pages, PAGE, d).permute(0, 2, 3, 1, 4).reshape(-1, PAGE, hkv, d)
    table = torch.arange(batch * pages, device=q.device, dtype=torch.int32).view(batch, pages)
    starts = torch.arange(batch + 1, device=q.device, dtype=torch.int32) * t
    seqs = torch.full((batch,), tokens, device=q.device, dtype=torch.int32)
    query = q.transpose(1, 2).reshape(batch * t, q.shape[1], d).contiguous()
    kc, vc = cache.unbind(1)
    return query, kc, vc, table, starts, seqs


def bench_attention(
    batch: int = 16,
    tokens: int = 1024,
    heads: tuple[int, int] = (32, 8),
    head_dim: int = 128,
    variants: Sequence[tuple[int, int]] = VARIANTS,
    workloads: Sequence[str] = WORKLOADS,
    dtype: torch.dtype = torch.bfloat16,
    split: int = 64,
    progress=None,
    device: str = "cuda",
    reps: int | None = None,
) -> pd.DataFrame:
    """`device` cpu runs the kernels under Triton's interpreter (TRITON_INTERPRET=1): a check of this
    function, not a timing (`reps`: calls timed per kernel)."""
    hq, hkv = heads
    dev = torch.device(device)
    scale = head_dim**-0.5
    rows = []
    for workload in workloads:
        q, k, v, pos = _inputs(workload, batch, tokens, hq, hkv, head_dim, dtype, device)
        t = q.shape[2]
        query, kc, vc, table, starts, seqs = _paged(q, k, v)
        packed = torch.empty_like(query)
        # causal multiply-adds of the scores and the weighted values: a query at position p sees p + 1 keys
        seen = float((pos.to(torch.float64) + 1).sum()) * hq
        flops = 4.0 * seen * head_dim

        def sdpa(i):  # GQA as the kernels read it: each KV head once for its query heads
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=t > 1, scale=scale, enable_gqa=True
            )

        def run(name: str, block_r: int, sub: int):
            if name == "contiguous":
                out = triton_attn.attention_heads(q, k, v, pos, scale, split, block_r=block_r, sub=sub)
                return out.transpose(1, 2).reshape(batch * t, hq, head_dim)  # [B, T, Hq, D]: a view
            args = (query, kc, vc, table, starts, seqs, t, scale, split, packed)
            return triton_paged.paged_attention(*args, block_r=block_r, sub=sub)

        def last_rows(name: str, block_r: int, sub: int) -> Tensor:
            """Each request's last position again as one decode step, same kernel and layout: [B, Hq, D]."""
            if name == "contiguous":
                out = triton_attn.attention_heads(
                    q[:, :, -1:], k, v, pos[:, -1:], scale, split, block_r=block_r, sub=sub
                )
                return out[:, :, 0]
            one = query.view(batch, t, hq, head_dim)[:, -1].contiguous()
            steps = torch.arange(batch + 1, device=dev, dtype=torch.int32)
            args = (one, kc, vc, table, steps, seqs, 1, scale, split, torch.empty_like(one))
            return triton_paged.paged_attention(*args, block_r=block_r, sub=sub)

        base = {name: run(name, triton_attn.BLOCK_R, 1).clone() for name in KERNELS}
        sdpa_times = []
        for block_r, sub in variants:
            fns = [sdpa] + [lambda i, name=name, b=block_r, u=sub: run(name, b, u) for name in KERNELS]
            try:  # SDPA timed in the same call as the kernels: a change of clocks hits all three
                sdpa_s, *times = _times(fns, dev, reps=reps)
            except Exception as e:  # a block the GPU cannot hold (Triton: out of shared memory or registers)
                first = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
                key = {"workload": workload, "block_r": block_r, "sub": sub, "error": first}
                rows += [{"kernel": n, **key} for n in KERNELS]
                continue
            sdpa_times.append(sdpa_s)
            outs = {name: run(name, block_r, sub) for name in KERNELS}
            decoded = {}  # whether a layout keeps a row's bits between prefill and decode: is it usable at all
            if t > 1:
                decoded = {
                    name: bool(torch.equal(last_rows(name, block_r, sub), out.view(batch, t, hq, head_dim)[:, -1]))
                    for name, out in outs.items()
                }
            for (name, out), seconds in zip(outs.items(), times):
                rows.append(
                    {
                        "workload": workload,
                        "kernel": name,
                        "block_r": block_r,
                        "sub": sub,
                        "ms": seconds * 1e3,
                        "tflops": flops / seconds / 1e12,
                        "vs_sdpa": sdpa_s / seconds,
                        "bits_as_default": bool(torch.equal(out, base[name])),
                        "paged_bits_as_contiguous": bool(torch.equal(outs["paged"], outs["contiguous"])),
                        "decode_bits_as_prefill": decoded.get(name),
                    }
                )
            if progress:
                progress()
        sdpa_s = sorted(sdpa_times)[len(sdpa_times) // 2] if sdpa_times else float("nan")
        rows.append({"workload": workload, "kernel": "sdpa", "ms": sdpa_s * 1e3, "tflops": flops / sdpa_s / 1e12})
    df = pd.DataFrame(rows)
    df.attrs.update(
        batch=batch,
        tokens=tokens,
        heads=f"{hq}/{hkv}",
        head_dim=head_dim,
        dtype=str(dtype).removeprefix("torch."),
        split=split,
        default_block_r=triton_attn.BLOCK_R,
        backends_block_r=f"prefill {triton_attn.rows_per_block(tokens * (hq // hkv), dtype, head_dim, split)}, "
        f"decode {triton_attn.rows_per_block(hq // hkv, dtype, head_dim, split)}",
    )
    return df
