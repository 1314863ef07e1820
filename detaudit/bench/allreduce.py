"""`detaudit bench allreduce`: tree all-reduce (gather and a2a) latency as a ratio of the library
all-reduce (NCCL on GPU, gloo on CPU), one process per rank, fp32 payloads."""

from __future__ import annotations

import json
import os
import time

import pandas as pd
import torch
import torch.multiprocessing as mp

SIZES = (32 * 1024, 2 * 1024 * 1024, 32 * 1024 * 1024)


def _rank(rank: int, world: int, port: int, device: str, sizes, reps: int, out_path: str) -> None:
    from detaudit.backends.tbik import TbikBackend
    from detaudit.builtin import dist

    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    group = dist.init(rank, world, port, dev)
    try:
        results = []
        for n in sizes:
            x = torch.randn(n, device=dev)
            row = {"elements": n}
            for name, fn in (
                ("library", lambda: group.all_reduce_sum(x)),
                ("tree_gather", lambda: TbikBackend("gather").all_reduce(x, group, torch.float32)),
                ("tree_a2a", lambda: TbikBackend("a2a").all_reduce(x, group, torch.float32)),
            ):
                for _ in range(3):
                    fn()
                group.barrier()
                if device == "cuda":
                    torch.cuda.synchronize()
                times = []
                for _ in range(reps):
                    t = time.perf_counter()
                    fn()
                    if device == "cuda":
                        torch.cuda.synchronize()
                    times.append(time.perf_counter() - t)
                row[f"{name}_us"] = sorted(times)[len(times) // 2] * 1e6
            a = TbikBackend("gather").all_reduce(x, group, torch.float32)
            b = TbikBackend("a2a").all_reduce(x, group, torch.float32)
            row["gather_equals_a2a"] = bool(torch.equal(a, b))
            results.append(row)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.shutdown(group)


def bench_allreduce(
    world: int, device: str = "cuda", sizes=SIZES, reps: int = 20, tmp_dir: str = "/tmp"
) -> pd.DataFrame:
    from detaudit.builtin.dist import free_port

    out_path = os.path.join(tmp_dir, f"detaudit-allreduce-{os.getpid()}.json")
    mp.spawn(_rank, args=(world, free_port(), device, tuple(sizes), reps, out_path), nprocs=world, join=True)
    with open(out_path) as f:
        df = pd.DataFrame(json.load(f))
    os.unlink(out_path)
    df.insert(0, "ranks", world)
    df.insert(1, "device", device)
    df["gather_ratio"] = df["tree_gather_us"] / df["library_us"]
    df["a2a_ratio"] = df["tree_a2a_us"] / df["library_us"]
    return df
