"""Host time per eager SDPA call at a decode shape (B=8, 32/8 heads, one query, 544 keys, D=128, bf16)
with the mask kinds and backends PyTorch offers: what bf16's eager attention costs on this host."""

import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

g = torch.Generator(device="cuda").manual_seed(0)
B, HQ, HKV, L, D = 8, 32, 8, 544, 128
q = torch.randn(B, HQ, 1, D, device="cuda", generator=g).bfloat16()
k = torch.randn(B, HKV, L, D, device="cuda", generator=g).bfloat16()
v = torch.randn(B, HKV, L, D, device="cuda", generator=g).bfloat16()
pos = torch.randint(100, L, (B, 1), device="cuda", generator=g)
bool_mask = torch.arange(L, device="cuda").view(1, 1, 1, -1) <= pos.view(B, 1, 1, 1)
add_mask = torch.zeros(B, 1, 1, L, device="cuda", dtype=torch.bfloat16).masked_fill(~bool_mask, float("-inf"))
kr, vr = k.repeat_interleave(HQ // HKV, 1), v.repeat_interleave(HQ // HKV, 1)


def run(name, fn, backends=None):
    ctx = sdpa_kernel(backends) if backends else torch.autograd.graph.saved_tensors_hooks(lambda x: x, lambda x: x)
    try:
        with ctx:
            ref = fn()
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(300):
                fn()
            host = (time.perf_counter() - t) / 300 * 1e6
            torch.cuda.synchronize()
            total = (time.perf_counter() - t) / 300 * 1e6
        print(
            f"{name:48s} host {host:7.1f} us/call  (with the GPU drained: {total:7.1f})  out==default: {torch.equal(ref, base)}"
        )
    except Exception as e:
        print(f"{name:48s} not available: {type(e).__name__}: {str(e).splitlines()[0][:90]}")


base = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, enable_gqa=True)
run(
    "default, bool mask, enable_gqa (bf16 backend)",
    lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, enable_gqa=True),
)
run(
    "default, additive bf16 mask, enable_gqa",
    lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=add_mask, enable_gqa=True),
)
for b in (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH):
    run(
        f"{b.name}, bool mask, enable_gqa",
        lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask, enable_gqa=True),
        [b],
    )
    run(
        f"{b.name}, bool mask, K/V repeated",
        lambda: F.scaled_dot_product_attention(q, kr, vr, attn_mask=bool_mask),
        [b],
    )
run(
    "FLASH, no mask (reference only)",
    lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
    [SDPBackend.FLASH_ATTENTION],
)
run("F.linear 4096x4096, M=8 (reference)", lambda: F.linear(q.view(8, -1)[:, :4096], k.view(-1, 4096)[:4096]))
