"""The fixed-order all-reduce over peer memory (NVLink), as Triton kernels: three steps for large
partials, a one-shot pair for small ones.

Every rank holds one symmetric buffer that every other rank can address (`backends/peer.py` maps
them): a receive area R of C slices of `per` fp32 and a result area B of C slices of `per` elements of
the output dtype. A partial of n <= C * per fp32 elements is cut into C slices; rank r owns slice r.

1. `push`: rank r writes slice j of its partial into R[r] of rank j's buffer, for every j (stores
   over NVLink; slice r into its own). Then a barrier.
2. `reduce`: rank r adds R[0], ..., R[C-1] of its own buffer (its slice of every rank's partial, in
   rank order) in one fixed order, in fp32, casts once and writes B[r] of its own buffer. Then a barrier.
3. `gather`: rank r reads B[j] of every rank j's buffer into the output (loads over NVLink).

Per element that is the same additions, in the same order, as `backends.allreduce.sequential_sum` (ORDER
"rank": ((p0 + p1) + p2) + ...) or `kernels.tree.tree_sum` (ORDER "tree": pairwise up a complete
binary tree), then one round-to-nearest-even cast: the bits of the all-gather transport. It moves
(C-1)/C of the partial in fp32 plus (C-1)/C in the output dtype per rank, what the reduce-scatter by
all-to-all moves, with no staging copies and one launch per step.

Buffer reuse needs no third barrier: a rank pushes into R of call n+1 only after the barrier that
follows every rank's `reduce` of call n, and reduces into B of call n+1 only after the barrier that
follows every rank's push of call n+1, which each rank issues after its `gather` of call n.

One-shot (partials whose copies to every peer stay small, `ONESHOT_BYTES`: decode steps): every rank
holds a one-shot area of two halves of C slots of ONESHOT_MAX fp32.
1. `oneshot_push`: rank r writes its whole partial into slot r of the current half of every rank's area.
   Then a barrier.
2. `oneshot_reduce`: rank r adds the C slots of the current half of its own area in the fixed order, casts
   once and writes its output (no gather: every rank reduced everything).
Same additions, same bits; one barrier and two launches instead of two and three. The half alternates
call by call through an epoch counter in device memory (the push and the reduce read it, the reduce's
last program advances it), so CUDA graph replays, which repeat the captured kernels, alternate too. A
rank pushes into a half again only two calls later, after the barrier of the call in between, which
every rank reaches only once its reduce of that half is done: the one barrier suffices.

Up to 8 ranks (C = 2, 4 or 8), each peer buffer a separate pointer argument (P0..P7; unused ones repeat
P0), the kernels unrolled over them at compile time. The kernels run under TRITON_INTERPRET=1 with
ordinary CPU tensors standing in for the peers' buffers (tests/unit/test_peer_reduce.py); there the
result areas are fp32 and the cast is torch's (the interpreter's fp32 -> bf16 store truncates where the
GPU's rounds to nearest even), as in `triton_mm`.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from detaudit.backends.kernels import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

# elements per rank slice per program, 4 per thread: on 4x H100, of 1024 to 8192 elements at 4 to 16 warps,
# the fastest or within 4% of it at 32 to 16384 tokens x 4096 in a one-off sweep (the kernels alone and the
# whole all-reduce; larger blocks leave fewer programs to keep NVLink busy)
BLOCK = 1024
NUM_WARPS = 8
MAX_RANKS = 8
ORDERS = ("rank", "tree")
ONESHOT_MAX = 1 << 18  # elements in a one-shot slot (1 MiB of fp32: 64 tokens x 4096)
# one-shot where a rank's copies to its peers, (C - 1) x the fp32 partial, stay within this: at 2 ranks
# up to ONESHOT_MAX, at 4 up to 32 tokens x 4096 (decode batches), at 8 up to 16. What it saves is one
# barrier and one launch (about 6-9 us on 2x H100 at decode sizes); what it costs is moving the whole
# partial to every peer instead of a 1/C slice, which only pays while the partial is small.
ONESHOT_BYTES = 2 << 20

if triton is not None:

    @triton.jit
    def _store_peers(p0, p1, p2, p3, p4, p5, p6, p7, off, x0, x1, x2, x3, x4, x5, x6, x7, m, C: tl.constexpr):
        """x_j into peer j's buffer at `off`, for the C peers (unrolled; the callers load before storing)."""
        tl.store(p0 + off, x0, mask=m)
        if C > 1:
            tl.store(p1 + off, x1, mask=m)
        if C > 2:
            tl.store(p2 + off, x2, mask=m)
            tl.store(p3 + off, x3, mask=m)
        if C > 4:
            tl.store(p4 + off, x4, mask=m)
            tl.store(p5 + off, x5, mask=m)
            tl.store(p6 + off, x6, mask=m)
            tl.store(p7 + off, x7, mask=m)

    @triton.jit
    def _push_kernel(src, p0, p1, p2, p3, p4, p5, p6, p7, n, per, rank, C: tl.constexpr, BLOCK: tl.constexpr):
        """Every slice's block loaded first (local), then stored to its peer: the stores need not wait for
        each other's loads. Unrolled for up to 8 ranks (`if C > j` is resolved at compile time)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < per
        x0 = tl.load(src + offs, mask=inside & (offs < n), other=0.0)
        x1, x2, x3, x4, x5, x6, x7 = x0, x0, x0, x0, x0, x0, x0  # stand-ins for the peers C leaves out
        if C > 1:
            x1 = tl.load(src + per + offs, mask=inside & (per + offs < n), other=0.0)
        if C > 2:
            x2 = tl.load(src + 2 * per + offs, mask=inside & (2 * per + offs < n), other=0.0)
            x3 = tl.load(src + 3 * per + offs, mask=inside & (3 * per + offs < n), other=0.0)
        if C > 4:
            x4 = tl.load(src + 4 * per + offs, mask=inside & (4 * per + offs < n), other=0.0)
            x5 = tl.load(src + 5 * per + offs, mask=inside & (5 * per + offs < n), other=0.0)
            x6 = tl.load(src + 6 * per + offs, mask=inside & (6 * per + offs < n), other=0.0)
            x7 = tl.load(src + 7 * per + offs, mask=inside & (7 * per + offs < n), other=0.0)
        _store_peers(p0, p1, p2, p3, p4, p5, p6, p7, rank * per + offs, x0, x1, x2, x3, x4, x5, x6, x7, inside, C)

    @triton.jit
    def _part(r, j: tl.constexpr, per, offs, mask):
        return tl.load(r + j * per + offs, mask=mask, other=0.0)

    @triton.jit
    def _fixed_sum(r, per, offs, m, C: tl.constexpr, TREE: tl.constexpr):
        """The fp32 sum of the C parts r[j * per + offs] in the backend's order."""
        if TREE and C > 2:  # ((p0 + p1) + (p2 + p3)) [+ ((p4 + p5) + (p6 + p7))]
            s = (_part(r, 0, per, offs, m) + _part(r, 1, per, offs, m)) + (
                _part(r, 2, per, offs, m) + _part(r, 3, per, offs, m)
            )
            if C == 8:
                s = s + (
                    (_part(r, 4, per, offs, m) + _part(r, 5, per, offs, m))
                    + (_part(r, 6, per, offs, m) + _part(r, 7, per, offs, m))
                )
        else:  # rank order (and the tree of two)
            s = _part(r, 0, per, offs, m)
            for j in tl.static_range(1, C):
                s = s + _part(r, j, per, offs, m)
        return s

    @triton.jit
    def _reduce_kernel(r, b, per, rank, C: tl.constexpr, TREE: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < per
        s = _fixed_sum(r, per, offs, m, C, TREE)
        tl.store(b + rank * per + offs, s.to(b.dtype.element_ty), mask=m)

    @triton.jit
    def _oneshot_push_kernel(
        src, p0, p1, p2, p3, p4, p5, p6, p7, n, rank, epoch, NMAX, C: tl.constexpr, BLOCK: tl.constexpr
    ):
        """The block of the whole partial into slot `rank` of the current half of every rank's area."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(src + offs, mask=m)
        dst = ((tl.load(epoch) % 2) * C + rank) * NMAX + offs
        _store_peers(p0, p1, p2, p3, p4, p5, p6, p7, dst, x, x, x, x, x, x, x, x, m, C)

    @triton.jit
    def _oneshot_reduce_kernel(
        area, out, n, epoch, done, NMAX, C: tl.constexpr, TREE: tl.constexpr, BLOCK: tl.constexpr
    ):
        """out = the fixed-order sum of the C slots of the current half, cast once. The program that
        finishes last (its ticket is the last) advances the epoch: every warp of every program has read
        it before its program takes a ticket (the barrier; the atomic is one thread's), so none sees the
        next call's half. The epoch stays within 30 bits (it wraps to 0 from an odd value), so its
        parity alternates for good and never goes negative."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        e = tl.load(epoch)
        s = _fixed_sum(area + (e % 2) * C * NMAX, NMAX, offs, m, C, TREE)
        tl.store(out + offs, s.to(out.dtype.element_ty), mask=m)
        tl.debug_barrier()
        ticket = tl.atomic_add(done, 1, sem="acq_rel")
        if ticket == tl.num_programs(0) - 1:
            tl.store(done, 0)
            tl.store(epoch, (e + 1) & 0x3FFFFFFF)

    @triton.jit
    def _gather_kernel(out, p0, p1, p2, p3, p4, p5, p6, p7, n, per, C: tl.constexpr, BLOCK: tl.constexpr):
        """Every peer's block loaded first (over NVLink: C loads in flight per thread, not one), then stored."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < per
        y0 = tl.load(p0 + offs, mask=inside & (offs < n))
        if C > 1:
            y1 = tl.load(p1 + per + offs, mask=inside & (per + offs < n))
        if C > 2:
            y2 = tl.load(p2 + 2 * per + offs, mask=inside & (2 * per + offs < n))
            y3 = tl.load(p3 + 3 * per + offs, mask=inside & (3 * per + offs < n))
        if C > 4:
            y4 = tl.load(p4 + 4 * per + offs, mask=inside & (4 * per + offs < n))
            y5 = tl.load(p5 + 5 * per + offs, mask=inside & (5 * per + offs < n))
            y6 = tl.load(p6 + 6 * per + offs, mask=inside & (6 * per + offs < n))
            y7 = tl.load(p7 + 7 * per + offs, mask=inside & (7 * per + offs < n))
        tl.store(out + offs, y0, mask=inside & (offs < n))
        if C > 1:
            tl.store(out + per + offs, y1, mask=inside & (per + offs < n))
        if C > 2:
            tl.store(out + 2 * per + offs, y2, mask=inside & (2 * per + offs < n))
            tl.store(out + 3 * per + offs, y3, mask=inside & (3 * per + offs < n))
        if C > 4:
            tl.store(out + 4 * per + offs, y4, mask=inside & (4 * per + offs < n))
            tl.store(out + 5 * per + offs, y5, mask=inside & (5 * per + offs < n))
            tl.store(out + 6 * per + offs, y6, mask=inside & (6 * per + offs < n))
            tl.store(out + 7 * per + offs, y7, mask=inside & (7 * per + offs < n))


def _eight(peers: Sequence[Tensor]) -> list[Tensor]:
    if len(peers) not in (1, 2, 4, 8):
        raise ValueError(f"peer all-reduce takes 1, 2, 4 or 8 ranks, got {len(peers)}")
    return list(peers) + [peers[0]] * (MAX_RANKS - len(peers))


def _run(name: str, kernel, grid: int, device: Tensor, args: tuple, constexprs: dict, slots: tuple, key) -> None:
    """kernel[grid](*args) through a kept launch plan on CUDA (`launch`: the host cost of a JIT launch
    is several times this all-reduce's at decode sizes), through the JIT elsewhere."""
    if device.is_cuda:
        plan = _PLANS.get((name, key))
        if plan is not None:
            plan(device.device.index, *(args[i] for i in slots))
            return
    first = launch.Launch.first(kernel, (grid,), args, dict(constexprs, num_warps=NUM_WARPS), slots)
    if first is not None and device.is_cuda:
        launch.cache_put(_PLANS, (name, key), first)


_PLANS: dict[tuple, launch.Launch] = {}


def _is_tree(order: str) -> bool:
    """Whether the reduce kernels add in `order` along the tree (else in rank order); refuses another name."""
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
    return order == "tree"


def _grid(per: int) -> int:
    return -(-per // BLOCK)


def push(src: Tensor, receive: Sequence[Tensor], rank: int, per: int) -> None:
    """Slice j of the flat fp32 `src` (n <= C * per elements; past n: zeros) into receive[j][rank * per:],
    for each rank j. receive[j] is rank j's R area, C * per fp32."""
    c, n = len(receive), src.numel()
    peers = _eight(receive)
    key = (n, per, rank, c, tuple(p.data_ptr() for p in receive), src.data_ptr() % 16 == 0)
    _run("push", _push_kernel, _grid(per), src, (src, *peers, n, per, rank), dict(C=c, BLOCK=BLOCK), (0,), key)


def reduce(receive: Tensor, result: Tensor, rank: int, c: int, per: int, order: str) -> None:
    """result[rank * per:(rank + 1) * per] = the fixed-order fp32 sum of the C slices of this rank's
    receive area, cast to result's dtype."""
    tree = _is_tree(order)
    key = (per, rank, c, tree, receive.data_ptr(), result.data_ptr(), result.dtype)
    args = (receive, result, per, rank)
    _run("reduce", _reduce_kernel, _grid(per), receive, args, dict(C=c, TREE=tree, BLOCK=BLOCK), (), key)


def reduce_cast(parts: Tensor, dtype: torch.dtype, order: str) -> Tensor:
    """parts [C, per] fp32 (contiguous: the C ranks' slices as NCCL's all-to-all or all-gather leaves them)
    -> their fixed-order sum cast to `dtype`, [per]: `reduce`'s kernel as rank 0 of one buffer, one launch
    where `reduce(list(parts)).to(dtype)` runs C - 1 adds and a cast, each through memory. The same
    additions in the same order, the same cast: the same bits (the NCCL transport's fused step)."""
    tree = _is_tree(order)
    c, per = parts.shape
    out = torch.empty(per, dtype=dtype, device=parts.device)
    key = (per, c, tree, dtype, parts.data_ptr() % 16 == 0, out.data_ptr() % 16 == 0)
    args = (parts, out, per, 0)
    _run("reduce_cast", _reduce_kernel, _grid(per), parts, args, dict(C=c, TREE=tree, BLOCK=BLOCK), (0, 1), key)
    return out


def gather(results: Sequence[Tensor], out: Tensor, per: int) -> None:
    """out (flat, n elements) = slice j of results[j] (rank j's B area), for each rank j."""
    c, n = len(results), out.numel()
    peers = _eight(results)
    key = (n, per, c, tuple(p.data_ptr() for p in results), out.dtype, out.data_ptr() % 16 == 0)
    _run("gather", _gather_kernel, _grid(per), out, (out, *peers, n, per), dict(C=c, BLOCK=BLOCK), (0,), key)


def oneshot_fits(n: int, c: int) -> bool:
    """An n-element fp32 partial of C ranks takes the one-shot path."""
    return n <= ONESHOT_MAX and (c - 1) * n * 4 <= ONESHOT_BYTES


def oneshot_push(src: Tensor, areas: Sequence[Tensor], rank: int, counters: Tensor) -> None:
    """The flat fp32 `src` into slot `rank` of the current half of every rank's one-shot area (areas[j]:
    rank j's, 2 * C * ONESHOT_MAX fp32); counters[0] is the epoch (int32, device memory)."""
    c, n = len(areas), src.numel()
    key = (n, rank, c, tuple(a.data_ptr() for a in areas), counters.data_ptr(), src.data_ptr() % 16 == 0)
    args = (src, *_eight(areas), n, rank, counters, ONESHOT_MAX)
    _run("oneshot_push", _oneshot_push_kernel, -(-n // BLOCK), src, args, dict(C=c, BLOCK=BLOCK), (0,), key)


def oneshot_reduce(area: Tensor, out: Tensor, c: int, order: str, counters: Tensor) -> None:
    """out (flat) = the fixed-order sum of the C slots of the current half of this rank's area, cast to
    out's dtype; then the epoch (counters[0]) advances (counters[1]: the programs' tickets, back to 0)."""
    n, tree = out.numel(), _is_tree(order)
    key = (n, c, tree, area.data_ptr(), counters.data_ptr(), out.dtype, out.data_ptr() % 16 == 0)
    args = (area, out, n, counters, counters[1:], ONESHOT_MAX)
    consts = dict(C=c, TREE=tree, BLOCK=BLOCK)
    _run("oneshot_reduce", _oneshot_reduce_kernel, -(-n // BLOCK), out, args, consts, (1,), key)


def slice_size(n: int, c: int) -> int:
    """Elements per rank slice of an n-element partial: n / C rounded up to 64 elements (256-byte aligned
    slices in every buffer)."""
    per = -(-n // c)
    return -(-per // 64) * 64


def emulate_oneshot(partials: Sequence[Tensor], dtype: torch.dtype, order: str, calls: int = 1):
    """The one-shot pair for C ranks in one process, `calls` times over the same partials: every rank's
    output and every rank's areas and counters (tests)."""
    c, n = len(partials), partials[0].numel()
    dev = partials[0].device
    out_dtype = dtype if dev.type == "cuda" else torch.float32  # the interpreter's cast truncates
    areas = [torch.zeros(2 * c * ONESHOT_MAX, dtype=torch.float32, device=dev) for _ in range(c)]
    counters = [torch.zeros(2, dtype=torch.int32, device=dev) for _ in range(c)]
    outs = [torch.empty(n, dtype=out_dtype, device=dev) for _ in range(c)]
    for _ in range(calls):
        for r, p in enumerate(partials):
            oneshot_push(p.float().contiguous().view(-1), areas, r, counters[r])
        for r in range(c):
            oneshot_reduce(areas[r], outs[r], c, order, counters[r])
    return [o.to(dtype).view(partials[0].shape) for o in outs], areas, counters


def emulate(partials: Sequence[Tensor], dtype: torch.dtype, order: str) -> list[Tensor]:
    """The three steps for C ranks in one process, ordinary tensors standing in for the peer buffers:
    every rank's output (tests; the real transport runs them on C processes, one step apart by barriers)."""
    c = len(partials)
    n = partials[0].numel()
    per = slice_size(n, c)
    dev = partials[0].device
    area = dtype if dev.type == "cuda" else torch.float32  # the interpreter's cast truncates: torch's below
    recv = [torch.empty(c * per, dtype=torch.float32, device=dev) for _ in range(c)]
    res = [torch.empty(c * per, dtype=area, device=dev) for _ in range(c)]
    for r, p in enumerate(partials):
        push(p.float().contiguous().view(-1), recv, r, per)
    for r in range(c):
        reduce(recv[r], res[r], r, c, per, order)
    outs = []
    for _ in range(c):
        out = torch.empty(n, dtype=area, device=dev)
        gather(res, out, per)
        outs.append(out.to(dtype).view(partials[0].shape))
    return outs
