"""The peer-memory transport of the fixed-order all-reduce (`kernels/peer_reduce.py`) for a real TP
group on GPUs: one symmetric buffer per rank, mapped into every rank of the group by PyTorch's
symmetric memory (CUDA backend: cuMem allocations shared between the processes; NVLink multicast is not
used), and PyTorch's device-side barrier between the kernel steps. Everything it issues is stream
ordered and allocation free after the first call of a size, so CUDA graphs capture it.

The buffer grows (at least doubling) when a larger partial arrives, outside graph capture only: the
ranks see the same partial shapes in the same order, so they grow together. An outgrown buffer is kept
(graphs captured on it stay valid): the memory held is at most about twice the largest buffer's. A size
that does not fit while a graph is being captured, like a group where symmetric memory does not work,
gets None: the caller moves the partials through NCCL instead, with the same bits.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor

from detaudit.backends.kernels import peer_reduce

MIN_SLICE = 1 << 18  # elements per rank slice of the first buffer (1 MiB of fp32 a slice)
# a device barrier that waits longer traps (the rank's CUDA context fails, so does its cell) instead of
# spinning for good on a peer that is gone: the process group's timeout (`dist.init`)
BARRIER_TIMEOUT_MS = 300_000


class PeerBuffers:
    """One rank's view of the group's symmetric buffers: its receive area R (C slices of `per` fp32)
    and result area B (C slices of `per` elements of `dtype`), and the same areas of every rank."""

    def __init__(self, rank: int, size: int, pg, per: int, dtype: torch.dtype, device: torch.device) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        rbytes = size * per * 4
        nbytes = rbytes + size * per * dtype.itemsize
        buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        handle = _rendezvous(symm_mem, buf, pg)
        peers = [handle.get_buffer(j, (nbytes,), torch.uint8) for j in range(size)]
        self.receive = [p[:rbytes].view(torch.float32) for p in peers]
        self.result = [p[rbytes:].view(dtype) for p in peers]
        self.handle, self.buf = handle, buf  # the handle keeps the mappings alive
        self.rank, self.size, self.per, self.dtype = rank, size, per, dtype

    def fits(self, per: int, dtype: torch.dtype) -> bool:
        return per <= self.per and dtype == self.dtype


def _rendezvous(symm_mem, buf: Tensor, pg):
    group = pg or dist.group.WORLD
    try:
        return symm_mem.rendezvous(buf, group)
    except Exception:  # older PyTorch: the group must be enabled first (deprecated later, a no-op there)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
        return symm_mem.rendezvous(buf, group)


class PeerTransport:
    """The fixed-order all-reduce of `kernels/peer_reduce.py` on a real TP group, or None where it
    cannot run (`all_reduce` returns None; `reason` says why)."""

    def __init__(self, rank: int, size: int, pg=None) -> None:
        self.rank, self.size, self.pg = rank, size, pg
        self.buffers: PeerBuffers | None = None
        self.retired: list[PeerBuffers] = []  # outgrown buffers, kept alive for the graphs captured on them
        self.reason = ""

    def all_reduce(self, p: Tensor, dtype: torch.dtype, order: str) -> Tensor | None:
        """p (fp32, contiguous, the same shape on every rank) summed over the ranks in `order`, cast once
        to dtype; None where this transport cannot take it now."""
        if self.reason:
            return None
        n = p.numel()
        per = peer_reduce.slice_size(n, self.size)
        b = self.buffers
        if b is None or not b.fits(per, dtype):
            if torch.cuda.is_current_stream_capturing():
                return None  # no allocation or rendezvous inside a graph: NCCL for this call
            b = self._grow(max(per, MIN_SLICE, 2 * b.per if b is not None else 0), dtype, p.device)
            if b is None:
                return None
        out = torch.empty(p.shape, dtype=dtype, device=p.device)
        # this call's slices, laid out at stride `per` in the first C * per elements of each area
        peer_reduce.push(p.view(-1), b.receive, self.rank, per)
        b.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        peer_reduce.reduce(b.receive[self.rank], b.result[self.rank], self.rank, self.size, per, order)
        b.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        peer_reduce.gather(b.result, out.view(-1), per)
        return out

    def _grow(self, per: int, dtype: torch.dtype, device: torch.device) -> PeerBuffers | None:
        """A new buffer on every rank, or None on every rank (the ranks agree on the outcome through an
        NCCL all-reduce of a flag, so none of them waits in a barrier the others never reach). The old
        buffer is kept, never freed: a CUDA graph captured on it may be replayed later."""
        try:
            b: PeerBuffers | None = PeerBuffers(self.rank, self.size, self.pg, per, dtype, device)
        except Exception as e:  # no symmetric memory here (build, driver, permissions)
            b = None
            self.reason = f"symmetric memory unavailable: {type(e).__name__}: {str(e)[:200]}"
        if not self._agree(int(b is not None), device):
            self.reason = self.reason or "symmetric memory unavailable on another rank"
            return None
        if self.buffers is not None:
            self.retired.append(self.buffers)
        self.buffers = b
        return b

    def _agree(self, ok: int, device: torch.device) -> bool:
        flag = torch.tensor([ok], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(flag.item())
