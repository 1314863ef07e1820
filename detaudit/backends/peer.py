"""The peer-memory transport of the fixed-order all-reduce (`kernels/peer_reduce.py`) for a real TP
group on GPUs: one symmetric buffer per rank, mapped into every rank of the group by PyTorch's
symmetric memory (CUDA backend: cuMem allocations shared between the processes; NVLink multicast is not
used), and PyTorch's device-side barrier between the kernel steps. Everything `all_reduce` issues is
stream ordered and allocation free after the first call of a size, so CUDA graphs capture it.
`row_all_reduce` (large prefills, never captured) adds a side stream whose copies the layer's matmul
feeds slice by slice.

Partials small enough (`peer_reduce.oneshot_fits`: decode steps) take the one-shot pair over a second,
fixed-size symmetric area, allocated at the first such call, with its epoch counter in device memory.

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
# `row_all_reduce` (the matmul cut by the slices' owners, each slice copied while the next is computed)
# from this many partial elements (8192 tokens x 4096 columns): its C matmul launches and copies cost about
# 150-200 us more host time per layer than one matmul and `push`, which a prefill of 4096 tokens x 4096
# columns at 4 ranks does not hide (`bench e2e --tp 4`: bio+tbik batch-8 prefill fell from 0.82x to 0.68x
# bf16), while at 16384 tokens the overlap wins on device time with host time to spare (batch 32: 0.82x
# to 0.92x). 8192 tokens was not measured apart: there the device time saved is twice 4096's.
OVERLAP_MIN = 1 << 25
# `routed_all_reduce` (the matmul's epilogue stores each owner's rows in its area over NVLink: no push)
# from this many partial elements (4096 tokens x 4096 columns) up to OVERLAP_MIN, where the backend has
# a routed matmul. On 4x H100 (`bench allreduce --ranks 4 --tokens 4096 --layer-k 1024 / 3072`) bio+tbik's
# TP-4 layer took 361 / 419 us where bio's, whose matmul is faster but whose partial is pushed, took 378 /
# 474 (reports/gpu/tp-scaling). In a one-off probe (not in the repo) at 1000 tokens the routed layer was
# slower than the pushed one (420 against 245 us: with few tiles a program, the stores' round trips over
# NVLink are not hidden), so smaller partials are pushed.
ROUTED_MIN = 1 << 24
ROUTE_ROWS = 128  # the routed matmul's tile rows (`gluon_tree.CONFIG["BLOCK_M"]`)


def routed_size(m: int, n: int) -> bool:
    """A partial of m x n fp32 in the routed range: `routed_all_reduce` may take it, and `all_reduce` cuts
    it into the same slices (`route_tables`), so that the ranks need not agree on which of the two ran."""
    return ROUTED_MIN <= m * n < OVERLAP_MIN and n % 128 == 0


def route_tables(m: int, c: int, rank: int, block: int = ROUTE_ROWS) -> tuple[int, list[int]]:
    """Where a routed matmul (`PeerTransport.routed_all_reduce`) puts this rank's partial of m rows: the
    slices are whole rows, `rows` = ceil(m / C) rounded up to whole tiles of `block` rows. Returns (rows,
    route): tile row i of the kernel's schedule computes the partial's tile row route[i] = j x rows / block
    + u (past m: zeros), owner j's u-th, stored in this rank's slot of owner j's area at its u-th tile row,
    where `push` with slices of rows x n would put it. The schedule interleaves the owners, this rank's
    successor first (tile row i goes to owner (rank + 1 + i) % C): the tiles a rank computes at once
    write to every peer alike, so no owner's links take more than their share, whatever the ranks' skew."""
    rows = route_rows(m, c, block)
    tiles = rows // block
    return rows, [((rank + 1 + i) % c) * tiles + i // c for i in range(c * tiles)]


def route_rows(m: int, c: int, block: int = ROUTE_ROWS) -> int:
    """Rows a rank's slice in the routed range: ceil(m / C) rounded up to whole tiles of `block` rows."""
    return -(-(-(-m // c)) // block) * block


class PeerBuffers:
    """One rank's view of the group's symmetric buffers: its receive area R (C slices of `per` fp32)
    and result area B (C slices of `per` elements of `dtype`), and the same areas of every rank."""

    def __init__(self, buf: Tensor, handle, size: int, per: int, dtype: torch.dtype) -> None:
        rbytes = size * per * 4
        peers = [handle.get_buffer(j, (buf.numel(),), torch.uint8) for j in range(size)]
        self.receive = [p[:rbytes].view(torch.float32) for p in peers]
        self.result = [p[rbytes:].view(dtype) for p in peers]
        self.handle, self.buf = handle, buf  # the handle keeps the mappings alive
        self.per, self.dtype = per, dtype

    def fits(self, per: int, dtype: torch.dtype) -> bool:
        return per <= self.per and dtype == self.dtype


def _rendezvous(buf: Tensor, pg):
    """Map every rank's `buf` into this rank (a collective). PyTorch before 2.9 must first enable the
    group (later versions deprecate that call as a no-op)."""
    import torch.distributed._symmetric_memory as symm_mem

    group = pg or dist.group.WORLD
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 9):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group.group_name)
    return symm_mem.rendezvous(buf, group)


class OneShotArea:
    """Every rank's one-shot area (2 halves x C slots of ONESHOT_MAX fp32) as this rank sees it, and this
    rank's epoch and ticket counters (int32, device memory, local)."""

    def __init__(self, buf: Tensor, handle, size: int) -> None:
        self.areas = [handle.get_buffer(j, (buf.numel(),), torch.uint8).view(torch.float32) for j in range(size)]
        self.handle, self.buf = handle, buf
        self.counters = torch.zeros(2, dtype=torch.int32, device=buf.device)


class PeerTransport:
    """The fixed-order all-reduce of `kernels/peer_reduce.py` on a real TP group, or None where it
    cannot run (`all_reduce` returns None; `reason` says why)."""

    def __init__(self, rank: int, size: int, pg=None) -> None:
        self.rank, self.size, self.pg = rank, size, pg
        self.buffers: PeerBuffers | None = None
        self.retired: list[PeerBuffers] = []  # outgrown buffers, kept alive for the graphs captured on them
        self.oneshot: OneShotArea | None = None
        self.routes: dict[tuple, tuple[list[Tensor], Tensor]] = {}  # (m, n, buffer) -> (areas, route)
        self.copies: torch.cuda.Stream | None = None  # the side stream of `row_all_reduce`'s copies
        self.events: list[torch.cuda.Event] = []  # its events: each slice's rows computed, then copied
        self.reason = ""

    def all_reduce(self, p: Tensor, dtype: torch.dtype, order: str) -> Tensor | None:
        """p (fp32, contiguous, the same shape on every rank) summed over the ranks in `order`, cast once
        to dtype; None where this transport cannot take it now."""
        if self.reason:
            return None
        n = p.numel()
        if peer_reduce.oneshot_fits(n, self.size):
            return self._oneshot(p, dtype, order)
        per = peer_reduce.slice_size(n, self.size)
        if p.dim() == 2 and routed_size(*p.shape):  # the routed matmul's slices (whole tiles of rows)
            per = route_rows(p.shape[0], self.size) * p.shape[1]
        b = self._buffers(per, dtype, p.device)
        if b is None:
            return None
        # this call's slices, laid out at stride `per` in the first C * per elements of each area
        peer_reduce.push(p.view(-1), b.receive, self.rank, per)
        return self._finish(b, p.shape, per, dtype, order)

    def row_all_reduce(
        self, m: int, n: int, dtype: torch.dtype, order: str, rows_partial, device: torch.device
    ) -> Tensor | None:
        """A row-parallel layer's all-reduce with its matmul cut by the slices' owners, or None where this
        transport does not take the size now (below OVERLAP_MIN; decode sizes go by the one-shot pair, a
        graph being captured by `all_reduce`): the same answer on every rank, from the shape, buffers and capture.

        `rows_partial(r0, r1)` is this rank's fp32 partial of rows r0..r1 (the backend's batch-invariant
        matmul: a row's values do not depend on the rows beside it). The slices are whole rows, ceil(m / C)
        a rank; rank j's rows are computed, then copied into this rank's slot of rank j's receive area
        by the copy engine on a side stream while the next rows are computed, this rank's own rows last.
        The areas then hold every valid element where `push` with slices of `per` = ceil(m / C) x n would
        put it (a short last slice's tail is left as it was: the gather reads no element past m x n), and
        the reduce and gather finish as in `all_reduce`: the same bits, with the transfer behind the
        matmul instead of after it."""
        if self.reason or m * n < OVERLAP_MIN or peer_reduce.oneshot_fits(m * n, self.size) or n % 64:
            return None
        if torch.cuda.is_current_stream_capturing():
            return None  # (prefill is not captured; side streams stay out of graphs)
        rows = -(-m // self.size)
        per = rows * n
        b = self._buffers(per, dtype, device)
        if b is None:
            return None
        main = torch.cuda.current_stream(device)
        if self.copies is None:
            self.copies = torch.cuda.Stream(device)
            self.events = [torch.cuda.Event() for _ in range(self.size + 1)]
        side, computed, copied = self.copies, self.events[:-1], self.events[-1]
        at = self.rank * per
        sent = []  # every slice stays referenced until main waits for the copies (no record_stream: the
        # allocator then reuses its memory only for work ordered after them)
        try:
            for step in range(1, self.size + 1):
                j = (self.rank + step) % self.size  # the other ranks' rows first, this rank's own last
                r0, r1 = j * rows, min((j + 1) * rows, m)
                if r0 >= r1:
                    continue
                part = rows_partial(r0, r1)
                sent.append(part)
                computed[step - 1].record(main)  # (re-recorded next call: a wait already issued keeps this one)
                torch.cuda.set_stream(side)  # (a fifth of `torch.cuda.stream`'s host cost: this runs per slice)
                side.wait_event(computed[step - 1])  # the rows are computed, the areas free (the last barrier)
                b.receive[j][at : at + part.numel()].copy_(part.view(-1), non_blocking=True)
                torch.cuda.set_stream(main)
        finally:  # also when a matmul raised: no slice is freed while a copy may still read it
            torch.cuda.set_stream(main)
            copied.record(side)
            main.wait_event(copied)  # every copy has landed before this rank reaches the barrier
        return self._finish(b, (m, n), per, dtype, order)

    def routed_all_reduce(
        self, m: int, n: int, dtype: torch.dtype, order: str, routed, device: torch.device
    ) -> Tensor | None:
        """A row-parallel layer whose matmul stores each owner's rows straight into this rank's slot of the
        owner's receive area (NVLink stores from the matmul's epilogue: no push, no copies), then reduce
        and gather as `all_reduce`: the same bits. `routed()`, asked only in the routed range, gives this
        rank's routed matmul or None: `write(areas, route, rows, rank)` runs it with its tile rows placed
        by `route_tables` (`areas[j]`: owner j's receive area as [C x rows, n]). None where this
        transport does not take the size (`routed_size`: below ROUTED_MIN, from OVERLAP_MIN on, where
        `row_all_reduce`'s copies overlap whole slices; N not whole 128-column tiles; a graph being
        captured, which prefill never is) or this rank has no routed matmul (then the caller pushes its
        partial with `all_reduce`, into the same slices: a rank may route while another pushes)."""
        if self.reason or not routed_size(m, n) or torch.cuda.is_current_stream_capturing():
            return None
        write = routed()
        if write is None:
            return None
        rows = route_rows(m, self.size)
        b = self._buffers(rows * n, dtype, device)
        if b is None:
            return None
        key = (m, n, id(b))
        tables = self.routes.get(key)
        if tables is None:  # (the table and views once per size and buffer, not at every layer)
            if len(self.routes) >= 256:  # a long run of ever new prefill sizes
                self.routes.clear()
            route = route_tables(m, self.size, self.rank)[1]
            areas = [r[: self.size * rows * n].view(self.size * rows, n) for r in b.receive]
            tables = self.routes[key] = (areas, torch.tensor(route, dtype=torch.int32, device=device))
        # the areas are free: every rank's reduce of the last call preceded the barrier this rank passed last
        write(*tables, rows, self.rank)
        return self._finish(b, (m, n), rows * n, dtype, order)

    def _finish(self, b: PeerBuffers, shape, per: int, dtype: torch.dtype, order: str) -> Tensor:
        """Barrier, reduce this rank's slice, barrier, read every rank's cast slice."""
        out = torch.empty(shape, dtype=dtype, device=b.buf.device)
        b.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        peer_reduce.reduce(b.receive[self.rank], b.result[self.rank], self.rank, self.size, per, order)
        b.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        peer_reduce.gather(b.result, out.view(-1), per)
        return out

    def _buffers(self, per: int, dtype: torch.dtype, device: torch.device) -> PeerBuffers | None:
        """Buffers with slices of at least `per` elements of dtype results, grown where needed outside
        graph capture, or None."""
        if self.size * per >= 2**31:  # the kernels' int32 offsets (the same answer on every rank)
            return None
        b = self.buffers
        if b is None or not b.fits(per, dtype):
            if torch.cuda.is_current_stream_capturing():
                return None  # no allocation or rendezvous inside a graph: NCCL for this call
            if b is None:
                size = max(per, MIN_SLICE)
            else:  # at least double a buffer that is too small; the same size where only the dtype differs
                size = max(per, 2 * b.per) if per > b.per else b.per
            b = self._grow(size, dtype, device)
        return b

    def _oneshot(self, p: Tensor, dtype: torch.dtype, order: str) -> Tensor | None:
        o = self.oneshot
        if o is None:
            if torch.cuda.is_current_stream_capturing():
                return None  # no allocation or rendezvous inside a graph: NCCL for this call
            mapped = self._symmetric(2 * self.size * peer_reduce.ONESHOT_MAX * 4, p.device)
            if mapped is None:
                return None
            o = self.oneshot = OneShotArea(*mapped, self.size)
        out = torch.empty(p.shape, dtype=dtype, device=p.device)
        peer_reduce.oneshot_push(p.view(-1), o.areas, self.rank, o.counters)
        o.handle.barrier(channel=0, timeout_ms=BARRIER_TIMEOUT_MS)
        peer_reduce.oneshot_reduce(o.areas[self.rank], out.view(-1), self.size, order, o.counters)
        return out

    def _grow(self, per: int, dtype: torch.dtype, device: torch.device) -> PeerBuffers | None:
        """A new buffer on every rank, or None on every rank (see `_symmetric`). The old buffer is kept,
        never freed: a CUDA graph captured on it may be replayed later."""
        mapped = self._symmetric(self.size * per * (4 + dtype.itemsize), device)
        if mapped is None:
            return None
        if self.buffers is not None:
            self.retired.append(self.buffers)
        self.buffers = PeerBuffers(*mapped, self.size, per, dtype)
        return self.buffers

    def _symmetric(self, nbytes: int, device: torch.device) -> tuple[Tensor, object] | None:
        """A symmetric buffer of nbytes and its handle on every rank, or None on every rank: after the
        local allocation and after the mapping (a collective) the ranks agree on the outcome through an
        NCCL all-reduce of a flag, so none of them waits in a rendezvous or a barrier the others never
        reach."""
        import torch.distributed._symmetric_memory as symm_mem

        buf = handle = None
        try:
            buf = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        except Exception as e:  # no symmetric memory here (build, driver, permissions, memory)
            self.reason = f"symmetric memory unavailable: {type(e).__name__}: {str(e)[:200]}"
        if self._agree(int(buf is not None), device):
            try:
                handle = _rendezvous(buf, self.pg)
            except Exception as e:
                self.reason = f"symmetric memory could not be mapped: {type(e).__name__}: {str(e)[:200]}"
            if not self._agree(int(handle is not None), device):
                handle = None
        if handle is None:
            self.reason = self.reason or "symmetric memory unavailable on another rank"
            return None
        return buf, handle

    def _agree(self, ok: int, device: torch.device) -> bool:
        flag = torch.tensor([ok], dtype=torch.int32, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.pg)
        return bool(flag.item())
