"""Whether this process, or a worker process it drives, is compiling detaudit's CPU kernels now.

A kernel's first use in a process compiles it, or loads numba's on-disk cache, behind a machine-wide lock
(`backends.kernels.numba_cache.one_compiler`): a fresh install's first compile takes a minute or two on
2 cores, and a process that waits for another's compile (another sweep, a TP rank, a test beside it)
waits as long. Neither is a hang, yet the first generate call of an engine makes no token meanwhile. The
hang timers (`workers.WorkerPool`, the Ray executor) read `active()` and give a compile the engine
start's allowance instead of the hang timeout; a real hang (no compile under way) still fails at the
hang timeout.

`begin` / `end` nest (compiling a kernel compiles those it calls); listeners hear the transitions
(True at the outermost begin, False at its end), on the compiling thread: a worker process forwards
them to its controller, which calls `begin` / `end` for its ranks, so a Ray actor driving TP ranks
reports their compiles too. Standard library only; no numba import.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

_lock = threading.Lock()
_depth = 0
_listeners: list[Callable[[bool], None]] = []


def active() -> bool:
    """A compile (or a wait for another process's) is under way in this process or a worker it drives."""
    return _depth > 0


def begin() -> None:
    global _depth
    with _lock:
        _depth += 1
        listeners = list(_listeners) if _depth == 1 else []
    _tell(listeners, True)


def end() -> None:
    global _depth
    with _lock:
        if _depth == 0:
            raise RuntimeError("compiling.end() without a begin()")
        _depth -= 1
        listeners = list(_listeners) if _depth == 0 else []
    _tell(listeners, False)


def _tell(listeners: list[Callable[[bool], None]], on: bool) -> None:
    """A notice is for the hang timers only: one that cannot be delivered (the controller's pipe gone) must
    not fail the compile it announces, nor leave the count unbalanced; the worker meets the closed pipe
    at its next message anyway."""
    for fn in listeners:
        try:
            fn(on)
        except Exception:
            pass


def listen(fn: Callable[[bool], None]) -> None:
    """Call `fn(True)` when a compile starts where none was under way, `fn(False)` when the last ends."""
    with _lock:
        _listeners.append(fn)
