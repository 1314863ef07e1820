"""Fixed-shape block products on CPU, each computed by exactly one thread.

Every batch-invariant CPU product is a stack of block products `a[g] @ b` of one fixed shape
[R, K] @ [K, N]. A fixed shape is not enough: MKL picks its threading from the call, and a
multi-threaded call may split K across threads (measured on an AVX-512 Xeon: a [16, 49152] @
[49152, 8] block gave other bits with 2 threads than with 1, and `torch.bmm` of one block runs
multi-threaded while a stack of two runs one thread per block). So here every block product runs
with one MKL/OpenMP thread, and the parallelism is ours: whole blocks, or 64-column panels of the
output when there are fewer blocks than threads, go to worker threads that were set to one thread
each. A block's bits then depend only on the block and the weight, never on the thread count, the
number of blocks, or how the work was split.
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch
from torch import Tensor

# torch's own setter: vLLM's CPU worker replaces `torch.set_num_threads` with a no-op after binding its
# threads, which would silently leave these products multi-threaded inside vLLM processes
_set_num_threads = torch._C.set_num_threads

PANEL = 64  # output columns are split at multiples of this (keeps every panel 256-byte aligned)
MIN_SPLIT_FLOPS = 64e6  # below this, one thread does the whole product (a hand-off costs ~0.1 ms)

_pool: ThreadPoolExecutor | None = None
_pool_size = 0
_lock = threading.Lock()


def _reset_after_fork() -> None:  # a forked child has none of the parent's worker threads
    global _pool, _pool_size
    _pool, _pool_size = None, 0


os.register_at_fork(after_in_child=_reset_after_fork)


def _workers(n: int) -> ThreadPoolExecutor:
    """A pool of at least n single-threaded workers."""
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(n, thread_name_prefix="detaudit-gemm",
                                                   initializer=_set_num_threads, initargs=(1,)), n
        return _pool


@contextlib.contextmanager
def one_thread() -> Iterator[int]:
    """Run the block in this thread with one intra-op / MKL thread (thread-local settings); yields the
    thread count it had before, restored on exit."""
    n = torch.get_num_threads()
    if n == 1:
        yield 1
        return
    _set_num_threads(1)
    try:
        yield n
    finally:
        _set_num_threads(n)


def _parts(g: int, n: int, width: int) -> list[tuple[slice, slice]]:
    """Split g blocks x n columns into at most `width` parts: by blocks when there are enough, else by
    64-column panels."""
    if g >= width:
        return [(slice(i * g // width, (i + 1) * g // width), slice(0, n)) for i in range(width)]
    panels = -(-n // PANEL)
    width = min(width, panels)
    return [(slice(0, g), slice(i * panels // width * PANEL, min(n, (i + 1) * panels // width * PANEL)))
            for i in range(width)]


def block_products(a: Tensor, b: Tensor) -> Tensor:
    """fp32 out[g] = a[g] @ b (b[K, N] shared, or b[G, K, N] per block), a[G, R, K] fp32: every block
    product computed by one thread, the blocks spread over this thread and the pool."""
    g, r, k = a.shape
    n = b.shape[-1]
    out = torch.empty(g, r, n, dtype=torch.float32, device=a.device)
    if out.numel() == 0:
        return out.zero_()
    shared = b.dim() == 2
    # grad / inference mode are thread-local: the workers take the caller's
    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())

    def run(part: tuple[slice, slice]) -> None:
        with torch.set_grad_enabled(modes[0]), torch.inference_mode(modes[1]):
            _run(part)

    def _run(part: tuple[slice, slice]) -> None:
        gs, ns = part
        rows = a[gs]
        bb = b[:, ns] if shared else b[gs, :, ns]
        if shared:
            bb = bb.expand(rows.shape[0], k, bb.shape[-1])
        if ns.stop - ns.start == n:
            torch.bmm(rows, bb, out=out[gs])
        else:
            out[gs, :, ns] = torch.bmm(rows, bb)

    with one_thread() as width:
        parts = _parts(g, n, width) if 2.0 * g * r * k * n >= MIN_SPLIT_FLOPS else [(slice(0, g), slice(0, n))]
        if len(parts) == 1:
            run(parts[0])
            return out
        futures = [_workers(len(parts) - 1).submit(run, p) for p in parts[1:]]
        run(parts[0])
        for f in futures:
            f.result()
    return out
