"""The team that runs detaudit's compiled CPU work on several threads: a product's micro-kernel calls,
the compiled attention's KV heads, the row kernels' rows (imported only where numba is installed;
`cpu_calls` owns it).

A Python thread pool hands a slice over with a future, a sleeping thread woken for it and the GIL taken
around both: on a 16-core AMX host a decode product's ~70 us of calls took 0.34 ms that way
(reports/cpu-bf16). Here each worker is a thread that stays inside compiled code (`serve`, the GIL
released) and polls a word of its own for a few microseconds, then sleeps (a futex) until the caller
wakes it; the caller (`dispatch`, also without the GIL) writes the job into a shared control
block, raises the tickets of the workers the job needs, makes slice 0 itself and waits for their done
words. A ticket is raised with a release store after the job's fields are written and read with an
acquire load before they are, so a worker never reads a job being written; a worker the job does not
need sees nothing. Sleeping workers wait on one shared word (the bell), each on a bit of its own
(`FUTEX_WAIT_BITSET`), so the dispatcher wakes all those the job needs with one system call: woken one
at a time, the last of a 16-thread product's workers started only after 14 calls to the kernel, each
of which, where the worker's core is idle (a VM's halted vCPU), costs an interrupt. The slices are
`cpu_calls.slices`' contiguous ones and each is `cpu_loop`'s `loop` or `tree_loop` (or
`cpu_attention.attend` over KV heads, `cpu_rows`' kernels over rows), so the work is done exactly as on
one thread, only on another: the same bits. Every kernel here and in the modules it calls is compiled
with numba's numpy error model (a division by zero gives IEEE inf / NaN, as torch's ops do, instead of
raising): an exception would end a worker with its done word unwritten and the dispatcher waiting for
it.

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
# an ADD_RMS job's (`cpu_rows.add_rms` over ranges of rows): those of RMS, U_AT the delta (0: none), Y_AT the
# normed rows and S_AT the residual sum ([M, COLS] contiguous, x's dtype), W_AT the weight [COLS]
S_AT, W_AT = 24, 25
# a ROPE job's fields (`cpu_rows.rope_rows` over a step's rows (b, t)): X_AT the address of its argument
# block (`cpu_rows.rope_block`), ROW_BF16. A PAIRWISE job's (`cpu_loop.pairwise` over chunks of
# `cpu_loop.PAIRWISE_CHUNK` elements): X_AT the leaves [X_STRIDE, COLS] fp32, Y_AT out [X_STRIDE / 2, COLS]
# fp32, U_AT out16 [COLS] (int16 bf16 bits; 0: none)
# a LOOP or TREE job's bf16 output (`cpu_loop.loop`'s out16): its address and elements (0: none, the
# products go to their C addresses or OUT in fp32); written with every such job, these fields being others'
OUT16, OUT16_SIZE = 16, 17
# an ATTEND job's queries and output where the model keeps them: the address of a `cpu_rows.heads_block`
# (a worker scales its KV heads' queries into QS first and puts its rows of OUT there after; 0: neither)
HEADS = 29
SPIN = 26  # the team's polls before a worker sleeps (`SPINS`, written once by the team's owner)
BELL = 27  # the sleepers' futex word: the dispatcher adds one before it wakes them
WAIT = 28  # ns a sleeping worker waits before it checks its ticket anyway (`WAIT_NS`; a test raises it)
WORKERS = 32  # worker w's ticket at WORKERS + LINE * w, its done word one line further
LINE = 16  # int64s between two workers' tickets (two 64-byte lines)
MAX_WORKERS = 255
SIZE = WORKERS + LINE * MAX_WORKERS
LOOP, TREE, PROBE, ATTEND, RMS, SILU, ROPE, PAIRWISE, ADD_RMS = range(9)  # job kinds: `cpu_loop.loop`,
# `tree_loop`, a test's marks, `cpu_attention.attend`, `cpu_rows.rms_rows`, `silu_mul`, `rope_rows`,
# `cpu_loop.pairwise`, `cpu_rows.add_rms`
STOP = -1  # a ticket that ends `serve`
# a waiting worker polls its ticket SPINS times (a `pause` between polls, ~20-40 us: consecutive slices of
# one product's neighbours), then sleeps in the kernel on the bell's futex until the dispatcher wakes it:
# no worker takes a core from torch's OpenMP team while torch runs (polling with sched_yield did, 3-10x
# slower torch ops on a 16-core host). A sleeping worker re-checks its ticket every WAIT_NS anyway.
SPINS = 1000
WAIT_NS = 50_000_000
SYS_FUTEX, SYS_CLOCK_GETTIME, CLOCK_MONOTONIC = 202, 228, 1  # x86-64 Linux
FUTEX_WAIT_BITSET_PRIVATE, FUTEX_WAKE_BITSET_PRIVATE = 9 | 128, 10 | 128  # (a bitset wait's timeout is absolute)
BITS = 32  # a futex bitset's width: worker w sleeps on bit w % BITS (workers 32 apart share one: a spare wake)
ALL_BITS = 0xFFFFFFFF
SLEEPING = 1  # a worker's word, one after its ticket: 1 while it sleeps (or is about to) on the bell

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
    if kind == ROPE:
        cpu_rows.rope_rows(numba.carray(_i64_at(ctl[X_AT]), (cpu_rows.ROPE_BLOCK,)), ctl[ROW_BF16] != 0, lo, hi)
        return
    if kind == PAIRWISE:
        _pairwise(ctl, lo, hi)
        return
    if kind == ADD_RMS:
        _add_rms(ctl, lo, hi)
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
    out16 = numba.carray(_i16_at(ctl[OUT16]), (ctl[OUT16_SIZE],))
    if kind == TREE:
        out = numba.carray(_f32_at(ctl[OUT]), (ctl[OUT_SIZE],))
        rows = table[lo * leaves : hi * leaves]
        cpu_loop.tree_loop(kernel, release_at, m, n, k, lda, ldb, ldc, rows, leaves, out, out16, release)
    else:
        cpu_loop.loop(kernel, release_at, m, n, k, lda, ldb, ldc, table[lo:hi], out16, release)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _attend(ctl, lo, hi):  # pragma: no cover (compiled)
    """`cpu_attention.attend` over KV heads lo..hi of an ATTEND job (`fixed._attention_compiled`'s part)."""
    g, rows, d, length, stride = ctl[JOBS], ctl[ROWS], ctl[DIM], ctl[KEYS], ctl[KV_STRIDE]
    qs = numba.carray(_f32_at(ctl[QS]), (g, rows, d))
    pos = numba.carray(_i64_at(ctl[POS]), (g, rows))
    out = numba.carray(_f32_at(ctl[OUT]), (g, rows, d))
    bf16, window = ctl[BF16] != 0, ctl[WINDOW]
    heads = numba.carray(_i64_at(ctl[HEADS]), (cpu_rows.HEADS_BLOCK if ctl[HEADS] != 0 else 0,))
    if heads.size:
        cpu_rows.scaled_heads(heads, qs, lo, hi)
    if bf16:
        k = numba.carray(_i16_at(ctl[K_AT]), (g, stride // d, d))[:, :length]
        v = numba.carray(_i16_at(ctl[V_AT]), (g, stride // d, d))[:, :length]
        cpu_attention.attend(qs[lo:hi], pos[lo:hi], k[lo:hi], v[lo:hi], True, window, out[lo:hi])
    else:
        kf = numba.carray(_f32_at(ctl[K_AT]), (g, stride // d, d))[:, :length]
        vf = numba.carray(_f32_at(ctl[V_AT]), (g, stride // d, d))[:, :length]
        cpu_attention.attend(qs[lo:hi], pos[lo:hi], kf[lo:hi], vf[lo:hi], False, window, out[lo:hi])
    if heads.size:
        cpu_rows.heads_out(heads, out, lo, hi)


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
def _add_rms(ctl, lo, hi):  # pragma: no cover (compiled)
    """Rows lo..hi of an ADD_RMS job (`cpu_rows.add_rms`: a row's bits are the row's alone)."""
    m, n, xs, us = ctl[JOBS], ctl[COLS], ctl[X_STRIDE], ctl[U_STRIDE]
    eps = numba.carray(_f64_at(ctl.ctypes.data + EPS * 8), (1,))[0]
    add = ctl[U_AT] != 0
    d_at, ds = (ctl[U_AT], us) if add else (ctl[X_AT], xs)  # (no delta: x stands in, unread)
    if ctl[ROW_BF16] != 0:
        x = numba.carray(_i16_at(ctl[X_AT]), (m, xs))[:, :n]
        d = numba.carray(_i16_at(d_at), (m, ds))[:, :n]
        w = numba.carray(_i16_at(ctl[W_AT]), (n,))
        s, y = numba.carray(_i16_at(ctl[S_AT]), (m, n)), numba.carray(_i16_at(ctl[Y_AT]), (m, n))
        cpu_rows.add_rms(x[lo:hi], d[lo:hi], add, w, True, eps, s[lo:hi], y[lo:hi])
    else:
        xf = numba.carray(_f32_at(ctl[X_AT]), (m, xs))[:, :n]
        df = numba.carray(_f32_at(d_at), (m, ds))[:, :n]
        wf = numba.carray(_f32_at(ctl[W_AT]), (n,))
        sf, yf = numba.carray(_f32_at(ctl[S_AT]), (m, n)), numba.carray(_f32_at(ctl[Y_AT]), (m, n))
        cpu_rows.add_rms(xf[lo:hi], df[lo:hi], add, wf, False, eps, sf[lo:hi], yf[lo:hi])


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _pairwise(ctl, lo, hi):  # pragma: no cover (compiled)
    """Chunks lo..hi of a PAIRWISE job (`cpu_loop.pairwise`: an element's adds are its own)."""
    g, size, chunk = ctl[X_STRIDE], ctl[COLS], cpu_loop.PAIRWISE_CHUNK
    leaves = numba.carray(_f32_at(ctl[X_AT]), (g, size))
    out = numba.carray(_f32_at(ctl[Y_AT]), (g // 2, size))
    out16 = numba.carray(_i16_at(ctl[U_AT]), (size if ctl[U_AT] != 0 else 0,))
    cpu_loop.pairwise(leaves, out, out16, lo * chunk, min(hi * chunk, size))


@numba.njit(nogil=True, cache=True, error_model="numpy")
def serve(ctl, w):  # pragma: no cover (compiled)
    """Worker w: wait for its ticket to change, make its slice of the job, say so in its done word; until
    the ticket is STOP. Waiting: ctl[SPIN] polls, then its SLEEPING word set, the bell read and the ticket
    read again (all seq_cst, as the dispatcher's ticket store, SLEEPING load and bell store: either this
    sees the new ticket, or the dispatcher sees SLEEPING and rings the bell after this read it), then the
    futex on the bell (the kernel sleeps only if the bell's low word is still the one read)."""
    base = ctl.ctypes.data
    ticket = base + (WORKERS + LINE * w) * 8
    sleeping = ticket + SLEEPING * 8
    done = ticket + LINE // 2 * 8
    bell = base + BELL * 8
    bit = 1 << (w % BITS)
    deadline = np.zeros(2, dtype=np.int64)  # struct timespec, CLOCK_MONOTONIC
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
                rung = _load_seq(bell)
                now = _load_seq(ticket)
                if now == seen:
                    _syscall(SYS_CLOCK_GETTIME, CLOCK_MONOTONIC, deadline.ctypes.data, 0, 0, 0, 0)
                    ns = deadline[1] + ctl[WAIT]
                    deadline[0] += ns // 1_000_000_000
                    deadline[1] = ns % 1_000_000_000
                    at = deadline.ctypes.data
                    _syscall(SYS_FUTEX, bell, FUTEX_WAIT_BITSET_PRIVATE, rung & 0xFFFFFFFF, at, 0, bit)
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
    0 .. threads - 2 (those asleep woken by one ring of the bell), then wait for them."""
    base = ctl.ctypes.data
    ctl[THREADS] = threads
    asleep = 0
    for w in range(threads - 1):
        ticket = base + (WORKERS + LINE * w) * 8
        _store_seq(ticket, job)
        if _load_seq(ticket + SLEEPING * 8) != 0:
            asleep |= 1 << (w % BITS)
    if asleep != 0:
        _ring(ctl, asleep)
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
        _store_seq(base + (WORKERS + LINE * w) * 8, STOP)
    _ring(ctl, ALL_BITS)


@numba.njit(nogil=True, cache=True, error_model="numpy")
def _ring(ctl, bits):  # pragma: no cover (compiled)
    """Wake the workers sleeping on `bits` of the bell: the bell moved first (only the team's owner writes
    it), so a worker about to sleep on the value it read before does not."""
    bell = ctl.ctypes.data + BELL * 8
    _store_seq(bell, _load_seq(bell) + 1)
    _syscall(SYS_FUTEX, bell, FUTEX_WAKE_BITSET_PRIVATE, 0x7FFFFFFF, 0, 0, bits)


numba_cache.one_compiler(globals())  # after every kernel above: one process compiles, the others load
