"""Process groups: with its peer-memory transport (`backends/peer.py`), the only module that talks to
torch.distributed.

Real TP runs one process per rank (gloo on CPU, NCCL on GPU); `TorchGroup` wraps the default process
group with the collectives the backends need. Emulated TP needs no group: the row-parallel layer
computes every rank's partial in one process and calls `backend.combine`.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from detaudit.backends.base import ProcessGroup
from detaudit.errors import DetauditError


class TorchGroup(ProcessGroup):
    """`pg`: a torch ProcessGroup (default: the default group), ranks in `pg`'s order."""

    def __init__(self, rank: int, size: int, pg=None, store=None) -> None:
        self.rank = rank
        self.size = size
        self.pg = pg
        self.store = store  # the default group's TCPStore (served by rank 0), where `init` made it
        self._peer = None  # the peer-memory transport, made at the first peer all-reduce

    def all_gather(self, t: Tensor) -> Tensor:
        """Every rank's `t`, stacked in rank order: [C, *t.shape]. On NCCL gathered straight into that
        tensor (one collective, no per-rank copies); gloo has no gather-into-tensor, so its list form,
        stacked. A gather copies: the same values either way."""
        t = t.contiguous()
        out = torch.empty((self.size, *t.shape), dtype=t.dtype, device=t.device)
        if t.is_cuda and dist.get_backend(self.pg) == "nccl":
            dist.all_gather_into_tensor(out, t, group=self.pg)
        else:
            dist.all_gather(list(out.unbind(0)), t, group=self.pg)
        return out

    def all_reduce_sum(self, t: Tensor) -> Tensor:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.pg)
        return t

    def all_to_all(self, t: Tensor) -> Tensor:
        """t[C, ...]: row j goes to rank j; returns the rows received, [C, ...] in source-rank order."""
        assert t.shape[0] == self.size
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.pg)
        return out

    def peer_all_reduce(self, p: Tensor, dtype: torch.dtype, order: str, required: bool = False) -> Tensor | None:
        """The fixed-order all-reduce of fp32 `p` over peer memory (`peer.PeerTransport`), or None where it
        does not run: CPU / gloo groups, sizes other than 2, 4 and 8 (the kernels' unrolling), no
        symmetric memory (`required`: that is an error naming the reason), a new size while a CUDA graph
        is being captured."""
        if self._transport(p.device) is None:
            return None
        out = self._peer.all_reduce(p, dtype, order)
        if out is None and required and self._peer.reason:
            raise DetauditError(f"the peer all-reduce does not run here: {self._peer.reason}")
        return out

    def peer_row_all_reduce(
        self, m: int, n: int, dtype: torch.dtype, order: str, rows_partial, device: torch.device, routed=None
    ) -> Tensor | None:
        """A row-parallel layer's matmul and all-reduce over peer memory with the transfer in the matmul
        (`routed()`, where the backend has one: `peer.PeerTransport.routed_all_reduce`) or behind it
        (`peer.PeerTransport.row_all_reduce`), or None: then the backend's `all_reduce`. The sizes decide
        on every rank alike; a rank without a routed matmul pushes into the slices the others route to."""
        transport = self._transport(device)
        if transport is None:
            return None
        if routed is not None:
            out = transport.routed_all_reduce(m, n, dtype, order, routed, device)
            if out is not None:
                return out
        return transport.row_all_reduce(m, n, dtype, order, rows_partial, device)

    def _transport(self, device: torch.device):
        if device.type != "cuda" or self.size not in (2, 4, 8) or dist.get_backend(self.pg) != "nccl":
            return None
        if self._peer is None:
            from detaudit.backends.peer import PeerTransport

            self._peer = PeerTransport(self.rank, self.size, self.pg)
        return self._peer

    def barrier(self) -> None:
        dist.barrier(group=self.pg)


LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A free TCP port on the loopback interface. Racy (another process may take it before rank 0
    binds it): only for callers that cannot hand rank 0 a socket (`mp.spawn` benchmarks and tests);
    the TP workers get a listening socket from `listen_socket` instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def listen_socket(port: int = 0) -> socket.socket:
    """A TCP socket listening on 127.0.0.1 (`port` 0: a free one, chosen by the kernel), for rank 0's
    store. The controller binds it before any worker starts and passes it down (no port race)."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((LOOPBACK, port))
        s.listen(128)
    except BaseException:
        s.close()
        raise
    return s


def loopback_ifname() -> str:
    """The loopback interface's name (`lo` on Linux, `lo0` on BSD / macOS)."""
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        names = []
    for n in ("lo", "lo0"):
        if n in names:
            return n
    return next((n for n in names if n.startswith("lo")), "lo")


def init(
    rank: int, size: int, port: int, device: str, timeout_s: float = 300.0, listen_fd: int | None = None
) -> TorchGroup:
    """Join the default process group. Every socket it opens listens on loopback only:

    - the store: a TCPStore that rank 0 serves from `listen_fd` (a socket the controller bound to
      127.0.0.1:`port`) or, without one, from a socket it binds to 127.0.0.1:`port` itself (a plain
      TCPStore / `init_process_group(init_method="env://")` would listen on every interface);
    - gloo's pair sockets: on the loopback interface (GLOO_SOCKET_IFNAME; all ranks are on this host);
    - NCCL's bootstrap / socket transport: NCCL_SOCKET_IFNAME=lo unless the user set it.
    """
    backend = "nccl" if device.startswith("cuda") else "gloo"
    lo = loopback_ifname()
    os.environ["GLOO_SOCKET_IFNAME"] = lo
    if backend == "nccl":
        os.environ.setdefault("NCCL_SOCKET_IFNAME", lo)
    timeout = timedelta(seconds=timeout_s)
    fd = None
    if rank == 0:
        fd = listen_fd if listen_fd is not None and listen_fd >= 0 else listen_socket(port).detach()
    store = dist.TCPStore(LOOPBACK, port, size, is_master=rank == 0, timeout=timeout, master_listen_fd=fd)
    kwargs = {}
    if backend == "nccl":
        kwargs["device_id"] = torch.device(device)
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout, **kwargs)
    return TorchGroup(rank, size, store=store)


_RELEASED = "detaudit/released"


def shutdown(group: TorchGroup | None = None, wait_s: float = 4.0) -> None:
    """Leave the default process group. With the group `init` returned, rank 0 (which serves the store)
    waits, up to `wait_s`, until every other rank has left too: NCCL's heartbeat monitor polls the store
    until its process group is destroyed, and a store gone first makes it log a `recvValue failed` stack
    trace at every clean exit."""
    if dist.is_initialized():
        dist.destroy_process_group()
    store = getattr(group, "store", None)
    if store is None or group.size < 2:
        return
    try:
        if group.rank != 0:
            store.add(_RELEASED, 1)
            return
        deadline = time.monotonic() + wait_s
        while store.add(_RELEASED, 0) < group.size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)
    except Exception:  # a rank or the store already gone: nothing left to wait for
        pass
