"""Probe the Gluon tree kernel on a Hopper GPU: bitwise equality with the Triton tree kernel and across
emulated TP 1/2/4/8, and throughput against cuBLAS bf16 and the Triton tree kernel (same interleaved,
CUDA-graphed timing as `detaudit bench kernels`).

    PYTHONPATH=. python3 scripts/gluon_tree_probe.py [--configs JSON] [--m 256,2048,8192]
"""

from __future__ import annotations

import argparse
import json

import torch

from detaudit.backends.kernels import gluon_tree, tree, triton_mm
from detaudit.bench.kernels import _rel_err, _times, _weight_copies


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default='[{}]', help="JSON list of overrides of gluon_tree.CONFIG")
    ap.add_argument("--m", default="256,2048,8192")
    ap.add_argument("--kn", default="4096x4096,6144x2048,14336x4096")
    ap.add_argument("--leaves", type=int, default=8, help="leaves at TP 1 (8); fewer: a plain subtree, timing only")
    args = ap.parse_args()
    configs = json.loads(args.configs)
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    print("| K | N | M | leaves | config | bitwise = Triton tree | TP 1/2/4/8 equal | relerr gluon / cuBLAS | cuBLAS TFLOP/s | "
          "Triton tree x | gluon x |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for kn in args.kn.split(","):
        k, n = map(int, kn.split("x"))
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, device=dev, generator=g).to(torch.bfloat16)
        ws = _weight_copies(w)
        for m in map(int, args.m.split(",")):
            x = torch.randn(m, k, device=dev, generator=g).to(torch.bfloat16)
            L = args.leaves
            tcfg = dict(triton_mm.tiling(x.dtype, m, tree=True, n=n), GLUON=0)  # the Triton kernel
            ref_bits = triton_mm.mm(x, w, leaves=L, tree=True, config=tcfg)
            ref64 = x.double() @ w.double().t() if m * n * k <= 2048 * 4096 * 6144 else None
            fns = [lambda i=0: torch.nn.functional.linear(x, ws[i % len(ws)]),
                   lambda i=0: triton_mm.mm(x, ws[i % len(ws)], leaves=L, tree=True, config=tcfg)]
            for cfg in configs:
                fns.append(lambda i=0, c=cfg: gluon_tree.tree_mm(x, ws[i % len(ws)], L, c))
            times = _times(fns, dev)
            flops = 2 * m * n * k
            for cfg, t in zip(configs, times[2:]):
                out = gluon_tree.tree_mm(x, w, L, cfg)
                same = torch.equal(out, ref_bits)
                parts = {}
                for c in (2, 4, 8) if L == 8 else ():  # emulated TP: rank r's subtree over its K/C columns, then the tree sum
                    kl = k // c
                    subs = [gluon_tree.tree_mm(x[:, r * kl:(r + 1) * kl].contiguous(), w[:, r * kl:(r + 1) * kl], 8 // c, cfg)
                            for r in range(c)]
                    parts[c] = torch.equal(tree.tree_sum(subs), out)
                err = (f"{_rel_err(out, ref64):.2e} / {_rel_err(fns[0](), ref64):.2e}" if ref64 is not None else "-")
                print(f"| {k} | {n} | {m} | {L} | {json.dumps(cfg)} | {same} | {all(parts.values())} | {err} | "
                      f"{flops / times[0] / 1e12:.0f} | {times[0] / times[1]:.2f} | {times[0] / t:.2f} |", flush=True)


if __name__ == "__main__":
    main()
