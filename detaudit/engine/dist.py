"""Process groups: the only module that talks to torch.distributed.

Real TP runs one process per rank (gloo on CPU, NCCL on GPU); `TorchGroup` wraps the default process
group with the three collectives the backends need. Emulated TP needs no group: the row-parallel layer
computes every rank's partial in one process and calls `backend.combine`.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor


class TorchGroup:
    """`pg`: a torch ProcessGroup (default: the default group), ranks in `pg`'s order."""

    def __init__(self, rank: int, size: int, pg=None) -> None:
        self.rank = rank
        self.size = size
        self.pg = pg

    def all_gather(self, t: Tensor) -> list[Tensor]:
        t = t.contiguous()
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.pg)
        return out

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.pg)
        return t

    def all_to_all(self, chunks: list[Tensor]) -> list[Tensor]:
        """chunks[j] goes to rank j; returns the chunks received, in source-rank order. All chunks
        must have the same shape (all_to_all_single works on gloo and NCCL)."""
        assert len(chunks) == self.size
        inp = torch.stack([c.contiguous() for c in chunks])
        out = torch.empty_like(inp)
        dist.all_to_all_single(out, inp, group=self.pg)
        return list(out.unbind(0))

    def barrier(self) -> None:
        dist.barrier(group=self.pg)


def vllm_tp_group() -> TorchGroup:
    """Inside a vLLM worker: vLLM's TP group (gloo on CPU, NCCL on GPU) with the same collectives."""
    from vllm.distributed.parallel_state import get_tp_group

    g = get_tp_group()
    return TorchGroup(g.rank_in_group, g.world_size, g.device_group)


def free_port() -> int:
    """A free TCP port on the loopback interface, chosen per engine so sweeps can run side by side."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init(rank: int, size: int, port: int, device: str, timeout_s: float = 300.0) -> TorchGroup:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    backend = "nccl" if device.startswith("cuda") else "gloo"
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(
        backend, rank=rank, world_size=size, timeout=timedelta(seconds=timeout_s), **kwargs
    )
    return TorchGroup(rank, size)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
