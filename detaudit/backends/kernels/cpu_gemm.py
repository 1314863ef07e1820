"""Fixed-shape block products on CPU, each computed by exactly one thread.

Every batch-invariant CPU product is a stack of block products `a[g] @ b` of one fixed shape
[R, K] @ [K, N]. A fixed shape is not enough: MKL picks its threading from the call, and a
multi-threaded call may split K across threads (measured on an AVX-512 Xeon: a [16, 49152] @
[49152, 8] block gave other bits with 2 threads than with 1, and `torch.bmm` of one block runs
multi-threaded while a stack of two runs one thread per block). So here every block product runs
with one MKL/OpenMP thread, and the parallelism is ours (`spread`): whole blocks, or 64-column panels
of the output when there are fewer blocks than threads, go to the calling thread and to worker
threads that were set to one thread each. A block's bits then depend only on the block and the
weight, never on the thread count, the number of blocks, or how the work was split. `cpu_bf16`'s
bf16 products are spread the same way.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Iterator

import torch
from torch import Tensor

from detaudit.backends.kernels import cpu_replay

# torch's own setter: vLLM's CPU worker replaces `torch.set_num_threads` with a no-op after binding its
# threads, which would silently leave these products multi-threaded inside vLLM processes
_set_num_threads = torch._C.set_num_threads

PANEL = 64  # output columns are split at multiples of this (keeps every panel 256-byte aligned)
MIN_SPLIT_FLOPS = 64e6  # below this, one thread does the whole product (a hand-off costs ~0.1 ms)
FEW_BLOCKS = 4  # up to this many blocks per group, b is copied per block and one call does all groups
# PyTorch's CPU bmm computes a product of fewer than 400 multiply-adds (R x K x N) with its own loop (a
# multiply, then an add) and a one-column product with a matrix-vector kernel whose order depends on the
# rows; every other product goes to the BLAS GEMM (fused multiply-adds), whose column bits do not depend on
# N from some width on: N >= 8 where MKL runs its AVX-512 kernels (measured, torch 2.13: every K up to 40
# and N up to 72), N >= 12 on an AVX2-only CPU (an AMD EPYC without AVX-512, R 8 or 16, K 24 to 4096, N up
# to 1024: narrower products add K in another order). So a narrow product (a column shard of width I/C, a
# panel's last columns) would get other bits than the same columns of a wider one: a product is never
# computed with fewer than `min_columns` columns (zero columns added, dropped after), with a margin over
# both limits (tests/unit/test_bio.py checks it on the machine that runs it).
MIN_COLUMNS = 16
MIN_MACS = 1024

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_lock = threading.Lock()


def _reset_after_fork() -> None:  # a forked child has none of the parent's worker threads
    global _pool, _pool_size
    _pool, _pool_size = None, 0


os.register_at_fork(after_in_child=_reset_after_fork)


def _workers(n: int) -> ThreadPoolExecutor:
    """A pool of at least n single-threaded workers. A smaller pool is replaced, never shut down: a
    caller that already holds it may still be submitting to it (that was a race); its idle threads
    exit when the last holder drops it."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            pool = ThreadPoolExecutor(
                n, thread_name_prefix="detaudit-gemm", initializer=_set_num_threads, initargs=(1,)
            )
            # every worker is started here, inside `one_thread`: a worker's initializer sets torch's
            # process-wide count to 1 (the caller's too), and leaving `one_thread` puts the caller's back
            # once all of them have run. A worker started later, by a job that leaves the count alone
            # (`run_jobs(torch_ops=False)`), would leave every thread at 1 intra-op thread.
            with one_thread():
                started = threading.Barrier(n)
                wait([pool.submit(started.wait) for _ in range(n)])
            _pool, _pool_size = pool, n
        return _pool


@contextlib.contextmanager
def one_thread() -> Iterator[int]:
    """Run the block with one intra-op / MKL thread (torch's setting is process-wide: every thread's
    products see it); yields the thread count it had before, restored on exit."""
    n = torch.get_num_threads()
    if n == 1:
        yield 1
        return
    _set_num_threads(1)
    try:
        yield n
    finally:
        _set_num_threads(n)


def _jobs(g: int, nb: int, n: int, width: int, panel: int = PANEL) -> list[tuple[slice, slice, slice]]:
    """Split g groups x nb blocks x n columns into about `width` jobs (group range, block range, column
    range): by groups when there are enough, else by blocks, else by `panel`-column panels."""
    if width <= 1:
        return [(slice(0, g), slice(0, nb), slice(0, n))]
    if g >= width:
        return [(slice(i * g // width, (i + 1) * g // width), slice(0, nb), slice(0, n)) for i in range(width)]
    jobs = []
    for gi in range(g):
        grp = slice(gi, gi + 1)
        if nb >= width:
            jobs += [(grp, slice(i * nb // width, (i + 1) * nb // width), slice(0, n)) for i in range(width)]
        else:
            panels = -(-n // panel)
            w = min(width, panels)
            jobs += [
                (grp, slice(0, nb), slice(i * panels // w * panel, min(n, (i + 1) * panels // w * panel)))
                for i in range(w)
            ]
    return jobs


def spread(g: int, nb: int, n: int, flops: float, run, panel: int = PANEL) -> None:
    """Run `run(job)` over every (group range, block range, column range) job of g x nb x n. A product
    big enough to pay for the hand-off is cut into one job per thread: this thread runs the first with
    one intra-op thread, the pool's single-threaded workers the others. A smaller one runs here whole,
    with one thread. Which thread runs a job never changes what the job computes."""
    width = torch.get_num_threads()
    jobs = _jobs(g, nb, n, width, panel) if width > 1 and flops >= MIN_SPLIT_FLOPS else []
    run_jobs(jobs or [(slice(0, g), slice(0, nb), slice(0, n))], run)


def run_jobs(jobs: list, run, torch_ops: bool = True) -> None:
    """`run(job)` for every job: the first on this thread, the others on the pool's workers (one job: all
    here), every one with one intra-op thread where the jobs run torch ops (`torch_ops`). Jobs that only
    call single-threaded compiled code (the micro-kernel, numba's loops: `cpu_calls`) leave torch's
    thread count alone: it cannot change what they compute, and setting it is not free (ATen's
    set_num_threads also resizes torch's pthreadpool and clears oneDNN's computation cache, twice per
    product and attention call)."""
    # torch's intra-op thread count is process-wide, not per thread: one intra-op thread from before the
    # first job is handed out until the last has finished, or a worker starting late would run its
    # product with the caller's count restored, and other bits (1 vs 2 threads differ at K >= 1536)
    if torch_ops:
        cpu_replay.refuse_threads("cpu_gemm.run_jobs")
    with one_thread() if torch_ops else contextlib.nullcontext():
        if len(jobs) < 2:
            for job in jobs:
                run(job)
            return
        pool = _workers(len(jobs) - 1)
        futures = [pool.submit(run, j) for j in jobs[1:]]
        try:
            run(jobs[0])
        finally:  # the workers read the caller's tensors: wait for them even when this thread's job failed
            wait(futures)
    for f in futures:
        f.result()


def profiled(name: str):
    """A range named `name` in torch.profiler's trace while a profiler records, else nothing: the compiled
    calls (micro-kernels, numba) are no aten ops, and without a range of their own their time would be
    nobody's self time in `bench e2e --profile` on CPU."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def min_columns(r: int, k: int) -> int:
    """The fewest columns a block product [r, k] @ [k, N] is computed with (see MIN_MACS)."""
    return max(MIN_COLUMNS, -(-MIN_MACS // max(r * k, 1)))


def _widened(rhs: Tensor, n: int) -> Tensor:
    """rhs[..., K, w] with zero columns added up to n (w < n): the first w columns' products are the same
    GEMM's, whatever w is."""
    return torch.nn.functional.pad(rhs, (0, n - rhs.shape[-1]))


@cpu_replay.unit
def block_products(a: Tensor, b: Tensor) -> Tensor:
    """fp32 block products of one fixed shape [R, K] @ [K, N], each computed by one thread.

    a[nb, R, K] with b[K, N]: out[j] = a[j] @ b. a[G, nb, R, K] with b[G, K, N]: out[g, j] = a[g, j] @ b[g]
    (b is shared by a group's blocks, never copied per block). Blocks are spread over this thread and
    the pool; a block's bits never depend on the split, nor on how many columns share its product
    (`min_columns`)."""
    grouped = b.dim() == 3
    a4 = a if grouped else a.unsqueeze(0)
    b3 = b if grouped else b.unsqueeze(0)
    g, nb, r, k = a4.shape
    n = b3.shape[-1]
    out = torch.empty(g, nb, r, n, dtype=torch.float32, device=a.device)
    if out.numel() == 0:
        return out.zero_() if grouped else out[0].zero_()
    # grad / inference mode are thread-local: the workers take the caller's
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    narrow = min_columns(r, k)

    def run(job: tuple[slice, slice, slice]) -> None:
        gs, bs, ns = job
        width = ns.stop - ns.start
        cols = max(width, narrow)  # the columns each product is computed with
        with torch.set_grad_enabled(modes[0]), torch.inference_mode(modes[1]):
            blocks = bs.stop - bs.start
            if gs.stop - gs.start > 1 and blocks <= FEW_BLOCKS:
                # many groups of few blocks (decode attention): one call, the group's b repeated per block
                rows = a4[gs, bs].reshape(-1, r, k)
                rhs = b3[gs, :, ns] if cols == width else _widened(b3[gs, :, ns], cols)
                rhs = rhs.unsqueeze(1).expand(-1, blocks, k, cols).reshape(-1, k, cols)
                out[gs, bs, :, ns] = torch.bmm(rows, rhs)[..., :width].view(-1, blocks, r, width)
                return
            for gi in range(gs.start, gs.stop):  # b shared by the group's blocks: a stride-0 view, no copy
                rows = a4[gi, bs]
                rhs = b3[gi, :, ns] if cols == width else _widened(b3[gi, :, ns], cols)
                dest = out[gi, bs, :, ns]
                if cols == width and dest.is_contiguous():
                    torch.bmm(rows, rhs.expand(rows.shape[0], k, cols), out=dest)
                else:
                    dest.copy_(torch.bmm(rows, rhs.expand(rows.shape[0], k, cols))[..., :width])

    with profiled("detaudit::fp32_block_products"):
        spread(g, nb, n, 2.0 * g * nb * r * k * n, run)
    return out if grouped else out[0]
