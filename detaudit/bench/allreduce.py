"""`detaudit bench allreduce`: the invariant backends' all-reduce against the library's, as the engine
calls them: a row-parallel layer's partial of `tokens` rows of `hidden` columns, one process per rank.

- `library`: the bf16 backend's all-reduce of its bf16 partial (NCCL on GPU, gloo on CPU);
- `bio` / `bio+tbik`: the backend's all-reduce of its fp32 partial into bf16, with each transport of
  `allreduce.fixed_order_all_reduce`: `gather` (how they moved partials before reduce-scatter existed),
  `scatter`, `peer` (GPU only: peer memory over NVLink, `backends/peer.py`) and `auto` (what the engine
  uses). Every transport's output is checked bitwise against
  `gather`'s.
With `layer_k`, also the whole row-parallel layer as the engine runs it (`builtin/layers.py`): x[tokens,
layer_k] @ w[hidden, layer_k] (a rank's shard: 1024 for Qwen3-8B's o_proj at TP 4, 3072 for its down_proj)
and the all-reduce, through the backend's `row_group` (bio+tbik's routed matmul on Hopper, bio's overlapped
copies; elsewhere `all_reduce(row_partial)`): `<backend>_layer_us`, eager (prefill is
not graphed), each bio / bio+tbik output checked bitwise against its partial's `gather` all-reduce.
Times are medians of `reps` timed replays, each synchronised; on GPU a replay is a CUDA graph of GRAPH_CALLS
back-to-back calls captured per configuration (as the engine's graphed decode runs them; the time is per
call: the host's timing of a replay, about 17 us, and the ranks' start skew fall on all the calls, not
each), after a warm-up.
"""

from __future__ import annotations

import json
import os
import time

import pandas as pd
import torch
import torch.multiprocessing as mp

TOKENS = (8, 32, 512, 4096, 16384)  # decode batches and prefill chunks of the engine
HIDDEN = 4096
MODES = ("gather", "scatter", "peer", "auto")
GRAPH_CALLS = 10  # calls per timed CUDA graph replay


def _time(fn, device: str, reps: int, group) -> float:
    """Median seconds per call (GPU: replayed from a CUDA graph of GRAPH_CALLS calls)."""
    for _ in range(3):
        fn()
    group.barrier()
    if device != "cuda":
        return _median(fn, 1, device, reps, group)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(GRAPH_CALLS):
            fn()
    return _median(graph.replay, GRAPH_CALLS, device, reps, group)


def _eager(fn, device: str, reps: int, group, calls: int = 5) -> float:
    """Median seconds per call of `calls` back-to-back eager calls, `reps` times, after a warm-up."""
    for _ in range(2):
        fn()

    def run():
        for _ in range(calls):
            fn()

    return _median(run, calls, device, reps, group)


def _median(run, calls: int, device: str, reps: int, group) -> float:
    """The median over `reps` synchronised runs of `run` (which makes `calls` calls) of its time per call."""
    times = []
    for _ in range(reps):
        group.barrier()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        run()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) / calls)
    return sorted(times)[len(times) // 2]


def _layers(row: dict, group, dev: str, device: str, t: int, hidden: int, k: int, reps: int, g) -> None:
    """The row-parallel layer's time per backend (see the module docstring) into `row`."""
    from detaudit.backends import allreduce, get_backend

    x = torch.randn(t, k, device=dev, generator=g).bfloat16()
    w = (torch.randn(hidden, k, device=dev, generator=g) / k**0.5).bfloat16()
    row["layer_k"] = k
    for name in ("bf16", "bio", "bio+tbik"):
        b = get_backend(name)

        def layer(b=b):
            return b.row_group(x, w, group, torch.bfloat16)

        with b.activate():
            out = layer()
            if name != "bf16":
                p = b.row_partial(x, w, group.size)
                want = allreduce.fixed_order_all_reduce(p, group, torch.bfloat16, b._reduce, "gather", b.REDUCE_ORDER)
                row[f"{name}_layer_same_bits"] = bool(torch.equal(out, want))
            row[f"{name}_layer_us"] = 1e6 * _eager(layer, device, reps, group)


def _rank(
    rank: int, world: int, port: int, device: str, tokens, hidden: int, reps: int, out_path: str, layer_k: int = 0
) -> None:
    from detaudit.backends import allreduce, get_backend
    from detaudit.builtin import dist

    dev = f"cuda:{rank}" if device == "cuda" else "cpu"
    if device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    group = dist.init(rank, world, port, dev)
    try:
        results = []
        # the peer transport where this group has one (every rank gets the same answer)
        peer = (
            device == "cuda" and group.peer_all_reduce(torch.zeros(64, device=dev), torch.bfloat16, "rank") is not None
        )
        g = torch.Generator(device=dev).manual_seed(rank)
        for t in tokens:
            partial = torch.randn(t, hidden, device=dev, generator=g)
            bf16 = partial.bfloat16()
            row = {"tokens": t, "hidden": hidden, "partial_mb": round(partial.numel() * 4 / 2**20, 3)}
            row["library_us"] = 1e6 * _time(lambda: group.all_reduce_sum(bf16), device, reps, group)
            for name in ("bio", "bio+tbik"):
                b = get_backend(name)
                outs = {}
                for mode in MODES:
                    if mode == "peer" and not peer:
                        continue  # GPU groups with symmetric memory only

                    def call(b=b, mode=mode):
                        return allreduce.fixed_order_all_reduce(
                            partial, group, torch.bfloat16, b._reduce, mode, b.REDUCE_ORDER
                        )

                    outs[mode] = call()
                    row[f"{name}_{mode}_us"] = 1e6 * _time(call, device, reps, group)
                row[f"{name}_same_bits"] = all(torch.equal(outs["gather"], o) for o in outs.values())
            if layer_k:
                _layers(row, group, dev, device, t, hidden, layer_k, reps, g)
            results.append(row)
        if rank == 0:
            with open(out_path, "w") as f:
                json.dump(results, f)
    finally:
        dist.shutdown(group)


def bench_allreduce(
    world: int,
    device: str = "cuda",
    tokens=TOKENS,
    hidden: int = HIDDEN,
    reps: int = 20,
    tmp_dir: str = "/tmp",
    layer_k: int = 0,
) -> pd.DataFrame:
    from detaudit.builtin.dist import free_port

    out_path = os.path.join(tmp_dir, f"detaudit-allreduce-{os.getpid()}.json")
    args = (world, free_port(), device, tuple(tokens), hidden, reps, out_path, layer_k)
    mp.spawn(_rank, args=args, nprocs=world, join=True)
    with open(out_path) as f:
        df = pd.DataFrame(json.load(f))
    os.unlink(out_path)
    df.insert(0, "ranks", world)
    df.insert(1, "device", device)
    for name in ("bio", "bio+tbik"):
        for mode in MODES:
            if f"{name}_{mode}_us" in df:
                df[f"{name}_{mode}_x"] = df[f"{name}_{mode}_us"] / df["library_us"]
        if f"{name}_layer_us" in df:
            df[f"{name}_layer_x"] = df[f"{name}_layer_us"] / df["bf16_layer_us"]
    return df
