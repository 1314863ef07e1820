"""Dev tool (GPU): tree-matmul (TBIK) variants against the current one: same bits? how fast against
cuBLAS bf16 (timed like `detaudit bench kernels`)?

FLAT=1 runs `_tree_flat_kernel` (one pipelined K loop over every leaf, pending tree nodes carried in
registers); PARK=1 keeps the finished left half of the tree in the output tile instead; PARK=2 runs
`_tree_scratch_kernel` (only the accumulator in registers, pending nodes in per-program scratch slots).
Both were tried at commit d911b58 and measured slower than the unrolled-leaf
kernel (reports/gpu/tree-flat-sweep-h100.md); the likely cause (not profiled): the accumulator is
read conditionally inside the K loop, so the compiler cannot keep MMAs in flight across iterations. They were removed in the next commit: run this script at d911b58.
Usage: python3 scripts/tree_sweep.py [--save FILE]
"""

from __future__ import annotations

import sys

import torch

from detaudit.backends.kernels import triton_mm
from detaudit.bench.kernels import _time, _weight_copies


def cfg(bm, bn, warps, stages, flat=1, park=0):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8, num_warps=warps, num_stages=stages, TMA=0,
                FLAT=flat, PARK=park)


CANDIDATES = {
    "current (tiling by M)": None,
    "flat 64x32 w4 s8": cfg(64, 32, 4, 8),
    "flat 64x64 w4 s5": cfg(64, 64, 4, 5),
    "flat 128x64 w8 s4": cfg(128, 64, 8, 4),
    "flat 128x128 w8 s4": cfg(128, 128, 8, 4),
    "flat 128x128 w8 s4 park": cfg(128, 128, 8, 4, park=1),
    "flat 128x128 w8 s3 park": cfg(128, 128, 8, 3, park=1),
    "scratch 64x32 w4 s8": cfg(64, 32, 4, 8, park=2),
    "scratch 64x32 w4 s6": cfg(64, 32, 4, 6, park=2),
    "scratch 64x64 w4 s5": cfg(64, 64, 4, 5, park=2),
    "scratch 128x128 w8 s4": cfg(128, 128, 8, 4, park=2),
    "scratch 128x256 w8 s3": cfg(128, 256, 8, 3, park=2),
    "scratch 128x128 w4 s4": cfg(128, 128, 4, 4, park=2),
}
MS = (8, 32, 256, 2048, 8192)


def main() -> None:
    import pandas as pd

    dev = torch.device("cuda")
    rows = []
    for k, n in ((4096, 4096), (6144, 2048)):
        g = torch.Generator(device=dev).manual_seed(k + n)
        w = torch.randn(n, k, device=dev, generator=g).bfloat16()
        ws = _weight_copies(w)
        x = torch.randn(8192, k, device=dev, generator=g).bfloat16()
        base = {m: triton_mm.mm(x[:m], w, leaves=8) for m in (1, 8, 300, 2048)}
        t_nat = {m: _time(lambda i=0, m=m: torch.nn.functional.linear(x[:m], ws[i % len(ws)]), dev) for m in MS}
        for name, c in CANDIDATES.items():
            row = {"K": k, "N": n, "candidate": name}
            try:
                row["bits_equal"] = all(torch.equal(triton_mm.mm(x[:m], w, leaves=8, config=c), b)
                                        for m, b in base.items())
                for m in MS:
                    t = _time(lambda i=0, m=m: triton_mm.mm(x[:m], ws[i % len(ws)], leaves=8, config=c), dev)
                    row[f"M{m}"] = round(t_nat[m] / t, 3)
            except Exception as e:  # noqa: BLE001 - a dev sweep: record and go on
                row["error"] = f"{type(e).__name__}: {str(e)[:120]}"
            rows.append(row)
            print(row, flush=True)
    text = pd.DataFrame(rows).to_markdown(index=False)
    print(text)
    if "--save" in sys.argv:
        with open(sys.argv[sys.argv.index("--save") + 1], "w") as f:
            f.write(f"# tree matmul variants on {torch.cuda.get_device_name(0)}\n\nCommand: "
                    "`python3 scripts/tree_sweep.py`. M*: tree (8 leaves, TP 1) time vs cuBLAS bf16 at that "
                    "M (higher is faster); bits_equal: every element equal to the current tree kernel's.\n\n"
                    + text + "\n")


if __name__ == "__main__":
    main()
