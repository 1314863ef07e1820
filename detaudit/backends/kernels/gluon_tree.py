"""The TBIK tree matmul on Hopper at many rows: an explicitly pipelined, warp-specialised Gluon kernel.

Per output element the reduction is exactly the Triton tree kernel's (`triton_mm._tree_kernel`): each
leaf accumulated from zero by wgmma in K = 16 slices in K order into one fp32 register, leaves added
pairwise up the complete binary tree in fp32. tests/gpu checks the two bitwise at many shapes.

What differs is the schedule. One load warp streams TMA loads of a flat sequence of (tile, K step)
into NB shared buffers, running ahead of the MMAs across leaf and tile boundaries (the Triton kernel's
software pipeline restarts at every unrolled leaf). The eight MMA warps only wait, issue and carry.
Registers are the tree's real cost: a 128 x 128 fp32 tile is 64 registers per MMA thread and the warps
get 240 after the load warp's share, so at most three tiles may be live (the leaf being accumulated and
two pending nodes: what 4 leaves need; with 8 leaves a third pending node spills, which halves the
speed). So with 8 leaves two nodes are parked while leaves 4..7 run: the node of leaves 0..3 in a
per-program fp32 scratch tile in global memory (it stays in L2), and the node of leaves 4..5 in shared
memory (64 KB, written and read back by the same threads), which leaves room for NB_PARKED = 5 load
buffers. Both in shared memory leaves 3 buffers, and with one MMA in flight and one buffer being
released that is one step of look-ahead: slower at long K; both in global memory (as before) cost
four 64 KB transfers per tile, which every program issues at about the same time.
The finished tile is rounded once to the output's dtype (fp32 for a TP subtree, the model dtype for a
TP-1 layer's final result: the same RNE rounding as a cast) and stored; the output is padded to whole
tiles (the stores need no masks: 64 predicates would cost registers). With 8 leaves the park is free
once leaf 7 has read it, so it is the tile's stage: written in the 128-byte swizzle and stored by TMA,
which runs while the next tile's MMAs do (the park is written again at leaf 5, after a store_wait);
tree 0.68-0.76x -> 0.71-0.78x cuBLAS at TP 1 on one H100 (reports/gpu/tp-scaling/README.md). With
fewer leaves the tile goes from registers: a 64 KB fp32 stage would take a load buffer, and with 5
buffers it measured slower at K = 1024 and 3072 (2 leaves; same report).

Routed (`tree_mm_routed`, a real-TP prefill's all-reduce: `backends/peer.py`): the schedule's tile rows
come from a table, and each finished fp32 tile goes through a 64 KB shared-memory stage by TMA into its
all-reduce owner's receive area (another GPU's memory over NVLink, or this rank's own), so the partial
never makes a second trip. The bulk stores are what NVLink needs: the register stores above, 32 bytes a
row segment, moved about 100 GB/s to the peers where these reach about 280 (4x H100). Up to 4 leaves
(TP >= 2): the stage takes the room of one load buffer, as the park does.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import Tensor

from detaudit.backends.kernels import launch

try:  # Gluon is experimental in Triton; where it is missing the Triton kernels run instead
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # the TMA load is async_copy_global_to_shared in Triton 3.6 (the GPU machines), async_load in 3.9
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    # 3.6's store_wait waits for the writes; later ones by default only until the stage has been read
    _WAIT_TAKES_READ_ONLY = gl.constexpr("read_only" in inspect.signature(tma.store_wait).parameters)
    # a shared buffer seen as another dtype / layout: `_reinterpret` in 3.6, `reinterpret` in 3.9
    _NEW_REINTERPRET = gl.constexpr(hasattr(getattr(gl, "shared_memory_descriptor", object), "reinterpret"))
except (ImportError, AttributeError, TypeError, ValueError):  # pragma: no cover - depends on the install
    gluon = None  # (a Gluon whose API moved: the Triton kernels run, as where it is missing)

# Measured on an H100: BLOCK_K = 64 with 6 buffers (192 KB of shared
# memory) beat BLOCK_K = 128 with 3; 128 x 256 tiles do not fit the tree's registers. With 8 leaves the
# 64 KB park leaves room for 5 buffers (5 x 32 KB + 64 KB = 224 KB of Hopper's 227).
CONFIG = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, NB=6, NB_PARKED=5, GROUP_M=8, num_warps=8)


_disabled: list[str] = []  # why the kernel was turned off in this process (a failed compile), if it was


def available(x: Tensor) -> bool:
    """Gluon is importable, the kernel has not failed to build here, and x lives on a Hopper GPU (wgmma
    is sm_90 only)."""
    return gluon is not None and not _disabled and x.is_cuda and _capability(x.device.index or 0) == 9


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


if gluon is not None:

    @gluon.jit
    def _tile_of(t, num_pid_m, num_pid_n, GROUP_M: gl.constexpr):
        """(tile row, tile column) of tile t, grouped along M for L2 reuse (as `triton_mm._tile_ids`)."""
        group = GROUP_M * num_pid_n
        first_m = (t // group) * GROUP_M
        size_m = gl.minimum(num_pid_m - first_m, GROUP_M)
        return first_m + ((t % group) % size_m), (t % group) // size_m

    @gluon.jit
    def _tile_ptrs(ptr, pid_m, pid_n, LD: gl.constexpr, like):
        """Pointers of a [BLOCK_M, BLOCK_N] tile of a row-major buffer with LD columns, in the register
        layout of `like`. LD is a compile-time constant, so the addresses fold into one base register
        plus immediates instead of 64 live 64-bit pointers."""
        BLOCK_M: gl.constexpr = like.shape[0]
        BLOCK_N: gl.constexpr = like.shape[1]
        rows = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, like.type.layout))
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, like.type.layout))
        base = ptr + (pid_m * BLOCK_M) * LD + pid_n * BLOCK_N
        return base + (rows[:, None] * LD + cols[None, :])

    @gluon.jit
    def _store_tile(ptr, pid_m, pid_n, LD: gl.constexpr, value):
        gl.store(_tile_ptrs(ptr, pid_m, pid_n, LD, value), value)

    @gluon.jit
    def _store_routed(
        o0, o1, o2, o3, o4, o5, o6, o7, stage, route_ptr, pid_m, pid_n, TILES, RANK_ROWS, value, C: gl.constexpr
    ):
        """The tile through shared memory by TMA into owner j's area (o<j>, a peer's memory or this
        rank's own; the descriptors are separate arguments: Triton 3.6's launcher takes none inside a
        tuple), at this rank's slot: tile row route[pid_m] = j * TILES + u is row RANK_ROWS + u * BM
        of that area. The stage is free once the last tile's store has read it."""
        BLOCK_M: gl.constexpr = value.shape[0]
        BLOCK_N: gl.constexpr = value.shape[1]
        a = gl.load(route_ptr + pid_m)
        j = a // TILES
        row = RANK_ROWS + (a - j * TILES) * BLOCK_M
        tma.store_wait(0)
        stage.store(value)
        fence_async_shared()
        at = [row, pid_n * BLOCK_N]
        if j == 0:
            _tma_store(o0, at, stage)
        if j == 1:
            _tma_store(o1, at, stage)
        if C > 2:
            if j == 2:
                _tma_store(o2, at, stage)
            if j == 3:
                _tma_store(o3, at, stage)
        if C > 4:
            if j == 4:
                _tma_store(o4, at, stage)
            if j == 5:
                _tma_store(o5, at, stage)
            if j == 6:
                _tma_store(o6, at, stage)
            if j == 7:
                _tma_store(o7, at, stage)

    @gluon.jit
    def _load_tile(ptr, pid_m, pid_n, LD: gl.constexpr, like):
        return gl.load(_tile_ptrs(ptr, pid_m, pid_n, LD, like))

    @gluon.jit
    def _producer(
        x_desc,
        w_desc,
        x_bufs,
        w_bufs,
        ready,
        empty,
        route_ptr,
        pid,
        NP,
        num_pid_m,
        num_pid_n,
        total,
        KSTEPS,
        NB: gl.constexpr,
        W_KN: gl.constexpr,
        GROUP_M: gl.constexpr,
        ROUTED: gl.constexpr,
    ):
        """The load warp: flat step g (tile pid + (g // KSTEPS) * NP, K step g % KSTEPS) into buffer
        g % NB, once the MMA warps have released that buffer's previous step (ROUTED: the schedule's
        tile row i computes x's tile row route[i])."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        for g in range(total):
            idx = g % NB
            mbarrier.wait(empty.index(idx), ((g // NB) & 1) ^ 1)  # a fresh barrier passes parity 1
            pid_m, pid_n = _tile_of(pid + (g // KSTEPS) * NP, num_pid_m, num_pid_n, GROUP_M)
            if ROUTED:
                pid_m = gl.load(route_ptr + pid_m)
            k = (g % KSTEPS) * BLOCK_K
            bar = ready.index(idx)
            mbarrier.expect(bar, x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            _tma_load(x_desc, [pid_m * BLOCK_M, k], bar, x_bufs.index(idx))
            if W_KN:  # the weight arrives transposed: [K, N] rows
                BLOCK_N: gl.constexpr = w_desc.block_type.shape[1]
                _tma_load(w_desc, [k, pid_n * BLOCK_N], bar, w_bufs.index(idx))
            else:
                BLOCK_N: gl.constexpr = w_desc.block_type.shape[0]
                _tma_load(w_desc, [pid_n * BLOCK_N, k], bar, w_bufs.index(idx))

    @gluon.jit
    def _mma_step(acc, cons, use_acc, x_bufs, w_bufs, ready, NB: gl.constexpr, W_KN: gl.constexpr):
        """Wait for step `cons`'s operands and issue its wgmma (async) into acc (use_acc off: from zero)."""
        idx = cons % NB
        mbarrier.wait(ready.index(idx), (cons // NB) & 1)
        if W_KN:
            b = w_bufs.index(idx)
        else:
            b = w_bufs.index(idx).permute((1, 0))
        return warpgroup_mma(x_bufs.index(idx), b, acc, use_acc=use_acc, is_async=True), cons + 1

    @gluon.jit
    def _consumer(
        x_bufs,
        w_bufs,
        ready,
        empty,
        out_ptr,
        scratch_ptr,
        park,
        o0,
        o1,
        o2,
        o3,
        o4,
        o5,
        o6,
        o7,
        stage,
        route_ptr,
        TILES,
        RANK_ROWS,
        pid,
        NP,
        num_pid_m,
        num_pid_n,
        my_tiles,
        LEAF_STEPS,
        NUM_LEAVES: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        LD: gl.constexpr,
        NB: gl.constexpr,
        W_KN: gl.constexpr,
        GROUP_M: gl.constexpr,
        C: gl.constexpr,
        ROUTED: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """The MMA warps: each leaf LEAF_STEPS wgmma steps from zero (one in flight while the next is
        issued), then carried up the tree in binary-counter order (leaf j is a compile-time constant).
        The finished tile goes to out_ptr, or ROUTED to its owner's area (`_store_routed`)."""
        layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16]
        )
        cons = 0
        acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=layout)
        for ti in range(my_tiles):
            pid_m, pid_n = _tile_of(pid + ti * NP, num_pid_m, num_pid_n, GROUP_M)
            s0 = acc
            s1 = acc
            node = acc
            for j in gl.static_range(NUM_LEAVES):
                for kk in range(LEAF_STEPS):
                    acc, cons = _mma_step(acc, cons, kk > 0, x_bufs, w_bufs, ready, NB, W_KN)
                    acc = warpgroup_mma_wait(1, deps=(acc,))  # the previous step is done: release its buffer
                    mbarrier.arrive(empty.index((cons + NB - 2) % NB), pred=kk > 0)
                acc = warpgroup_mma_wait(0, deps=(acc,))
                mbarrier.arrive(empty.index((cons + NB - 1) % NB))  # the leaf's last step
                if j % 2 == 0:
                    s0 = acc
                    node = acc
                else:
                    node = s0 + acc  # level 1: leaves j-1..j
                    if NUM_LEAVES == 8 and j == 5:
                        tma.store_wait(0)  # the park is the last tile's stage: its store has read it
                        park.store(node)  # leaves 4..5, read back by the same threads at leaf 7
                    elif NUM_LEAVES == 8 and j == 7:
                        node = park.load(layout) + node  # level 2: leaves 4..7
                        node = _load_tile(scratch_ptr, pid, 0, BLOCK_N, node) + node  # level 3: leaves 0..7
                    elif j % 4 == 1:
                        s1 = node
                    else:
                        node = s1 + node  # level 2: leaves j-3..j
                        if NUM_LEAVES == 8:
                            _store_tile(scratch_ptr, pid, 0, BLOCK_N, node)  # leaves 0..3 (j == 3)
            if ROUTED:
                _store_routed(o0, o1, o2, o3, o4, o5, o6, o7, stage, route_ptr, pid_m, pid_n, TILES, RANK_ROWS, node, C)
            elif NUM_LEAVES == 8:  # by TMA from the park (free once leaf 7 has read it) into o0
                if _NEW_REINTERPRET:
                    st = park.reinterpret(o0.dtype, [BLOCK_M, BLOCK_N], o0.layout)
                else:
                    st = park._reinterpret(o0.dtype, [BLOCK_M, BLOCK_N], o0.layout)
                st.store(node.to(o0.dtype))  # one RNE rounding, as a cast
                fence_async_shared()
                _tma_store(o0, [pid_m * BLOCK_M, pid_n * BLOCK_N], st)
            else:
                _store_tile(out_ptr, pid_m, pid_n, LD, node.to(out_ptr.dtype.element_ty))  # one RNE rounding
        if ROUTED or NUM_LEAVES == 8:  # the last stores written (not only read from the stage) before the end
            if _WAIT_TAKES_READ_ONLY:
                tma.store_wait(0, read_only=False)
            else:
                tma.store_wait(0)

    @gluon.jit
    def _tree_kernel(
        x_desc,
        w_desc,
        out_ptr,
        scratch_ptr,
        o0,
        o1,
        o2,
        o3,
        o4,
        o5,
        o6,
        o7,
        route_ptr,
        M,
        N,
        LEAF_STEPS,
        NP,
        TILES,
        RANK_ROWS,
        LD: gl.constexpr,
        NUM_LEAVES: gl.constexpr,
        BLOCK_N: gl.constexpr,
        W_KN: gl.constexpr,
        NB: gl.constexpr,
        GROUP_M: gl.constexpr,
        C: gl.constexpr,
        ROUTED: gl.constexpr,
        PARK_LAYOUT: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Persistent: program pid computes output tiles pid, pid + NP, ... (ROUTED: M counts the
        schedule's whole tile rows; see `tree_mm_routed`; else o0..o7 and `route_ptr` are unused)"""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        gl.static_assert(BLOCK_M == 16 * num_warps)
        KSTEPS = LEAF_STEPS * NUM_LEAVES
        dtype: gl.constexpr = x_desc.dtype
        pid = gl.program_id(0)
        num_pid_m = gl.cdiv(M, BLOCK_M)
        num_pid_n = gl.cdiv(N, BLOCK_N)
        my_tiles = gl.cdiv(num_pid_m * num_pid_n - pid, NP)
        x_bufs = gl.allocate_shared_memory(dtype, [NB] + x_desc.block_type.shape, x_desc.layout)
        w_bufs = gl.allocate_shared_memory(dtype, [NB] + w_desc.block_type.shape, w_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NB):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        # the park for the node of leaves 4..5, and the finished tile's TMA stage once leaf 7 has read it
        # (8 leaves only; a token allocation otherwise). fp32 in the 128-byte swizzle TMA reads: its
        # 16-byte units XORed with the row, so a warp's store of an accumulator register pair (8 rows x 8
        # columns) hits every bank twice, the minimum for 256 bytes.
        if NUM_LEAVES == 8:
            park = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], PARK_LAYOUT)
        else:
            park = gl.allocate_shared_memory(
                gl.float32, [8, 8], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
            )
        # the routed store's stage (a token allocation otherwise)
        if ROUTED:
            stage = gl.allocate_shared_memory(gl.float32, [BLOCK_M, BLOCK_N], o0.layout)
        else:
            stage = gl.allocate_shared_memory(
                gl.float32, [8, 8], gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
            )
        gl.warp_specialize(
            [
                (
                    _consumer,
                    (
                        x_bufs,
                        w_bufs,
                        ready,
                        empty,
                        out_ptr,
                        scratch_ptr,
                        park,
                        o0,
                        o1,
                        o2,
                        o3,
                        o4,
                        o5,
                        o6,
                        o7,
                        stage,
                        route_ptr,
                        TILES,
                        RANK_ROWS,
                        pid,
                        NP,
                        num_pid_m,
                        num_pid_n,
                        my_tiles,
                        LEAF_STEPS,
                        NUM_LEAVES,
                        BLOCK_M,
                        BLOCK_N,
                        LD,
                        NB,
                        W_KN,
                        GROUP_M,
                        C,
                        ROUTED,
                        num_warps,
                    ),
                ),
                (
                    _producer,
                    (
                        x_desc,
                        w_desc,
                        x_bufs,
                        w_bufs,
                        ready,
                        empty,
                        route_ptr,
                        pid,
                        NP,
                        num_pid_m,
                        num_pid_n,
                        my_tiles * KSTEPS,
                        KSTEPS,
                        NB,
                        W_KN,
                        GROUP_M,
                        ROUTED,
                    ),
                ),
            ],
            [1],
            [24],
        )
        for i in gl.static_range(NB):
            mbarrier.invalidate(ready.index(i))
            mbarrier.invalidate(empty.index(i))


def supports(x: Tensor, w: Tensor, leaves: int, cfg: dict | None = None) -> bool:
    """This kernel can run x[M, K] @ w[N, K]^T: Hopper, bf16/fp16, whole BLOCK_K steps per leaf, TMA-ready
    operands (16-byte aligned, unit stride in one dimension)."""
    c = dict(CONFIG, **(cfg or {}))
    if not (
        available(x)
        and x.dim() == 2
        and w.dim() == 2
        and x.dtype in (torch.bfloat16, torch.float16)
        and w.dtype == x.dtype
        and x.shape[1] % (leaves * c["BLOCK_K"]) == 0
        and x.stride(1) == 1
    ):
        return False
    return all(
        t.data_ptr() % 16 == 0
        and 1 in t.stride()
        and all((s * t.element_size()) % 16 == 0 for s in t.stride() if s != 1)
        for t in (x, w)
    )


def try_tree_mm(x: Tensor, w: Tensor, leaves: int, out_dtype: torch.dtype = torch.float32) -> Tensor | None:
    """`tree_mm`, or None when the kernel does not build with this Triton (Gluon is experimental and its
    API moves): it is then turned off for the process with one warning, and the caller runs the Triton
    kernel, which gives the same bits."""
    if _disabled:
        return None
    try:
        return tree_mm(x, w, leaves, out_dtype=out_dtype)
    except Exception as e:  # noqa: BLE001 - any compile failure means: use the Triton kernel
        import warnings

        _disabled.append(f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
        warnings.warn(
            f"the Gluon tree kernel did not build ({_disabled[0]}); using the Triton tree kernel (the same bits)",
            RuntimeWarning,
            stacklevel=2,
        )
        return None


class _Plan:
    """`tree_mm` for one plan key (shapes, strides, dtypes, pointer alignment) with the compiled kernel
    kept (see `launch`): per call two allocations, the descriptors from kept shapes, one launch."""

    __slots__ = ("launch", "xd", "wd", "od", "out_shape", "out_dtype", "m", "n", "scratch")

    def __init__(self, plan, xd, wd, od, out_shape, out_dtype, m, n, scratch) -> None:
        self.launch, self.xd, self.wd, self.od = plan, xd, wd, od
        self.out_shape, self.out_dtype, self.m, self.n, self.scratch = out_shape, out_dtype, m, n, scratch

    def __call__(self, x: Tensor, w: Tensor) -> Tensor:
        out_full = torch.empty(self.out_shape, dtype=self.out_dtype, device=x.device)
        scratch = torch.empty(self.scratch, dtype=torch.float32, device=x.device)
        xd, wd = launch.Desc(x, *self.xd), launch.Desc(w, *self.wd)
        od = launch.Desc(out_full, *self.od) if self.od is not None else None
        self.launch(x.device.index, xd, wd, out_full, scratch, od)
        return out_full[: self.m, : self.n]


_PLANS: dict[tuple, _Plan] = {}


def _key(x: Tensor, w: Tensor, leaves: int, out_dtype: torch.dtype) -> tuple:
    return (
        x.shape,
        x.stride(),
        w.shape,
        w.stride(),
        x.dtype,
        leaves,
        out_dtype,
        x.device.index,
        x.data_ptr() % 16 == 0,
        w.data_ptr() % 16 == 0,
    )


def plan(x: Tensor, w: Tensor, leaves: int, out_dtype: torch.dtype = torch.float32) -> _Plan | None:
    """The kept launch of an earlier `tree_mm(x, w, leaves, out_dtype=...)` call with the same plan key."""
    return _PLANS.get(_key(x, w, leaves, out_dtype))


def _setup(x: Tensor, w: Tensor, leaves: int, c: dict, num_programs: int | None, rows: int, routed: bool):
    """The operand descriptors, program count, scratch size, K steps a leaf and constexprs of a launch
    over `rows` rows."""
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    k = x.shape[1]
    if k % (leaves * bk):
        raise ValueError(f"K={k} is not {leaves} leaves of whole BLOCK_K={bk} steps")
    gdt = _GL_DTYPES[x.dtype]
    w_kn = w.stride(1) != 1
    x_desc = _desc(x, [bm, bk], gdt)
    w_desc = _desc(w.t(), [bk, bn], gdt) if w_kn else _desc(w, [bn, bk], gdt)
    tiles = triton.cdiv(rows, bm) * triton.cdiv(w.shape[0], bn)
    if num_programs is None:
        num_programs = (
            _sm_count(x.device.index or 0)
            if x.is_cuda
            else torch.cuda.get_device_properties(x.device).multi_processor_count
        )
    progs = max(1, min(tiles, num_programs))
    scratch_n = progs * bm * bn if leaves == 8 else 1
    # the routed store's 64 KB stage takes a buffer's room, as the park does
    nb = c["NB_PARKED"] if leaves == 8 or routed else c["NB"]
    park = gl.NVMMASharedLayout.get_default_for([bm, bn], gl.float32)
    kw = dict(NUM_LEAVES=leaves, BLOCK_N=bn, W_KN=w_kn, NB=nb, GROUP_M=c["GROUP_M"], PARK_LAYOUT=park)
    kw["num_warps"] = c["num_warps"]
    return x_desc, w_desc, progs, scratch_n, k // leaves // bk, kw


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
if gluon is not None:
    _GL_DTYPES = {k: getattr(gl, v) for k, v in _GL_DTYPES.items()}


def _desc(t: Tensor, block: list[int], gdt) -> TensorDescriptor:
    return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt))


def _fields(d: TensorDescriptor) -> tuple:
    """What a kept plan rebuilds `d` from for another tensor of the same layout (`launch.Desc`)."""
    return list(d.shape), list(d.strides), list(d.block_shape), d.layout


def tree_mm(
    x: Tensor,
    w: Tensor,
    leaves: int,
    cfg: dict | None = None,
    num_programs: int | None = None,
    warmup: bool = False,
    out_dtype: torch.dtype = torch.float32,
):
    """x[M, K] @ w[N, K]^T (w may be a transposed [K, N] view) reduced along the fixed tree of `leaves`
    leaves in fp32 and rounded once to `out_dtype` (see `supports`). `warmup`: compile only and return the
    compiled kernel (with a mock driver this needs no GPU: tests/unit/test_gluon_compile.py)."""
    c = dict(CONFIG, **(cfg or {}))
    bm, bn = c["BLOCK_M"], c["BLOCK_N"]
    m, n = x.shape[0], w.shape[0]
    x_desc, w_desc, progs, scratch_n, steps, kw = _setup(x, w, leaves, c, num_programs, m, False)
    out_full = torch.empty(triton.cdiv(m, bm) * bm, triton.cdiv(n, bn) * bn, dtype=out_dtype, device=x.device)
    scratch = torch.empty(scratch_n, dtype=torch.float32, device=x.device)
    # 8 leaves store by TMA (from the park, which costs no load buffer), fewer from registers: a 64 KB
    # stage would take a buffer, which measured slower at short K (reports/gpu/tp-scaling/README.md)
    o_desc = _desc(out_full, [bm, bn], _GL_DTYPES[out_dtype]) if leaves == 8 else None
    args = (x_desc, w_desc, out_full, scratch, o_desc, *[None] * 7, None, m, n, steps, progs, 0, 0, out_full.stride(0))
    kw.update(C=1, ROUTED=False)
    if warmup:
        return _tree_kernel.warmup(*args, grid=(progs,), **kw)
    first = launch.Launch.first(_tree_kernel, (progs,), args, kw, slots=(0, 1, 2, 3, 4))
    if first is not None and cfg is None and num_programs is None:
        launch.cache_put(
            _PLANS,
            _key(x, w, leaves, out_dtype),
            _Plan(
                first,
                _fields(x_desc),
                _fields(w_desc),
                _fields(o_desc) if o_desc is not None else None,
                tuple(out_full.shape),
                out_dtype,
                m,
                n,
                scratch_n,
            ),
        )
    return out_full[:m, :n]


def tree_mm_routed(
    x: Tensor,
    w: Tensor,
    leaves: int,
    areas: list[Tensor],
    route: Tensor,
    rows: int,
    rank: int,
    warmup: bool = False,
    num_programs: int | None = None,
):
    """`tree_mm` into the all-reduce owners' areas (`peer.PeerTransport.routed_all_reduce`), in fp32:
    areas[j] is owner j's receive area as [C * rows, N] fp32 (a peer's mapping, or this rank's own), this
    rank's slot rows rank * rows .. (rank + 1) * rows. Tile row i of the schedule computes x's tile row
    route[i] = j * rows / BLOCK_M + u (int32; rows past M compute zeros) and stores it by TMA at row
    rank * rows + u * BLOCK_M of areas[j]. Each element is computed as `tree_mm` computes it (the same
    schedule per tile, only its place differs). rows: whole tiles; N: whole BLOCK_N tiles; at most 4
    leaves (the stage takes the park's room). The caller keeps the areas clear of other writers while
    the kernel runs."""
    c = dict(CONFIG)
    bm, bn = c["BLOCK_M"], c["BLOCK_N"]
    n = w.shape[0]
    if n % bn or rows % bm or leaves > 4 or route.dtype != torch.int32:
        raise ValueError("tree_mm_routed: N and rows in whole tiles, up to 4 leaves, int32 routes")
    x_desc, w_desc, progs, scratch_n, steps, kw = _setup(x, w, leaves, c, num_programs, route.numel() * bm, True)
    key = (x.shape, x.stride(), w.shape, w.stride(), x.dtype, leaves, route.numel(), rows, rank, x.device.index)
    key += tuple(a.data_ptr() for a in areas) + (x.data_ptr() % 16 == 0, w.data_ptr() % 16 == 0)
    plan = None if warmup or num_programs is not None else _ROUTED.get(key)
    scratch = torch.empty(scratch_n, dtype=torch.float32, device=x.device)
    if plan is not None:
        first, xd, wd = plan
        first(x.device.index, launch.Desc(x, *xd), launch.Desc(w, *wd), scratch, route)
        return None
    outs = [_desc(a, [bm, bn], gl.float32) for a in areas] + [None] * (8 - len(areas))
    args = (
        x_desc,
        w_desc,
        None,
        scratch,
        *outs,
        route,
        route.numel() * bm,
        n,
        steps,
        progs,
        rows // bm,
        rank * rows,
        n,
    )
    kw.update(C=len(areas), ROUTED=True)
    if warmup:
        return _tree_kernel.warmup(*args, grid=(progs,), **kw)
    first = launch.Launch.first(_tree_kernel, (progs,), args, kw, slots=(0, 1, 3, 12))
    if first is not None and num_programs is None:
        xd = _fields(x_desc)
        wd = _fields(w_desc)
        launch.cache_put(_ROUTED, key, (first, xd, wd))
    return None


# routed plans: the areas' descriptors stay in the plan, so their pointers are in the key (`peer.py` keeps
# every buffer it maps while its transport lives; a plan outliving it is only found again by areas at the
# same addresses, which its descriptors then describe)
_ROUTED: dict[tuple, tuple] = {}


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
