"""Per-call cost of the bf16 CPU products (`kernels/cpu_bf16`) against torch's bf16 linear at the embedded
model's decode (8 rows) and prefill (1,024 rows) shapes, on this process's path (AMX tiles or vdpbf16ps):
a diagnosis aid for issue 55, run on an AMX host, e.g. `OMP_NUM_THREADS=2 python3 tools/amx_calls.py`
(`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16` gives the vdpbf16ps path on the same CPU). Columns: microseconds
per product (torch; ours, all its calls) and per single micro-kernel call (one block, one panel; with
and without the AMX tile release after it).

`python3 tools/amx_calls.py stream [GAP_US]`: decode products as a decode step meets them, each of
LAYERS distinct weights once in turn (streamed from memory, not warm in cache), GAP_US of busy Python
between two (the step's other ops, during which the team's workers go to sleep), against torch's bf16
linear on the same weights: microseconds a product at each per-thread share of flops (its threads)."""

from __future__ import annotations

import dataclasses
import sys
import time

import torch
import torch.nn.functional as F

from detaudit.backends.kernels import cpu_bf16

SHAPES = [(576, 2560), (576, 3072), (1536, 576), (576, 576)]  # (K, N): q/k/v, gate/up, down, o


def per_call(fn, reps: int, warm: int = 3) -> float:
    """Microseconds a call of fn(): the mean of `reps` after `warm` calls (also `cpu_attention_calls`')."""
    for _ in range(warm):
        fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    choice = cpu_bf16.choice()
    print(f"# {choice.describe()}; torch threads {torch.get_num_threads()}")
    if not choice.bf16:
        return
    kernel, r = cpu_bf16._kernel, choice.rows
    print("| rows | K | N | calls | torch us | ours us | one call us | one call + release us |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for m in (8, 1024):
        for k, n in SHAPES:
            x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
            packed = cpu_bf16.pack(w)
            p, half, width = packed.shape[0], packed.shape[1], packed.shape[2]
            reps = 200 if m == 8 else 20
            t_torch = per_call(lambda: F.linear(x, w), reps)
            t_ours = per_call(lambda: cpu_bf16.matmul(x, packed, n), reps)
            a = cpu_bf16.blocks_of(x[:r].contiguous())
            c = torch.empty(r, width)
            ptrs = (a.data_ptr(), packed.data_ptr(), c.data_ptr())
            args = (r, width, 2 * half, 2 * half, width, width, False, *ptrs, True)
            t_one = per_call(lambda: kernel.fn(*args), 2000)
            t_rel = per_call(lambda: (kernel.fn(*args), kernel.release_fn(True)), 2000)
            calls = -(-m // r) * p
            row = f"| {m} | {k} | {n} | {calls} | {t_torch:.1f} | {t_ours:.1f} | {t_one:.2f} | {t_rel:.2f} |"
            print(row, flush=True)


LAYERS = 30
SHARES = (1e6, 2e6, 4e6, 8e6, 16e6)


def stream(gap_us: float) -> None:
    from detaudit.backends.kernels import cpu_calls

    choice = cpu_bf16.choice()
    print(f"# {choice.describe()}; torch threads {torch.get_num_threads()}; team {cpu_calls.team() is not None}")
    if not choice.bf16:
        return
    kernel, m = cpu_bf16._kernel, 8

    def gap() -> None:
        until = time.perf_counter() + gap_us / 1e6
        while time.perf_counter() < until:
            pass

    def step(fn, ws) -> float:  # us a product, the gaps not counted
        start = time.perf_counter()
        for w in ws:
            fn(w)
            gap()
        return ((time.perf_counter() - start) / len(ws) - gap_us / 1e6) * 1e6

    heads = " | ".join(f"{s / 1e6:g} MFLOP us (threads)" for s in SHARES)
    print(f"| K | N | torch us | {heads} |")
    print("|---:|---:|---:|" + "---:|" * len(SHARES))
    for k, n in SHAPES:
        x = torch.randn(m, k).bfloat16()
        ws = [torch.randn(n, k).bfloat16() for _ in range(LAYERS)]
        packed = [cpu_bf16.pack(w) for w in ws]
        t_torch = min(step(lambda w: F.linear(x, w), ws) for _ in range(5))
        cells = []
        flops = 2.0 * choice.rows * k * packed[0].shape[0] * packed[0].shape[2]
        for share in SHARES:
            cpu_bf16._kernel = dataclasses.replace(kernel, per_thread=share, team_per_thread=share)
            threads = cpu_calls.kernel_threads(cpu_bf16._kernel, packed[0].shape[0], flops)
            t = min(step(lambda p: cpu_bf16.matmul(x, p, n), packed) for _ in range(5))
            cells.append(f"{t:.1f} ({threads})")
        cpu_bf16._kernel = kernel
        print(f"| {k} | {n} | {t_torch:.1f} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["stream"]:
        stream(float(sys.argv[2]) if len(sys.argv) > 2 else 50.0)
    else:
        main()
