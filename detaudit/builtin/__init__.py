"""The built-in engine: decoders whose every reduction goes through a Backend.

`start(options)` returns an Engine (`detaudit.engines.Engine`): in this process for TP 1 and emulated
TP (`local.LocalEngine`), a pool of worker processes, one per rank, for real TP > 1 (`rank.py`).
This package never imports `detaudit.vllm` or `detaudit.server`.
"""

from __future__ import annotations

import os

from detaudit.config import EngineOptions

TP1_GROUP_ENV = "DETAUDIT_TP1_GROUP"


def start(options: EngineOptions):
    if options.emulated or (options.tp == 1 and not tp1_group()):
        from detaudit.builtin.local import LocalEngine

        return LocalEngine(options)
    from detaudit.builtin import rank
    from detaudit.builtin.dist import listen_socket
    from detaudit.builtin.local import cpu_cores
    from detaudit.workers import WorkerPool

    threads = 1 if options.settings.cuda else max(1, cpu_cores() // options.tp)
    # rank 0's store socket: bound to 127.0.0.1 here, before any worker starts, and inherited by rank 0
    # only (no free-port race, nothing listens on another interface)
    return WorkerPool(
        rank.__name__,
        options,
        options.tp,
        hang_timeout=options.settings.hang_timeout,
        extra={"threads": threads},
        env={"OMP_NUM_THREADS": str(threads)},
        rank0_socket=listen_socket(),
    )


def tp1_group() -> bool:
    """`DETAUDIT_TP1_GROUP=1`: real TP 1 runs as TP > 1 does, one worker process in a process group of
    size 1 (NCCL on GPU, gloo on CPU) whose all-reduce runs (and is captured into the CUDA graph), instead
    of in process without a group. Same bits; used by tests and benchmarks of the real-TP path on one GPU."""
    return os.environ.get(TP1_GROUP_ENV, "") not in ("", "0")
