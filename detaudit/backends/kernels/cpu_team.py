"""The team that runs detaudit's compiled CPU work on several threads: a product's micro-kernel calls,
the compiled attention's KV heads, the row kernels' rows (imported only where numba is installed;
`cpu_calls` owns it).

A Python thread pool hands a slice over with a future, a sleeping thread woken for it and the GIL taken
around both: on a 16-core AMX host a decode product's ~70 us of calls took 0.34 ms that way
(reports/cpu-bf16). Here each worker is a thread that stays inside compiled code (`serve`, the GIL
released) and polls a word of its own for a few microseconds, then sleeps on it (a futex) until the
caller wakes it; the caller (`dispatch`, also without the GIL) writes the job into a shared control
block, raises the tickets of the workers the job needs, makes slice 0 itself and waits for their done
words. A ticket is raised with a release store after the job's fields are written and read with an
acquire load before they are, so a worker never reads a job being written; a worker the job does not
need sees nothing. The slices are `cpu_calls.slices`' contiguous ones and each is `cpu_loop`'s `loop` or
`tree_loop` (or `cpu_attention.attend` over KV heads, `cpu_rows`' kernels over rows), so the work is
done exactly as on one thread, only on another: the same bits. Every kernel here and in the modules it
calls is compiled with numba's numpy error model (a division by zero gives IEEE inf / NaN, as torch's ops
do, instead of raising): an exception would end a worker with its done word unwritten and the dispatcher
waiting for it.

The control block is int64: fields in the first line, then per worker a ticket and a done word in lines
of their own (no false sharing between workers)."""

from __future__ import annotations

import ctypes
import ctypes.util

import llvmlite.binding as llvm
import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from detaudit.backends.kernels import cpu_attention, cpu_loop, cpu_rows, numba_cache

numba_cache.fresh()  # before any cache is loaded: a caller's cache holds its callees' code

KIND, THREADS, JOBS, TABLE, LEAVES, OUT, OUT_SIZE, RELEASE, KERNEL_AT, RELEASE_AT = range(10)  # the job's fields
SHAPE = 10  # m, n, k, lda, ldb, ldc: 10..15
# an ATTEND job's fields (`cpu_attention.attend` over KV heads): the addresses of qs [G, R, D] fp32, pos
# [G, R] int64, the cache's k and v (rows `KV_STRIDE` elements apart per head: [G, *, D], the first L
# keys read; int16 bf16 bits or fp32) and out [G, R, D] fp32, with G (JOBS), R, D, L, BF16, WINDOW
QS, POS, K_AT, V_AT, ROWS, DIM, KEYS, KV_STRIDE, BF16, WINDOW = range(16, 26)
# a RMS or SILU job's fields (`cpu_rows` over ranges of rows): x (RMS: the rows; SILU: the gate) and u
# (SILU's up), rows X_STRIDE / U_STRIDE elements apart (int16 bf16 bits where ROW_BF16, else fp32), out
# [M, COLS] contiguous (fp32 for RMS, x's dtype for SILU), with M (JOBS), COLS, and RMS's eps (float64 bits)
X_AT, U_AT, Y_AT, COLS, X_STRIDE, U_STRIDE, ROW_BF16, EPS = range(16, 24)
SPIN = 26  # the team's polls before a worker sleeps (`SPINS`, written once by the team's owner)
WORKERS = 32  # worker w's ticket at WORKERS + LINE * w, its done word one line further
LINE = 16  # int64s between two workers' tickets (two 64-byte lines)
MAX_WORKERS = 255
SIZE = WORKERS + LINE * MAX_WORKERS
LOOP, TREE, PROBE, ATTEND, RMS, SILU = range(6)  # job kinds: `cpu_loop.loop`, `cpu_loop.tree_loop`, a test's
# marks, `cpu_attention.attend`, `cpu_rows.rms_rows`, `cpu_rows.silu_mul`
STOP = -1  # a ticket that ends `serve`
# a waiting worker polls its ticket SPINS times (a `pause` between polls, ~20-40 us: consecutive slices of
# one product's neighbours), then sleeps in the kernel on the ticket's futex until the dispatcher wakes it:
# no worker takes a core from torch's OpenMP team while torch runs (polling with sched_yield did, 3-10x
# slower torch ops on a 16-core host). A sleeping worker re-checks its ticket every WAIT_NS anyway.
SPINS = 1000
WAIT_NS = 50_000_000
SYS_FUTEX, FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 202, 128, 129  # x86-64 Linux
SLEEPING = 1  # a worker's word, one after its ticket: 1 while it sleeps (or is about to) on the futex

_SYSCALL = "detaudit_syscall"
_syscall = types.ExternalFunction(_SYSCALL, types.int64(*([types.int64] * 7)))


def _bind() -> None:
    """libc's syscall under the name the compiled code calls, before anything compiles (glibc's x86-64
    syscall() passes its integer arguments in registers: called with six, none of them floating)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    llvm.add_symbol(_SYSCALL, ctypes.cast(libc.syscall, ctypes.c_void_p).value)


_bind()


@intrinsic
def _pause(typingctx):
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause")
        builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), codegen


def _atomic_load(order: str):
    """An intrinsic: the int64 at an address, loaded atomically with memory order `order`."""

    @intrinsic
    def load(typingctx, addr):
        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
            return builder.load_atomic(ptr, order, 8)

        return types.int64(types.int64), codegen

    return load


def _atomic_store(order: str):
    """An intrinsic: an int64 stored at an address atomically with memory order `order`."""

    @intrinsic
    def store(typingctx, addr, value):
        def codegen(context, builder, signature, args):
            ptr = builder.inttoptr(args[0], ir.IntType(64).as_pointer())
            builder.store_atomic(args[1], ptr, order, 8)
            return context.get_dummy_value()

        return types.void(types.int64, types.int64), codegen

    return store


_load_seq, _store_seq = _atomic_load("seq_cst"), _atomic_store("seq_cst")
_load_acquire, _store_release = _atomic_load("acquire"), _atomic_store("release")


def _pointer(of):
    @intrinsic
    def cast(typingctx, addr):
        def codegen(context, builder, signature, args):
            return builder.inttoptr(args[0], context.get_value_type(signature.return_type))

        return types.CPointer(of)(types.int64), codegen

    return cast


_i64_at = _pointer(types.int64)
_i16_at = _pointer(types.int16)
_f32_at = _pointer(types.float32)
_f64_at = _pointer(types.float64)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _slice(ctl, slot, threads):  # pragma: no cover (compiled)
    """Slot `slot` of `threads` contiguous slices of the job's table: its calls, made as `cpu_loop` makes
    them (a PROBE job marks each of its jobs with slot + 1 instead)."""
    jobs = ctl[JOBS]
    lo = jobs * slot // threads
    hi = jobs * (slot + 1) // threads
    if lo >= hi:
        return
    kind = ctl[KIND]
    if kind == ATTEND:
        _attend(ctl, lo, hi)
        return
    if kind == RMS or kind == SILU:
        _rows(ctl, kind == RMS, lo, hi)
        return
    if kind == PROBE:
        marks = numba.carray(_i64_at(ctl[OUT]), (jobs,))
        for j in range(lo, hi):
            marks[j] = slot + 1
        return
    leaves = ctl[LEAVES] if kind == TREE else 1
    table = numba.carray(_i64_at(ctl[TABLE]), (jobs * leaves, 3))
    m, n, k = ctl[SHAPE], ctl[SHAPE + 1], ctl[SHAPE + 2]
    lda, ldb, ldc = ctl[SHAPE + 3], ctl[SHAPE + 4], ctl[SHAPE + 5]
    release = ctl[RELEASE] != 0
    kernel, release_at = ctl[KERNEL_AT], ctl[RELEASE_AT]
    if kind == TREE:
        out = numba.carray(_f32_at(ctl[OUT]), (ctl[OUT_SIZE],))
        rows = table[lo * leaves : hi * leaves]
        cpu_loop.tree_loop(kernel, release_at, m, n, k, lda, ldb, ldc, rows, leaves, out, release)
    else:
        cpu_loop.loop(kernel, release_at, m, n, k, lda, ldb, ldc, table[lo:hi], release)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _attend(ctl, lo, hi):  # pragma: no cover (compiled)
    """`cpu_attention.attend` over KV heads lo..hi of an ATTEND job (`fixed._attention_compiled`'s part)."""
    g, rows, d, length, stride = ctl[JOBS], ctl[ROWS], ctl[DIM], ctl[KEYS], ctl[KV_STRIDE]
    qs = numba.carray(_f32_at(ctl[QS]), (g, rows, d))
    pos = numba.carray(_i64_at(ctl[POS]), (g, rows))
    out = numba.carray(_f32_at(ctl[OUT]), (g, rows, d))
    bf16, window = ctl[BF16] != 0, ctl[WINDOW]
    if bf16:
        k = numba.carray(_i16_at(ctl[K_AT]), (g, stride // d, d))[:, :length]
        v = numba.carray(_i16_at(ctl[V_AT]), (g, stride // d, d))[:, :length]
        cpu_attention.attend(qs[lo:hi], pos[lo:hi], k[lo:hi], v[lo:hi], True, window, out[lo:hi])
    else:
        kf = numba.carray(_f32_at(ctl[K_AT]), (g, stride // d, d))[:, :length]
        vf = numba.carray(_f32_at(ctl[V_AT]), (g, stride // d, d))[:, :length]
        cpu_attention.attend(qs[lo:hi], pos[lo:hi], kf[lo:hi], vf[lo:hi], False, window, out[lo:hi])


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _rows(ctl, rms, lo, hi):  # pragma: no cover (compiled)
    """Rows lo..hi of a RMS or SILU job (`cpu_rows`: a row's bits are the row's alone)."""
    m, n, xs, us = ctl[JOBS], ctl[COLS], ctl[X_STRIDE], ctl[U_STRIDE]
    if rms:
        eps = numba.carray(_f64_at(ctl.ctypes.data + EPS * 8), (1,))[0]
        out = numba.carray(_f32_at(ctl[Y_AT]), (m, n))
        if ctl[ROW_BF16] != 0:
            x = numba.carray(_i16_at(ctl[X_AT]), (m, xs))[:, :n]
            cpu_rows.rms_rows(x[lo:hi], True, eps, out[lo:hi])
        else:
            xf = numba.carray(_f32_at(ctl[X_AT]), (m, xs))[:, :n]
            cpu_rows.rms_rows(xf[lo:hi], False, eps, out[lo:hi])
    elif ctl[ROW_BF16] != 0:
        g = numba.carray(_i16_at(ctl[X_AT]), (m, xs))[:, :n]
        u = numba.carray(_i16_at(ctl[U_AT]), (m, us))[:, :n]
        y = numba.carray(_i16_at(ctl[Y_AT]), (m, n))
        cpu_rows.silu_mul(g[lo:hi], u[lo:hi], True, y[lo:hi])
    else:
        gf = numba.carray(_f32_at(ctl[X_AT]), (m, xs))[:, :n]
        uf = numba.carray(_f32_at(ctl[U_AT]), (m, us))[:, :n]
        yf = numba.carray(_f32_at(ctl[Y_AT]), (m, n))
        cpu_rows.silu_mul(gf[lo:hi], uf[lo:hi], False, yf[lo:hi])


@numba.njit(nogil=True, cache=True, error_model="numpy")
def serve(ctl, w):  # pragma: no cover (compiled)
    """Worker w: wait for its ticket to change, make its slice of the job, say so in its done word; until
    the ticket is STOP. Waiting: ctl[SPIN] polls, then its SLEEPING word set and the ticket read again (both
    seq_cst, as the dispatcher's ticket store and SLEEPING load: one of the two sees the other), then the
    futex (the kernel sleeps only if the ticket's low word is still the one seen)."""
    base = ctl.ctypes.data
    ticket = base + (WORKERS + LINE * w) * 8
    sleeping = ticket + SLEEPING * 8
    done = ticket + LINE // 2 * 8
    timeout = np.zeros(2, dtype=np.int64)  # struct timespec {0 s, WAIT_NS ns}
    timeout[1] = WAIT_NS
    seen = 0  # a ticket starts at 0 and jobs count from 1: a job raised before this load is still seen
    while True:
        polls = 0
        now = _load_acquire(ticket)
        while now == seen:
            polls += 1
            if polls <= ctl[SPIN]:
                _pause()
            else:
                _store_seq(sleeping, 1)
                now = _load_seq(ticket)
                if now == seen:
                    _syscall(SYS_FUTEX, ticket, FUTEX_WAIT_PRIVATE, seen & 0xFFFFFFFF, timeout.ctypes.data, 0, 0)
                _store_seq(sleeping, 0)
            now = _load_acquire(ticket)
        if now == STOP:
            return
        seen = now
        _slice(ctl, w + 1, ctl[THREADS])
        _store_release(done, seen)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def dispatch(ctl, threads, job):  # pragma: no cover (compiled)
    """The job whose fields are in ctl, number `job`, on `threads` threads: this one (slice 0) and workers
    0 .. threads - 2 (each woken where it sleeps), then wait for them."""
    base = ctl.ctypes.data
    ctl[THREADS] = threads
    for w in range(threads - 1):
        ticket = base + (WORKERS + LINE * w) * 8
        _store_seq(ticket, job)
        if _load_seq(ticket + SLEEPING * 8) != 0:
            _syscall(SYS_FUTEX, ticket, FUTEX_WAKE_PRIVATE, 1, 0, 0, 0)
    _slice(ctl, 0, threads)
    for w in range(threads - 1):
        done = base + (WORKERS + LINE * w + LINE // 2) * 8
        while _load_acquire(done) != job:
            _pause()


@numba.njit(nogil=True, cache=True, error_model="numpy")
def stop(ctl, workers):  # pragma: no cover (compiled)
    """Every worker's ticket to STOP, each woken (its `serve` returns)."""
    base = ctl.ctypes.data
    for w in range(workers):
        ticket = base + (WORKERS + LINE * w) * 8
        _store_seq(ticket, STOP)
        _syscall(SYS_FUTEX, ticket, FUTEX_WAKE_PRIVATE, 1, 0, 0, 0)
