"""Op-level bitwise checks on the GPU: bf16 attention (old: boolean mask per call; new: the step's additive
mask) at decode and prefill shapes, bio RMSNorm fused vs op by op."""

import torch
import torch.nn.functional as F

from detaudit.backends import bio, get_backend

g = torch.Generator(device="cuda").manual_seed(3)
nat = get_backend("bf16")
ok = True
for B, T, L, hq, hkv in ((8, 1, 530, 32, 8), (32, 1, 545, 32, 8), (2, 100, 100, 32, 8), (8, 1, 768, 32, 8)):
    q = torch.randn(B, hq, T, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(B, hkv, L, 128, device="cuda", generator=g).bfloat16()
    v = torch.randn(B, hkv, L, 128, device="cuda", generator=g).bfloat16()
    pos = (torch.arange(T, device="cuda") + (L - T)).expand(B, T) - torch.arange(B, device="cuda")[:, None] % 3
    keys = torch.arange(L, device="cuda").view(1, 1, 1, -1)
    mask = keys <= pos.view(B, 1, -1, 1)
    old = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=128**-0.5, enable_gqa=True)
    plan = nat.attention_plan(pos, L)
    new = nat.attention(q, k, v, pos, 128**-0.5, plan=plan)
    new2 = nat.attention(q, k, v, pos, 128**-0.5, plan=plan)
    e = torch.equal(old, new) and torch.equal(old, new2)
    ok &= e
    print("bf16 attention bool-mask == step additive mask", (B, T, L), e)
for n in (4096, 128, 576, 1000):
    for m in (1, 8, 32, 300):
        x = (torch.randn(m, n, device="cuda", generator=g) * 3).bfloat16()
        w = torch.randn(n, device="cuda", generator=g).bfloat16()
        from detaudit.backends.kernels import triton_rows

        e = torch.equal(bio._rms_norm(x, w, 1e-6), triton_rows.rms_norm(x.float(), w, 1e-6, torch.bfloat16))
        ok &= e
        print("bio rms fused kernel == op by op", n, m, e)
print("ALL OK" if ok else "MISMATCH")
