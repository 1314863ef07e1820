#!/usr/bin/env python3
"""Compile bio's attention kernels for a GPU this machine does not have and print what each layout costs
(registers, spill stack, the MMA instruction), without a GPU: Triton compiles for an explicit target and
ships ptxas and cuobjdump.

    pip install --no-deps --target /tmp/t36 triton==3.6.0      # the GPU machines' Triton
    PYTHONPATH=/tmp/t36:. python tools/kernel_resources.py [--arch 90] [--variants 16x1,16x2,16x4,64x1]

Integer arguments a launch would specialise as multiples of 16 (pointers, the cache's strides) are
marked so here too, as a run at the bench's shapes would see them (Qwen3-8B: 32 / 8 heads of 128).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from detaudit.backends.kernels import triton_attn, triton_paged

CONTIGUOUS = ["*q_ptr", "*k_ptr", "*v_ptr", "*pos_ptr", "*out_ptr", "ROWS", "HKV", "L", "scale", "WINDOW"]
CONTIGUOUS += "sqb sqh sqt skb skh skl svb svh svl spb spt sob soh sot".split()
PAGED = ["*q_ptr", "*kc_ptr", "*vc_ptr", "*table_ptr", "*starts_ptr", "*seq_ptr", "*out_ptr", "HKV", "scale", "WINDOW"]
PAGED += "sqt sqh skp sks skh svp svs svh stb sot soh".split()
NOT_ALIGNED = {"HKV", "scale", "spt", "stb"}  # (4 / 8 KV heads, a float, unit stride, pages per request)
TYPES = {"pos_ptr": "*i32", "table_ptr": "*i32", "starts_ptr": "*i32", "seq_ptr": "*i32", "scale": "fp32"}


def _signature(names: list[str]) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    for i, raw in enumerate(names):
        name = raw.lstrip("*")
        sig[name] = TYPES.get(name, "*bf16" if raw.startswith("*") else "i32")
        if name not in NOT_ALIGNED:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def resources(kernel, names, consts: dict, arch: int, warps: int) -> str:
    sig, attrs = _signature(names)
    sig.update({c: "constexpr" for c in consts})
    compiled = triton.compile(
        ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": warps, "num_stages": 2},
    )
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(compiled.asm["cubin"])
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    os.unlink(f.name)
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    ptx = compiled.asm["ptx"]
    mma = "wgmma" if "wgmma.mma_async" in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    return f"registers {found[1]:>3}, spill stack {found[2]:>4} B, {mma}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (90: Hopper)")
    ap.add_argument("--variants", default="16x1,16x2,16x4,32x1,64x1,128x1", help="ROWSxBLOCKS a program")
    args = ap.parse_args()
    print(f"Triton {triton.__version__}, sm_{args.arch}, D 128, 4 query heads a KV head, SPLIT 64")
    for item in args.variants.split(","):
        block_r, sub = map(int, item.lower().split("x"))
        warps = triton_attn.warps(block_r)
        common = dict(GROUPS=4, D=128, SPLIT=64, BLOCK_R=block_r, SUB=sub, PRECISION="tf32", UPCAST=False)
        contiguous = resources(triton_attn._attn_kernel, CONTIGUOUS, common, args.arch, warps)
        paged = resources(triton_paged._paged_kernel, PAGED, dict(common, PAGE=16), args.arch, warps)
        print(f"{block_r:>3} rows x {sub} blocks, {warps} warps: contiguous {contiguous} | paged {paged}")


if __name__ == "__main__":
    main()
