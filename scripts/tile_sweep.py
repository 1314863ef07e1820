"""Dev tool (GPU): do other output tilings of the bio matmul give the same bits as the fixed config, and
how fast are they at small M?

For each candidate (BLOCK_M x BLOCK_N, warps, stages, TMA) it checks, on fresh random bf16 data, that
every element equals the fixed config's result (same BLOCK_K = 64 reduction), then times M = 8 / 32 /
256 like `detaudit bench kernels` (CUDA graph of 20 calls, weights rotated past L2) against cuBLAS.
Usage: python3 scripts/tile_sweep.py [--save FILE]
"""

from __future__ import annotations

import sys

import torch

from detaudit.backends.kernels import triton_mm
from detaudit.bench.kernels import _time, _weight_copies

BASE = triton_mm.CONFIGS[torch.bfloat16]
CANDIDATES = {
    "64x32 w4 s6 tma": dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=6, TMA=1, WS=0),
    "64x64 w4 s5 tma": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=5, TMA=1, WS=0),
    "64x128 w4 s4 tma": dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4, TMA=1, WS=0),
    "64x64 w4 s5 ptr": dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=5, TMA=0),
    "64x32 w4 s8 ptr": dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=8, TMA=0),
    "128x64 w8 s4 tma": dict(BLOCK_M=128, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, TMA=1, WS=0),
}
SHAPES = ((4096, 4096), (6144, 2048), (576, 1536), (1536, 576), (4096, 12288), (12288, 4096))


def main() -> None:
    dev = torch.device("cuda")
    rows = []
    for k, n in SHAPES:
        g = torch.Generator(device=dev).manual_seed(k * 7 + n)
        w = torch.randn(n, k, device=dev, generator=g).bfloat16()
        ws = _weight_copies(w)
        x = torch.randn(300, k, device=dev, generator=g).bfloat16()
        base = triton_mm.mm(x, w, config=BASE, out_dtype=torch.bfloat16)
        for name, cfg in CANDIDATES.items():
            same = all(torch.equal(triton_mm.mm(x[:m], w, config=cfg, out_dtype=torch.bfloat16), base[:m])
                       for m in (1, 7, 8, 16, 31, 64, 65, 300))
            row = {"K": k, "N": n, "candidate": name, "bitwise_equal_to_fixed": same}
            for m in (8, 32, 256):
                xm = x[:m]
                t_nat = _time(lambda i=0: torch.nn.functional.linear(xm, ws[i % len(ws)]), dev)
                t_fix = _time(lambda i=0: triton_mm.mm(xm, ws[i % len(ws)], config=BASE, out_dtype=torch.bfloat16), dev)
                t_c = _time(lambda i=0: triton_mm.mm(xm, ws[i % len(ws)], config=cfg, out_dtype=torch.bfloat16), dev)
                row[f"M{m}_fixed_vs_cublas"] = round(t_nat / t_fix, 3)
                row[f"M{m}_cand_vs_cublas"] = round(t_nat / t_c, 3)
            rows.append(row)
            print(row, flush=True)
    import pandas as pd

    df = pd.DataFrame(rows)
    text = df.to_markdown(index=False)
    print(text)
    if "--save" in sys.argv:
        with open(sys.argv[sys.argv.index("--save") + 1], "w") as f:
            f.write(f"# tile sweep on {torch.cuda.get_device_name(0)}\n\nCommand: `python3 scripts/tile_sweep.py`\n\n{text}\n")


if __name__ == "__main__":
    main()
