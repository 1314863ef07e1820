"""Which SDPA kernel bf16's decode call gets (GQA 32/8 heads, one query, additive bf16 mask), per batch and
cache length: host us/call of the default call and of each backend forced, and which forced one gives the
default's bits."""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def host(fn, n=100):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    h = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    return h


g = torch.Generator(device="cuda").manual_seed(0)
for B in (8, 32):
    for L in (256, 544, 768):
        q = torch.randn(B, 32, 1, 128, device="cuda", generator=g).bfloat16()
        k = torch.randn(B, 8, L, 128, device="cuda", generator=g).bfloat16()
        v = torch.randn(B, 8, L, 128, device="cuda", generator=g).bfloat16()
        pos = torch.randint(L // 2, L, (B, 1), device="cuda", generator=g)
        keep = torch.arange(L, device="cuda").view(1, 1, 1, -1) <= pos.view(B, 1, 1, 1)
        mask = torch.zeros(B, 1, 1, L, device="cuda", dtype=torch.bfloat16).masked_fill_(~keep, float("-inf"))
        f = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=128**-0.5, enable_gqa=True)
        ref = f()
        line = f"B={B:3d} L={L:4d} default {host(f):7.1f} us"
        for b in (
            SDPBackend.CUDNN_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.MATH,
        ):
            try:
                with sdpa_kernel([b]):
                    out = f()
                    t = host(f)
                line += f" | {b.name[:6]} {t:6.1f} {'=' if torch.equal(out, ref) else '!'}"
            except Exception:
                line += f" | {b.name[:6]} n/a"
        print(line, flush=True)
