"""Host cost per call of bf16's library calls at qwen3-8b-shaped decode shapes (batch 8), issued while the
GPU is held busy by a sleep kernel (so no call waits on the device), and whether each variant gives the
same bits as the call the bf16 backend makes now."""

import time

import torch
import torch.nn.functional as F

dev = "cuda"
bf = torch.bfloat16
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
g = torch.Generator(device=dev).manual_seed(0)


def r(*s):
    return torch.randn(*s, device=dev, dtype=bf, generator=g)


B = 8
x = r(B, 4096)
shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def host_cost(f, n=150):
    for _ in range(20):
        f()
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time: the calls below only queue
    t = time.perf_counter()
    for _ in range(n):
        f()
    h = (time.perf_counter() - t) / n
    torch.cuda.synchronize()
    return h * 1e6


for name, (n, k) in shapes.items():
    w = r(n, k)
    a = r(B, k)
    wt = w.t()
    out = torch.empty(B, n, device=dev, dtype=bf)
    ref = F.linear(a, w)
    vs = {
        "F.linear": lambda: F.linear(a, w),
        "torch.mm(a, w.t())": lambda: torch.mm(a, w.t()),
        "torch.mm(a, wt) kept view": lambda: torch.mm(a, wt),
        "torch.mm(out=)": lambda: torch.mm(a, wt, out=out),
        "torch.matmul(a, wt)": lambda: torch.matmul(a, wt),
    }
    for v, f in vs.items():
        same = torch.equal(f() if "out=" not in v else (f(), out)[1], ref)
        print(f"{name:8s} {v:28s} {host_cost(f):7.2f} us/call host  same bits: {same}")
q = r(B, 32, 1, 128)
kc = r(B, 8, 768, 128)
vc = r(B, 8, 768, 128)
keep = torch.arange(768, device=dev).view(1, 1, 1, -1) <= torch.tensor([520 + i for i in range(B)], device=dev).view(
    B, 1, 1, 1
)
mask = torch.zeros(keep.shape, dtype=bf, device=dev).masked_fill_(~keep, float("-inf"))
s = 128**-0.5
ref = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=s, enable_gqa=True)
vs = {"F.sdpa(gqa)": lambda: F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=s, enable_gqa=True)}
try:
    cud = torch.ops.aten._scaled_dot_product_cudnn_attention
    vs["aten cudnn op"] = lambda: cud(q, kc, vc, mask, False, 0.0, False, False, scale=s)[0]
    vs["aten cudnn .default"] = lambda: cud.default(q, kc, vc, mask, False, 0.0, False, False, scale=s)[0]
except Exception as e:
    print("cudnn op:", e)
try:
    eff = torch.ops.aten._scaled_dot_product_efficient_attention
    kr, vr = kc.repeat_interleave(4, 1), vc.repeat_interleave(4, 1)
    vs["aten efficient (kv repeated)"] = lambda: eff(q, kr, vr, mask.expand(B, 32, 1, 768), False, 0.0, False, scale=s)[
        0
    ]
except Exception as e:
    print("efficient op:", e)
for v, f in vs.items():
    try:
        o = f()
        same = torch.equal(o.contiguous(), ref.contiguous())
        print(f"attn     {v:28s} {host_cost(f):7.2f} us/call host  same bits: {same}  out strides {tuple(o.stride())}")
    except Exception as e:
        print(f"attn     {v:28s} failed: {str(e)[:200]}")
print(
    "sdpa out strides",
    tuple(ref.stride()),
    "transpose-reshape is a view:",
    ref.transpose(1, 2).reshape(B, -1).data_ptr() == ref.data_ptr(),
)
