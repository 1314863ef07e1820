"""Time `grouped_mm.grouped` (the invariant backends' MoE expert products on GPU) at Qwen3-30B-A3B's
expert shapes under candidate tile configs, against torch's grouped mm (CUTLASS, bf16's experts), and
check that every config gives the default config's bits (a config only tiles). One-off tuning aid for
the configs in `kernels/grouped_mm.py`, run on a GPU machine: python3 tools/grouped_sweep.py TP [tokens...]
(TP: one rank's shard of the experts at that TP size, its intermediate columns and tree leaves)"""

from __future__ import annotations

import sys

import torch

from detaudit.backends import native_moe
from detaudit.backends.kernels import grouped_mm

E, K, H, INTER, LEAVES = 128, 8, 2048, 768, 8
CANDIDATES = {
    "proj": [
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4),
        dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=4),
        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=5),
    ],
    "leaf": [
        dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=32, num_warps=4, num_stages=3),
        dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=32, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, num_warps=8, num_stages=3),
        dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=32, num_warps=8, num_stages=3),
    ],
}


def timed(fn, reps: int = 10) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(tp: int, tokens: list[int]) -> None:
    inter, leaves = INTER // tp, LEAVES // tp
    g = torch.Generator(device="cuda").manual_seed(0)
    w_gu = torch.randn(E, 2 * inter, H, device="cuda", generator=g).bfloat16() / 32
    w_down = torch.randn(E, H, inter, device="cuda", generator=g).bfloat16() / 32
    w_leaf = w_down.view(E, H, leaves, inter // leaves).transpose(1, 2).contiguous()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, TP {tp}: one rank's shard")
    print("| tokens | product | config | ms | x CUTLASS | bits as default |")
    print("|---:|---|---|---:|---:|---|")
    for t in tokens:
        x = torch.randn(t, H, device="cuda", generator=g).bfloat16()
        experts = torch.rand(t, E, device="cuda", generator=g).topk(K).indices
        act = torch.randn(t * K, inter, device="cuda", generator=g).bfloat16()
        by_expert, order = torch.sort(experts.reshape(-1), stable=True)
        offs = torch.searchsorted(by_expert, torch.arange(E, device="cuda"), right=True).to(torch.int32)
        cutlass = {
            "gate_up": timed(lambda: native_moe.grouped(x[order // K], w_gu, offs)),
            "down": timed(lambda: native_moe.grouped(act, w_down, offs)),
        }
        cutlass["down leaves"] = cutlass["down"]
        for kind, cfgs in CANDIDATES.items():
            ref = {}
            for cfg in cfgs:
                runs = grouped_mm.Runs(experts, E)
                src, dst = (runs.order // K).int(), runs.order.int()
                calls = (
                    {
                        "gate_up": lambda: grouped_mm.grouped(
                            x, src, w_gu, runs, runs.identity, t * K, torch.bfloat16, cfg
                        ),
                        "down": lambda: grouped_mm.grouped(act, runs.identity, w_down, runs, dst, t * K, config=cfg),
                    }
                    if kind == "proj"
                    else {
                        "down leaves": lambda: grouped_mm.grouped(
                            act, runs.identity, w_leaf, runs, dst, t * K, config=cfg
                        )
                    }
                )
                for name, fn in calls.items():
                    # outputs in (token, slot) order except gate / up's, sorted by expert: compare in token order
                    out = fn()
                    if name == "gate_up":
                        out = torch.empty_like(out).index_copy_(0, runs.order, out)
                    same = ref.setdefault(name, out)
                    ms = timed(fn)
                    c = " ".join(f"{k[6:] if k.startswith('BLOCK') else k}={v}" for k, v in cfg.items())
                    print(
                        f"| {t} | {name} | {c} | {ms:.3f} | {ms / cutlass[name]:.2f} | {torch.equal(out, same)} |",
                        flush=True,
                    )
        print(f"| {t} | CUTLASS | gate_up {cutlass['gate_up']:.3f} ms, down {cutlass['down']:.3f} ms | | | |")


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(a) for a in sys.argv[2:]] or [4096, 16384])
