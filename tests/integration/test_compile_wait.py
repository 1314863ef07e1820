"""A TP rank waiting for another process's kernel compile is not hung (`detaudit.compiling`).

The machine-wide compile lock (`numba_cache.one_compiler`) is held by another process here, as a sweep
beside this one (or a test in the other pytest process) holds it while it compiles; the ranks' first
kernel call then waits for it, longer than the hang timeout. Real worker processes, the real lock and
kernels; the other process only holds the lock."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
from helpers import builtin_engine

from detaudit import compiling
from detaudit.config import DecodingParams

HANG = 3.0


def _hold(path: str) -> subprocess.Popen:
    """A process holding the compile lock until its stdin closes."""
    code = (
        "import filelock, sys; lock = filelock.FileLock(sys.argv[1]); lock.acquire(); "
        "print('held', flush=True); sys.stdin.read()"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline() == "held\n"
    return proc


@pytest.mark.slow
def test_ranks_waiting_for_another_process_compile_are_not_hung(tiny_sweep_model):
    from detaudit.backends.kernels import numba_cache

    pool = builtin_engine(tiny_sweep_model, "bio+tbik", 2, hang_timeout=HANG)
    holder = None
    try:
        holder = _hold(numba_cache._compile_lock().lock_file)
        got: dict = {}

        def generate() -> None:
            try:
                got["out"] = pool.generate(
                    [[1, 2, 3], [4, 5]], ["a", "b"], DecodingParams(greedy=True, max_new_tokens=3), 2
                )
            except BaseException as e:  # noqa: BLE001 (reported below)
                got["error"] = e

        worker = threading.Thread(target=generate)
        worker.start()
        deadline = time.monotonic() + 120
        while not compiling.active() and worker.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert compiling.active(), f"no rank said it waits for the compile lock: {got}"
        time.sleep(2 * HANG)  # the ranks wait past the hang timeout
        assert worker.is_alive() and not got, got
        holder.stdin.close()
        holder.wait(10)
        holder = None
        worker.join(120)
        assert "error" not in got, got.get("error")
        assert [len(g.token_ids) for g in got["out"]] == [3, 3]
        assert not compiling.active()
    finally:
        if holder is not None:
            holder.kill()
        pool.close()
