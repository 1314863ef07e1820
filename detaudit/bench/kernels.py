"""`detaudit bench kernels`: bio matmul and TBIK tree matmul throughput as a ratio of the native GEMM
(cuBLAS on GPU, oneDNN/MKL on CPU) in the same run, and accuracy against an fp64 reference."""

from __future__ import annotations

import time

import pandas as pd
import torch

from detaudit.backends.kernels import fixed, tree

M_VALUES = (8, 32, 256, 2048, 8192)
KN_VALUES = ((4096, 4096), (6144, 2048))


def _time(fn, device: torch.device, min_s: float = 0.2, reps: int | None = None) -> float:
    """Median seconds per call. GPU: `fn(i)` is captured `reps` times back to back into one CUDA graph
    (i picks one of the rotated weight copies), and a replay is timed with CUDA events, so launch
    overhead on the host is not counted (an engine's decode runs from graphs too). CPU: perf_counter."""
    fn(0)  # warm-up / compile
    if device.type == "cuda":
        reps = reps or 20
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
        times = []
        for _ in range(7):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            graph.replay()
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) / 1e3 / reps)
        return float(sorted(times)[len(times) // 2])
    times, start = [], time.perf_counter()
    while len(times) < (reps or 3) or time.perf_counter() - start < min_s:
        t = time.perf_counter()
        fn(0)
        times.append(time.perf_counter() - t)
        if reps and len(times) >= reps:
            break
    return float(sorted(times)[len(times) // 2])


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


def bench_kernels(device: str = "cuda", dtype: torch.dtype = torch.bfloat16, m_values=M_VALUES,
                  kn_values=KN_VALUES, progress=None) -> pd.DataFrame:
    dev = torch.device(device)
    rows = []
    for k, n in kn_values:
        g = torch.Generator(device=dev).manual_seed(0)
        w = torch.randn(n, k, device=dev, generator=g, dtype=torch.float32).to(dtype)
        ws = _weight_copies(w)
        for m in m_values:
            x = torch.randn(m, k, device=dev, generator=g, dtype=torch.float32).to(dtype)
            ref = x.double() @ w.double().t() if m * n * k <= 2048 * 4096 * 6144 else None
            native = lambda i=0: torch.nn.functional.linear(x, ws[i % len(ws)])  # noqa: E731
            bio = lambda i=0: fixed.matmul(x, ws[i % len(ws)], out_dtype=dtype)  # noqa: E731 (what bio's linear runs)
            tbik = lambda i=0: tree.tree_matmul(x, ws[i % len(ws)], 1).to(dtype)  # noqa: E731
            t_nat, t_bio, t_tree = (_time(f, dev) for f in (native, bio, tbik))
            flops = 2 * m * n * k
            row = {"M": m, "K": k, "N": n, "native_tflops": flops / t_nat / 1e12,
                   "bio_tflops": flops / t_bio / 1e12, "bio_ratio": t_nat / t_bio,
                   "tree_tflops": flops / t_tree / 1e12, "tree_ratio": t_nat / t_tree}
            if ref is not None:
                row.update(native_relerr=_rel_err(native(), ref), bio_relerr=_rel_err(bio(), ref),
                           tree_relerr=_rel_err(tbik(), ref))
            rows.append(row)
            if progress:
                progress()
    return pd.DataFrame(rows)
