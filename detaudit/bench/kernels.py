"""`detaudit bench kernels`: bio matmul and TBIK tree matmul throughput as a ratio of the native GEMM
(cuBLAS on GPU, oneDNN/MKL on CPU) in the same run, accuracy against an fp64 reference (of the outputs
in the model dtype, and of the fp32 products before that cast), and each wrapper's eager wall time per
call against the native call's (the host cost an uncaptured caller pays)."""

from __future__ import annotations

import time

import pandas as pd
import torch

from detaudit.backends.kernels import fixed, tree

M_VALUES = (8, 32, 256, 2048, 8192)
KN_VALUES = ((4096, 4096), (6144, 2048))


def _graph(fn, reps: int) -> torch.cuda.CUDAGraph:
    """`fn(i)` for i in 0..reps-1 captured back to back into one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(3):  # warm up on the capture stream (allocator, lazy init)
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            fn(i)
    return graph


def _times(fns, device: torch.device, min_s: float = 0.2, reps: int | None = None, rounds: int = 7) -> list[float]:
    """Median seconds per call of each `fn(i)` (i picks one of the rotated weight copies). GPU: each fn is
    captured `reps` times back to back into one CUDA graph, and the graphs are replayed in turn, round
    after round, timed with CUDA events: launch overhead on the host is not counted (an engine's decode
    runs from graphs too), and a change of clocks during the run hits every fn alike. CPU: perf_counter,
    one fn after the other."""
    for fn in fns:
        fn(0)  # warm-up / compile
    if device.type == "cuda":
        reps = reps or 20
        graphs = [_graph(fn, reps) for fn in fns]
        times: list[list[float]] = [[] for _ in fns]
        for _ in range(rounds):
            for graph, out in zip(graphs, times):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                graph.replay()
                e.record()
                e.synchronize()
                out.append(s.elapsed_time(e) / 1e3 / reps)
        return [float(sorted(t)[len(t) // 2]) for t in times]
    return [_cpu_time(fn, min_s, reps) for fn in fns]


def _cpu_time(fn, min_s: float, reps: int | None) -> float:
    times, start = [], time.perf_counter()
    while len(times) < (reps or 3) or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        fn(0)
        times.append(time.perf_counter() - t)
        if reps and len(times) >= reps:
            break
    return float(sorted(times)[len(times) // 2])


def _time(fn, device: torch.device, min_s: float = 0.2, reps: int | None = None) -> float:
    """Median seconds per call of one fn (see `_times`)."""
    return _times([fn], device, min_s, reps)[0]


def _eager_per_call(fns, device: torch.device, calls: int = 100, rounds: int = 5) -> list[float]:
    """Median wall seconds per call of each `fn(i)` called eagerly from Python, `calls` times back to back
    with one device synchronisation at the end: what a caller pays per call when nothing is graphed
    (host work of the wrapper and the launch, or the kernel's own time once that is longer). The fns
    take turns round after round, like `_times`."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for fn in fns:
        for i in range(3):
            fn(i)  # warm-up: compilation, the wrapper's kept launch plan
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, times):
            t = time.perf_counter()
            for i in range(calls):
                fn(i)
            sync()
            out.append((time.perf_counter() - t) / calls)
    return [float(sorted(t)[len(t) // 2]) for t in times]


def _weight_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """On GPU, enough distinct copies of the weight to exceed twice the L2 cache, used in turn, so that
    every call streams its weight from HBM as an engine's layers do (one copy on CPU)."""
    if w.device.type != "cuda":
        return [w]
    l2 = getattr(torch.cuda.get_device_properties(w.device), "L2_cache_size", 50 << 20)
    n = max(1, -(-2 * l2 // (w.numel() * w.element_size())))
    return [w] + [w.clone() for _ in range(n - 1)]


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def bench_kernels(
    device: str = "cuda",
    dtype: torch.dtype = torch.bfloat16,
    m_values=M_VALUES,
    kn_values=KN_VALUES,
    progress=None,
    eager: bool = True,
    tp_values=(1,),
) -> pd.DataFrame:
    """Per (K, N, TP, M): graph-replayed seconds per call of cuBLAS / bio / tree (`_times`: kernel time, no
    host work) as TFLOP/s and ratios, and with `eager` the wall time per call of each called eagerly from
    Python (`_eager_per_call`: the wrapper's host cost at small M) as microseconds and as a multiple of
    cuBLAS's eager `F.linear` (lower is better; the goal is <= 1.5x at M <= 64).

    K is a rank's K at that TP size, and bio and the tree run what a row-parallel layer of the engine
    runs there: at TP 1 the whole product rounded to `dtype` in the store (`row_output`), at TP > 1 the
    rank's fp32 partial (`row_partial`: the tree over its 8 / TP leaves), which the all-reduce casts.
    cuBLAS writes `dtype` either way, as bf16's layers do."""
    dev = torch.device(device)
    for k, n in kn_values:
        for tp in tp_values:  # refuse a shape the tree cannot cut before any timing
            tree.leaf_plan(k, tp, f"--kn {k}x{n} at --tp {tp}")
    rows = []
    for (k, n), tp in ((kn, tp) for kn in kn_values for tp in tp_values):
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.float32).to(dtype)
        ws = _weight_copies(w)
        out = dtype if tp == 1 else torch.float32
        for m in m_values:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.float32).to(dtype)
            ref = x.double() @ w.double().t() if m * n * k <= 2048 * 4096 * 6144 else None
            native = lambda i=0: torch.nn.functional.linear(x, ws[i % len(ws)])  # noqa: E731
            bio = lambda i=0: fixed.matmul(x, ws[i % len(ws)], out_dtype=out)  # noqa: E731
            tbik = lambda i=0, tp=tp: tree.tree_matmul(x, ws[i % len(ws)], tp, out_dtype=out)  # noqa: E731
            t_nat, t_bio, t_tree = _times((native, bio, tbik), dev)
            flops = 2 * m * n * k
            row = {
                "M": m,
                "K": k,
                "N": n,
                "tp": tp,
                "native_tflops": flops / t_nat / 1e12,
                "bio_tflops": flops / t_bio / 1e12,
                "bio_ratio": t_nat / t_bio,
                "tree_tflops": flops / t_tree / 1e12,
                "tree_ratio": t_nat / t_tree,
            }
            if eager:  # the wrappers as an eager caller runs them
                e_nat, e_bio, e_tree = _eager_per_call((native, bio, tbik), dev)
                row.update(
                    native_eager_us=e_nat * 1e6,
                    bio_eager_us=e_bio * 1e6,
                    tree_eager_us=e_tree * 1e6,
                    bio_eager_vs_native=e_bio / e_nat,
                    tree_eager_vs_native=e_tree / e_nat,
                )
            if ref is not None:
                row.update(
                    native_relerr=_rel_err(native(), ref),
                    bio_relerr=_rel_err(bio(), ref),
                    tree_relerr=_rel_err(tree.tree_matmul(x, w, tp, out_dtype=dtype), ref),
                    # before the cast to the model dtype: the fp32 partials a row-parallel layer hands to
                    # the all-reduce, where the products' own rounding shows
                    bio_fp32_relerr=_rel_err(fixed.matmul(x, w), ref),
                    tree_fp32_relerr=_rel_err(tree.tree_matmul(x, w, tp), ref),
                )
            rows.append(row)
            if progress:
                progress()
    df = pd.DataFrame(rows)
    if dev.type == "cpu":  # which CPU product path bio and the tree ran (bf16 inputs or fp32) and why
        df.attrs["cpu_gemm"] = fixed.describe_cpu()["cpu_gemm"]
    return df
