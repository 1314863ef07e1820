import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from detaudit.synthetic import MANIFEST, PRESETS


def q3dir():
    d = Path("/tmp/q3")
    if not d.exists():
        d.mkdir()
        (d / "config.json").write_text(json.dumps(PRESETS["qwen3-8b-shaped"].config))
        (d / MANIFEST).write_text(
            json.dumps({"name": "qwen3-8b-shaped", "synthetic": {"preset": "qwen3-8b-shaped", "seed": 0, "std": 0.02}})
        )
    return d


def percall(fn, n=200):
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def kernels():
    from detaudit.backends.kernels import fixed, tree

    for m in (8, 64, 512):
        x = torch.randn(m, 4096, device="cuda").bfloat16()
        w = torch.randn(4096, 4096, device="cuda").bfloat16()
        a = percall(lambda: F.linear(x, w))
        b = percall(lambda: fixed.matmul(x, w, out_dtype=torch.bfloat16))
        c = percall(lambda: tree.tree_matmul(x, w, 1))
        print(f"percall M={m}: cublas {a:.1f} us  bio {b:.1f} us  tree {c:.1f} us", flush=True)
    x = torch.randn(8, 4096, device="cuda").bfloat16()
    w = torch.randn(4096, 4096, device="cuda").bfloat16()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(50):
            fixed.matmul(x, w, out_dtype=torch.bfloat16)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))


def engine(backend):
    from detaudit.bench.e2e import random_prompts
    from detaudit.config import DecodingParams
    from detaudit.engine.graphs import eager_step
    from detaudit.engine.local import LocalEngine

    eng = LocalEngine(q3dir(), backend, 1, device="cuda", cuda_graphs=False)
    prompts = random_prompts(8, 512, 151936)
    ids = [str(i) for i in range(8)]
    with eng.backend.activate():
        eng.generator.generate(prompts, ids, DecodingParams(greedy=True, max_new_tokens=4))
        eng.generator.generate(prompts, ids, DecodingParams(greedy=True, max_new_tokens=16))
        print(backend, "eager", eng.generator.timings, flush=True)
        m = eng.model
        cache = m.new_cache(8, 600)
        step = eager_step(m, cache)
        tok = torch.full((8,), 5, device="cuda")
        pos = torch.full((8,), 520, device="cuda")
        with torch.inference_mode():
            for _ in range(3):
                step(tok, pos)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(5):
                step(tok, pos)
            torch.cuda.synchronize()
            print(backend, "eager step ms (same kv_len each step)", (time.perf_counter() - t) / 5 * 1e3, flush=True)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for i in range(5):
                step(tok, pos + 1 + i)
            torch.cuda.synchronize()
            print(
                backend,
                "eager step ms (a new kv_len each step, as in decode)",
                (time.perf_counter() - t) / 5 * 1e3,
                flush=True,
            )
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                step(tok, pos)
                torch.cuda.synchronize()
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
    del eng
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def nccl_capture():
    import torch.distributed as dist

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = "29533"
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda:0"))
    x = torch.randn(8, 4096, device="cuda")
    out = torch.empty(1, 8, 4096, device="cuda")
    lst = [torch.empty_like(x)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        dist.all_gather_into_tensor(out, x)
        dist.all_gather(lst, x)
        y = x.clone()
        dist.all_reduce(y)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for mode in ("global", "thread_local"):
        try:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, capture_error_mode=mode):
                dist.all_gather_into_tensor(out, x * 2)
                dist.all_gather(lst, x * 3)
                y = x * 4
                dist.all_reduce(y)
            g.replay()
            torch.cuda.synchronize()
            print(
                "nccl capture",
                mode,
                torch.equal(out[0], x * 2),
                torch.equal(lst[0], x * 3),
                torch.equal(y, x * 4),
                flush=True,
            )
        except Exception as e:
            print("nccl capture", mode, "FAILED", type(e).__name__, e, flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    what = sys.argv[1:]
    if "nccl" in what:
        nccl_capture()
    if "kernels" in what:
        kernels()
    for b in ("bf16", "bio", "bio+tbik"):
        if b in what:
            engine(b)
