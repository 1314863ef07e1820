"""The compiled team's checks (`cpu_team`, through `cpu_calls`), run by test_cpu_team.py in a process of
their own: the calls go to a fake micro-kernel (a numba cfunc that writes a function of its arguments)
through its address, kept apart from any process that runs the real one. No real kernel is needed, so
this runs on any CPU with numba. Prints "ok" when every check holds."""

from __future__ import annotations

import ctypes
import os
import sys
import time

import numba
import numpy as np
import torch
from numba import types

from detaudit.backends.kernels import cpu_calls, cpu_team, fixed

SIG = types.void(*([types.int64] * 6), types.uint8, types.int64, types.int64, types.int64, types.uint8)


@numba.cfunc(SIG, nopython=True)
def fake(m, n, k, lda, ldb, ldc, add_c, a, b, c, vnni):  # C[m, n] (rows ldc apart) from A's and B's addresses
    out = numba.carray(cpu_team._f32_at(c), (m * ldc,))
    for r in range(m):
        for j in range(n):
            out[r * ldc + j] = np.float32((a % 1000003) * 0.5 + (b % 1009) + r * 7 + j + k)


@numba.cfunc(types.void(types.uint8), nopython=True)
def release(v):
    pass


PROTO = ctypes.CFUNCTYPE(
    None, *([ctypes.c_int64] * 6), ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_bool
)
RELEASE = ctypes.CFUNCTYPE(None, ctypes.c_bool)(release.address)
KERNEL = cpu_calls.Kernel(PROTO(fake.address), fake.address, RELEASE, release.address, True, 1.0)
M, N, K = 4, 16, 32


def table_of(calls: int, out: np.ndarray, c_step: int) -> np.ndarray:
    table = np.empty((calls, 3), np.int64)
    table[:, 0] = np.arange(calls) * 64 + 1000
    table[:, 1] = np.arange(calls) * 13 + 7
    table[:, 2] = out.ctypes.data + np.arange(calls) * c_step
    return table


def loop_product(calls: int, threads: int, team: str) -> np.ndarray:
    os.environ[cpu_calls.TEAM_ENV] = team
    torch.set_num_threads(threads)
    out = np.zeros(calls * M * N, np.float32)
    cpu_calls.run(KERNEL, (M, N, K, K, N, N), table_of(calls, out, M * N * 4), 1e12)
    return out


def tree_product(jobs: int, leaves: int, threads: int, team: str) -> np.ndarray:
    os.environ[cpu_calls.TEAM_ENV] = team
    torch.set_num_threads(threads)
    out = np.zeros(jobs * M * N, np.float32)
    table = table_of(jobs * leaves, out, 0)
    table[:, 2] = np.repeat(out.ctypes.data + np.arange(jobs) * M * N * 4, leaves) - out.ctypes.data
    assert cpu_calls.run_tree(KERNEL, (M, N, K, K, N, N), table, leaves, out, 1e12)
    return out


def half_panels(calls: int) -> np.ndarray:
    """Byte offsets of `calls` [M, N] products that fill an output of rows 2N wide, two calls a block of
    rows (a decode product's column parts: rows ldc = 2N apart)."""
    i = np.arange(calls)
    return ((i // 2) * M * 2 * N + (i % 2) * N) * 4


def bf16_products(calls: int, threads: int, team: str) -> tuple[np.ndarray, np.ndarray]:
    """The same calls in column parts, fp32 and rounded to bf16 by the loop: (fp32 [calls * M * N],
    the loop's int16 bf16 bits)."""
    os.environ[cpu_calls.TEAM_ENV] = team
    torch.set_num_threads(threads)
    out = np.zeros(calls * M * N, np.float32)
    out16 = np.zeros(calls * M * N, np.int16)
    table = table_of(calls, out, 0)
    table[:, 2] = out.ctypes.data + half_panels(calls)
    cpu_calls.run(KERNEL, (M, N, K, K, N, 2 * N), table, 1e12)
    table[:, 2] = half_panels(calls)  # relative to out16
    assert cpu_calls.run(KERNEL, (M, N, K, K, N, 2 * N), table, 1e12, out16=out16)
    return out, out16


def bf16_tree(jobs: int, leaves: int, threads: int, team: str) -> np.ndarray:
    """`tree_product`'s sums rounded to bf16 by the tree loop: int16 bits."""
    os.environ[cpu_calls.TEAM_ENV] = team
    torch.set_num_threads(threads)
    out16 = np.zeros(jobs * M * N, np.int16)
    table = table_of(jobs * leaves, out16, 0)
    table[:, 2] = np.repeat(np.arange(jobs) * M * N * 4, leaves)
    assert cpu_calls.run_tree(KERNEL, (M, N, K, K, N, N), table, leaves, None, 1e12, out16)
    return out16


def torch_bf16(out: np.ndarray) -> np.ndarray:
    return torch.from_numpy(out).to(torch.bfloat16).view(torch.int16).numpy()


def asleep_within(team, workers: int, seconds: float) -> None:
    """Wait until the team's first `workers` workers, those started so far, sleep on the bell (their
    SLEEPING words set)."""
    started = min(workers, len(team.workers))
    words = [cpu_team.WORKERS + cpu_team.LINE * w + cpu_team.SLEEPING for w in range(started)]
    end = time.monotonic() + seconds
    while not all(team.ctl[i] == 1 for i in words):
        assert time.monotonic() < end, "the team's workers did not go to sleep"
        time.sleep(0.001)


def main() -> None:
    os.environ[cpu_calls.TEAM_ENV] = "auto"
    team = cpu_calls.team()
    assert team is not None
    # every call made once, where it was made on one thread: tables of 37 calls on 2-8 threads
    one = loop_product(37, 1, "auto")
    assert one.min() > 0
    before = team.job
    for threads in (2, 3, 4, 8):
        assert np.array_equal(loop_product(37, threads, "auto"), one), threads
        assert np.array_equal(loop_product(37, threads, "off"), one), threads
    assert team.job == before + 4, (team.job, before)  # the team made the four split tables; "off" none
    # the tree loop's jobs (each `leaves` calls summed) likewise
    one = tree_product(9, 4, 1, "auto")
    before = team.job
    for threads in (2, 3, 5):
        assert np.array_equal(tree_product(9, 4, threads, "auto"), one), threads
        assert np.array_equal(tree_product(9, 4, threads, "off"), one), threads
    assert team.job == before + 3, (team.job, before)
    # products rounded to bf16 as they are made (column parts, rows 2N apart; tree sums): torch's cast of
    # the fp32 products, on one thread, the Python pool and the team alike
    fp32, _ = bf16_products(38, 1, "off")
    assert len(np.unique(torch_bf16(fp32))) < len(np.unique(fp32))  # the rounding does round here
    tree_fp32 = tree_product(9, 4, 1, "off")
    before = team.job
    for threads in (1, 3, 8):
        for how in ("off", "auto"):
            again, bits = bf16_products(38, threads, how)
            assert np.array_equal(again, fp32) and np.array_equal(bits, torch_bf16(fp32)), (threads, how)
            assert np.array_equal(bf16_tree(9, 4, threads, how), torch_bf16(tree_fp32)), (threads, how)
    assert team.job == before + 6, (team.job, before)  # 3 and 8 threads: the loop in fp32 and bf16, the tree
    # bio's compiled attention over KV heads on the team: the bits of the Python pool's and of one thread,
    # bf16 and fp32 caches read through a slice of a longer cache, with and without a sliding window
    before = team.job
    for dtype in (torch.bfloat16, torch.float32):
        for window in (None, 40):
            g = torch.Generator().manual_seed(0)
            cache = [torch.randn(2, 4, 300, 32, generator=g).to(dtype) for _ in range(2)]
            q = torch.randn(2, 8, 64, 32, generator=g).to(dtype)
            q_pos = torch.arange(192, 256).expand(2, 64)
            outs = []
            for threads, how in ((1, "off"), (3, "off"), (3, "auto"), (4, "auto")):
                os.environ[cpu_calls.TEAM_ENV] = how
                torch.set_num_threads(threads)
                k, v = (c[:, :, :256] for c in cache)
                outs.append(fixed.attention(q, k, v, q_pos, 32**-0.5, 64, window))
            assert all(torch.equal(o, outs[0]) for o in outs[1:]), (dtype, window)
    assert team.job == before + 8, (team.job, before)
    # a job's slices are `cpu_calls.slices`' cuts, slot 0 on this thread
    for jobs, threads in ((10, 3), (7, 7), (3, 5), (100, 16)):
        marks = np.zeros(jobs, np.int64)
        assert team.run(cpu_team.PROBE, jobs, threads, {cpu_team.OUT: marks.ctypes.data})
        cuts = [i * jobs // threads for i in range(threads + 1)]
        want = np.concatenate([np.full(cuts[i + 1] - cuts[i], i + 1) for i in range(threads)])
        assert np.array_equal(marks, want), (jobs, threads, marks)
    # workers asleep are woken by the job's one ring of the bell, those 32 apart sharing a bit included: with
    # the sleepers' own re-check put off to 60 s, a wake that was lost would hold the job that long
    team.ctl[cpu_team.WAIT] = 60_000_000_000
    for threads in (2, 5, 40):
        for _ in range(3):
            asleep_within(team, threads - 1, 10.0)
            marks = np.zeros(threads, np.int64)
            start = time.monotonic()
            assert team.run(cpu_team.PROBE, threads, threads, {cpu_team.OUT: marks.ctypes.data})
            assert time.monotonic() - start < 20.0, (threads, "a sleeping worker was not woken")
            assert np.array_equal(marks, np.arange(1, threads + 1)), (threads, marks)
    team.ctl[cpu_team.WAIT] = cpu_team.WAIT_NS
    # a busy team refuses (the caller takes the Python pool); stopped, it starts again
    with team.lock:
        assert not team.run(cpu_team.PROBE, 4, 2, {cpu_team.OUT: np.zeros(4, np.int64).ctypes.data})
    team.stop()
    assert not team.workers
    assert np.array_equal(loop_product(37, 3, "auto"), one_loop)
    # a forked child starts a team of its own
    pid = os.fork()
    if pid == 0:
        ok = np.array_equal(loop_product(37, 3, "auto"), one_loop) and cpu_calls.team() is not team
        os._exit(0 if ok else 1)
    assert os.waitpid(pid, 0)[1] == 0
    print("ok")


if __name__ == "__main__":
    if cpu_calls.compiled("cpu_loop") is None:
        sys.exit("numba not installed")
    one_loop = loop_product(37, 1, "off")
    main()
