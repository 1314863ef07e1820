"""An in-process stand-in for a TP process group, for the ordering logic of the fixed-order all-reduce
transports (`backends/allreduce.py:fixed_order_all_reduce`). A fake: C threads, one per rank, each holding a
`ThreadGroup`; a collective hands every rank the tensors the other ranks gave it (all-gather in rank
order, all-to-all row j to rank j) through a shared board and a barrier. No library reduction exists
here (`all_reduce_sum` refuses), so every addition a test sees is the backend's own, in its own order.
The real transport over gloo is run by tests/integration/test_tbik_dist.py."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from detaudit.backends.base import ProcessGroup


class _Board:
    def __init__(self, size: int) -> None:
        self.slots: list[Tensor | None] = [None] * size
        self.barrier = threading.Barrier(size, timeout=60)  # a guard against a hang, never reached when it works


class ThreadGroup(ProcessGroup):
    """Rank `rank` of `size` ranks sharing `board` (a `ProcessGroup` without a peer-memory transport)."""

    def __init__(self, rank: int, size: int, board: _Board) -> None:
        self.rank, self.size, self._board = rank, size, board

    def _exchange(self, t: Tensor) -> list[Tensor]:
        """Every rank's `t`, in rank order (copies: no rank sees another's later writes)."""
        self._board.slots[self.rank] = t.clone()
        self._board.barrier.wait()
        got = [s.clone() for s in self._board.slots]
        self._board.barrier.wait()  # nobody overwrites a slot before every rank has read it
        return got

    def all_gather(self, t: Tensor) -> Tensor:
        return torch.stack(self._exchange(t))

    def all_to_all(self, t: Tensor) -> Tensor:
        return torch.stack([theirs[self.rank] for theirs in self._exchange(t)])

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        raise AssertionError("a fixed-order all-reduce must not use the library's sum")


def run_ranks(size: int, fn) -> list:
    """fn(group) on `size` threads, one `ThreadGroup` each; their results in rank order (an exception
    in any rank is raised here)."""
    board = _Board(size)

    def rank(r: int):
        try:
            return fn(ThreadGroup(r, size, board))
        except BaseException:
            board.barrier.abort()  # the other ranks stop waiting for this one
            raise

    with ThreadPoolExecutor(size) as pool:
        futures = [pool.submit(rank, r) for r in range(size)]
        return [f.result() for f in futures]
