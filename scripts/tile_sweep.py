"""Dev tool (GPU): do other output tilings of the bio / tree matmul give the same bits as the large-M
tiling, and how fast are they?

For each candidate (BLOCK_M x BLOCK_N, warps, stages, TMA) it checks, on fresh random bf16 data, that
every element equals the large-M tiling's result (same BLOCK_K = 64 reduction) for the plain product
and for the 8-leaf tree, then times the plain product at several M like `detaudit bench kernels` (CUDA
graph of 20 calls, weights rotated past L2) against cuBLAS.
Usage: python3 scripts/tile_sweep.py [--save FILE | --tree-large | --small-m]
"""

from __future__ import annotations

import sys

import torch

from detaudit.backends.kernels import triton_mm
from detaudit.bench.kernels import _time, _times, _weight_copies

BASE = triton_mm.CONFIGS[torch.bfloat16]
TREE_BASE = triton_mm.TREE_CONFIGS[torch.bfloat16]


def cfg(bm, bn, warps, stages, tma=0, ws=0, bk=64):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages, TMA=tma, WS=ws)


CANDIDATES = {
    "64x16 w4 s8 ptr": cfg(64, 16, 4, 8),
    "64x32 w4 s8 ptr": cfg(64, 32, 4, 8),
    "64x32 w4 s10 ptr": cfg(64, 32, 4, 10),
    "64x64 w4 s5 ptr": cfg(64, 64, 4, 5),
    "64x64 w4 s6 ptr": cfg(64, 64, 4, 6),
    "128x64 w8 s5 ptr": cfg(128, 64, 8, 5),
    "128x128 w8 s4 ptr": cfg(128, 128, 8, 4),
}
SHAPES = ((4096, 4096), (6144, 2048), (576, 1536), (1536, 576), (4096, 12288), (12288, 4096))
MS = (8, 32, 256, 1024)


TREE_LARGE_CANDIDATES = {  # the PARK variants of reports/gpu/tree-flat-sweep-h100.md were removed with their kernel code
    "128x128 w8 s4 ptr (current)": cfg(128, 128, 8, 4),
    "128x64 w8 s4 ptr": cfg(128, 64, 8, 4),
    "64x128 w4 s4 ptr": cfg(64, 128, 4, 4),
    "128x128 w8 s3 ptr": cfg(128, 128, 8, 3),
}


def _operands(k: int, n: int, rows: int, seed: int):
    """Seeded bf16 weight [n, k] (and its L2-rotated copies), rows x [rows, k], and the large-M tiling's
    plain and 8-leaf tree products that every candidate must match bitwise."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn(n, k, device=dev, generator=g).bfloat16()
    x = torch.randn(rows, k, device=dev, generator=g).bfloat16()
    return (w, _weight_copies(w), x, triton_mm.mm(x, w, config=BASE, out_dtype=torch.bfloat16),
            triton_mm.mm(x, w, leaves=8, config=TREE_BASE))


SMALL_M_CANDIDATES = {
    "64x32 w4 s12 ptr": cfg(64, 32, 4, 12),
    "64x32 w4 s8 ptr (before)": cfg(64, 32, 4, 8),
    "64x32 w4 s12 ptr mask": dict(cfg(64, 32, 4, 12), MASK_M=1),
    "64x32 w4 s8 ptr mask": dict(cfg(64, 32, 4, 8), MASK_M=1),
    "64x16 w4 s12 ptr mask": dict(cfg(64, 16, 4, 12), MASK_M=1),
    "64x16 w4 s8 ptr mask": dict(cfg(64, 16, 4, 8), MASK_M=1),
    "64x64 w4 s8 ptr mask": dict(cfg(64, 64, 4, 8), MASK_M=1),
    "64x32x128 w4 s6 ptr mask": dict(cfg(64, 32, 4, 6, bk=128), MASK_M=1),
    "64x32x128 w4 s8 ptr mask (now; tree: s6)": dict(cfg(64, 32, 4, 8, bk=128), MASK_M=1),
    "64x16x128 w4 s8 ptr mask": dict(cfg(64, 16, 4, 8, bk=128), MASK_M=1),
    "64x16x256 w4 s6 ptr mask": dict(cfg(64, 16, 4, 6, bk=256), MASK_M=1),
    "64x32 w4 s8 tma": cfg(64, 32, 4, 8, tma=1),
    "64x32 w4 s12 tma": cfg(64, 32, 4, 12, tma=1),
    "64x32 w4 s8 tma ws": cfg(64, 32, 4, 8, tma=1, ws=1),
    "64x64 w4 s8 tma": cfg(64, 64, 4, 8, tma=1),
    "64x16 w4 s12 tma": cfg(64, 16, 4, 12, tma=1),
}


def small_m() -> list[dict]:
    """The plain bio kernel at decode sizes: pointer vs TMA loads, deeper pipelines (bits against the
    large-M tiling)."""
    dev = torch.device("cuda")
    rows = []
    for k, n in ((4096, 4096), (6144, 2048), (4096, 12288), (12288, 4096)):
        w, ws, x, base, tbase = _operands(k, n, 300, k * 3 + n)
        for name, c in SMALL_M_CANDIDATES.items():
            def fill(row, c=c, w=w, ws=ws, x=x, base=base, tbase=tbase):
                row["bits_equal_plain"] = all(torch.equal(triton_mm.mm(x[:m], w, config=c, out_dtype=torch.bfloat16),
                                                          base[:m]) for m in (1, 8, 33, 64, 300))
                row["bits_equal_tree"] = all(torch.equal(triton_mm.mm(x[:m], w, leaves=8, config=c), tbase[:m])
                                             for m in (1, 8, 33, 64))
                for m in (8, 16, 32, 64):
                    fns = [lambda i=0, m=m: torch.nn.functional.linear(x[:m], ws[i % len(ws)]),
                           lambda i=0, m=m: triton_mm.mm(x[:m], ws[i % len(ws)], config=c, out_dtype=torch.bfloat16)]
                    if m in (8, 32):
                        fns.append(lambda i=0, m=m: triton_mm.mm(x[:m], ws[i % len(ws)], leaves=8, config=c))
                    t = _times(fns, dev)
                    row[f"M{m}"] = round(t[0] / t[1], 3)
                    if m in (8, 32):
                        row[f"tree_M{m}"] = round(t[0] / t[2], 3)
            rows.append(_row(k, n, name, fill))
    return rows


def _row(k: int, n: int, name: str, fill) -> dict:
    """One candidate's row, filled by `fill(row)`; an error (a config that does not fit, say) is recorded."""
    row = {"K": k, "N": n, "candidate": name}
    try:
        fill(row)
    except Exception as e:  # noqa: BLE001 - a dev sweep: record and go on
        row["error"] = f"{type(e).__name__}: {str(e)[:100]}"
    print(row, flush=True)
    return row


def tree_large() -> list[dict]:
    """The tree kernel at large M: tilings against cuBLAS (and their bits against the current one)."""
    dev = torch.device("cuda")
    rows = []
    for k, n in ((4096, 4096), (6144, 2048)):
        g = torch.Generator(device=dev).manual_seed(k + n)
        w = torch.randn(n, k, device=dev, generator=g).bfloat16()
        ws = _weight_copies(w)
        x = torch.randn(8192, k, device=dev, generator=g).bfloat16()
        base = triton_mm.mm(x[:2048], w, leaves=8, config=TREE_BASE)
        for name, c in TREE_LARGE_CANDIDATES.items():
            def fill(row, c=c, w=w, ws=ws, x=x, base=base):
                row["bits_equal_tree"] = torch.equal(triton_mm.mm(x[:2048], w, leaves=8, config=c), base)
                for m in (1024, 2048, 8192):
                    t = _times([lambda i=0, m=m: torch.nn.functional.linear(x[:m], ws[i % len(ws)]),
                                lambda i=0, m=m: triton_mm.mm(x[:m], ws[i % len(ws)], leaves=8, config=c)], dev)
                    row[f"tree_M{m}"] = round(t[0] / t[1], 3)
            rows.append(_row(k, n, name, fill))
    return rows


def main() -> None:
    if "--only" in sys.argv:  # candidates whose name contains this text (and the current one)
        keep = sys.argv[sys.argv.index("--only") + 1]
        for name in list(SMALL_M_CANDIDATES):
            if keep not in name and "now" not in name:
                del SMALL_M_CANDIDATES[name]
    for flag, fn in (("--tree-large", tree_large), ("--small-m", small_m)):
        if flag in sys.argv:
            import pandas as pd

            print(pd.DataFrame(fn()).to_markdown(index=False))
            return
    dev = torch.device("cuda")
    rows = []
    for k, n in SHAPES:
        w, ws, x, base, tbase = _operands(k, n, 1100, k * 7 + n)
        t_nat = {m: _time(lambda i=0, m=m: torch.nn.functional.linear(x[:m], ws[i % len(ws)]), dev) for m in MS}
        for name, c in CANDIDATES.items():
            same = all(torch.equal(triton_mm.mm(x[:m], w, config=c, out_dtype=torch.bfloat16), base[:m])
                       for m in (1, 7, 8, 31, 64, 65, 300, 1100))
            tsame = all(torch.equal(triton_mm.mm(x[:m], w, leaves=8, config=c), tbase[:m]) for m in (1, 8, 64, 300))
            row = {"K": k, "N": n, "candidate": name, "bits_equal_plain": same, "bits_equal_tree": tsame}
            for m in MS:
                t_c = _time(lambda i=0, m=m: triton_mm.mm(x[:m], ws[i % len(ws)], config=c, out_dtype=torch.bfloat16), dev)
                row[f"M{m}"] = round(t_nat[m] / t_c, 3)
            for m in (8, 32):
                t_t = _time(lambda i=0, m=m: triton_mm.mm(x[:m], ws[i % len(ws)], leaves=8, config=c), dev)
                row[f"tree_M{m}"] = round(t_nat[m] / t_t, 3)
            rows.append(row)
            print(row, flush=True)
    import pandas as pd

    text = pd.DataFrame(rows).to_markdown(index=False)
    print(text)
    if "--save" in sys.argv:
        with open(sys.argv[sys.argv.index("--save") + 1], "w") as f:
            f.write(f"# tile sweep on {torch.cuda.get_device_name(0)}\n\nCommand: `python3 scripts/tile_sweep.py`. "
                    "Columns M*: candidate time vs cuBLAS bf16 (F.linear) at that M (higher is faster); "
                    "bits_equal_*: every element equal to the large-M tiling's result.\n\n" + text + "\n")


if __name__ == "__main__":
    main()
