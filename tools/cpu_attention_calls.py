"""Per-call cost of bio's CPU attention (`fixed.attention`: the compiled kernel where numba is installed)
against torch's SDPA at the embedded model's decode shape (batch 8, 24 query / 8 KV heads of 64, one query
a row, the cache `L` keys long), on this process's threads: a diagnosis aid for issue 55, e.g.
`OMP_NUM_THREADS=16 python3 tools/cpu_attention_calls.py 144 1024`. Microseconds a call, the mean of 200
after 20 warm-up calls."""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from amx_calls import per_call  # (this folder: run as `python3 tools/cpu_attention_calls.py`)

from detaudit.backends.kernels import fixed

B, HQ, HKV, D = 8, 24, 8, 64


def main(lengths: list[int]) -> None:
    print(f"# torch threads {torch.get_num_threads()}")
    print("| keys | detaudit us | SDPA us |")
    print("|---:|---:|---:|")
    for length in lengths:
        g = torch.Generator().manual_seed(0)
        k, v = (torch.randn(B, HKV, length, D, generator=g).bfloat16() for _ in range(2))
        q = torch.randn(B, HQ, 1, D, generator=g).bfloat16()
        pos = torch.full((B, 1), length - 1, dtype=torch.int64)
        ours = per_call(lambda: fixed.attention(q, k, v, pos, D**-0.5, 256, None, {}), 200, warm=20)
        sdpa = per_call(lambda: F.scaled_dot_product_attention(q, k, v, scale=D**-0.5, enable_gqa=True), 200, warm=20)
        print(f"| {length} | {ours:.1f} | {sdpa:.1f} |", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [144, 1024])
