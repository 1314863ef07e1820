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
tiles (the stores need no masks: 64 predicates would cost registers).
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from detaudit.backends.kernels import launch

try:  # Gluon is experimental in Triton; where it is missing the Triton kernels run instead
    import triton
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    # the TMA load is async_copy_global_to_shared in Triton 3.6 (the GPU machines), async_load in 3.9
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
except ImportError:  # pragma: no cover - depends on the install
    gluon = None

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
        pid,
        NP,
        num_pid_m,
        num_pid_n,
        total,
        KSTEPS,
        NB: gl.constexpr,
        W_KN: gl.constexpr,
        GROUP_M: gl.constexpr,
    ):
        """The load warp: flat step g (tile pid + (g // KSTEPS) * NP, K step g % KSTEPS) into buffer
        g % NB, once the MMA warps have released that buffer's previous step."""
        BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
        for g in range(total):
            idx = g % NB
            mbarrier.wait(empty.index(idx), ((g // NB) & 1) ^ 1)  # a fresh barrier passes parity 1
            pid_m, pid_n = _tile_of(pid + (g // KSTEPS) * NP, num_pid_m, num_pid_n, GROUP_M)
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
        num_warps: gl.constexpr,
    ):
        """The MMA warps: each leaf LEAF_STEPS wgmma steps from zero (one in flight while the next is
        issued), then carried up the tree in binary-counter order (leaf j is a compile-time constant)."""
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
            _store_tile(out_ptr, pid_m, pid_n, LD, node.to(out_ptr.dtype.element_ty))  # one RNE rounding

    @gluon.jit
    def _tree_kernel(
        x_desc,
        w_desc,
        out_ptr,
        scratch_ptr,
        M,
        N,
        LEAF_STEPS,
        NP,
        LD: gl.constexpr,
        NUM_LEAVES: gl.constexpr,
        BLOCK_N: gl.constexpr,
        W_KN: gl.constexpr,
        NB: gl.constexpr,
        GROUP_M: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        """Persistent: program pid computes output tiles pid, pid + NP, ..."""
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
        # the park for the node of leaves 4..5 (8 leaves only; a token allocation otherwise). Swizzled so
        # that a warp's store of an accumulator register pair (8 rows x 8 columns) hits every bank twice,
        # the minimum for 256 bytes: 8-column units XORed with the row (unswizzled rows share banks).
        PARK_M: gl.constexpr = BLOCK_M if NUM_LEAVES == 8 else 8
        PARK_N: gl.constexpr = BLOCK_N if NUM_LEAVES == 8 else 8
        park = gl.allocate_shared_memory(
            gl.float32, [PARK_M, PARK_N], gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=8, order=[1, 0])
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
                        pid,
                        NP,
                        num_pid_m,
                        num_pid_n,
                        my_tiles * KSTEPS,
                        KSTEPS,
                        NB,
                        W_KN,
                        GROUP_M,
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
    kept (see `launch`): per call two allocations, two descriptors from kept shapes, one launch."""

    __slots__ = ("launch", "xd", "wd", "out_shape", "out_dtype", "m", "n", "scratch")

    def __init__(self, plan, xd, wd, out_shape, out_dtype, m, n, scratch) -> None:
        self.launch, self.xd, self.wd = plan, xd, wd
        self.out_shape, self.out_dtype, self.m, self.n, self.scratch = out_shape, out_dtype, m, n, scratch

    def __call__(self, x: Tensor, w: Tensor) -> Tensor:
        out_full = torch.empty(self.out_shape, dtype=self.out_dtype, device=x.device)
        scratch = torch.empty(self.scratch, dtype=torch.float32, device=x.device)
        self.launch(x.device.index, launch.Desc(x, *self.xd), launch.Desc(w, *self.wd), out_full, scratch)
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
    bm, bn, bk = c["BLOCK_M"], c["BLOCK_N"], c["BLOCK_K"]
    nb = c["NB_PARKED"] if leaves == 8 else c["NB"]
    m, k = x.shape
    n = w.shape[0]
    if k % (leaves * bk):
        raise ValueError(f"K={k} is not {leaves} leaves of whole BLOCK_K={bk} steps")
    gdt = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[x.dtype]
    out_full = torch.empty(triton.cdiv(m, bm) * bm, triton.cdiv(n, bn) * bn, dtype=out_dtype, device=x.device)
    w_kn = w.stride(1) != 1

    def desc(t: Tensor, block: list[int]) -> TensorDescriptor:
        return TensorDescriptor.from_tensor(t, block, gl.NVMMASharedLayout.get_default_for(block, gdt))

    x_desc = desc(x, [bm, bk])
    w_desc = desc(w.t(), [bk, bn]) if w_kn else desc(w, [bn, bk])
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    default_progs = num_programs is None
    if num_programs is None:
        num_programs = (
            _sm_count(x.device.index or 0)
            if x.is_cuda
            else torch.cuda.get_device_properties(x.device).multi_processor_count
        )
    progs = max(1, min(tiles, num_programs))
    scratch_n = progs * bm * bn if leaves == 8 else 1
    scratch = torch.empty(scratch_n, dtype=torch.float32, device=x.device)
    args = (x_desc, w_desc, out_full, scratch, m, n, k // leaves // bk, progs, out_full.stride(0))
    kw = dict(NUM_LEAVES=leaves, BLOCK_N=bn, W_KN=w_kn, NB=nb, GROUP_M=c["GROUP_M"], num_warps=c["num_warps"])
    if warmup:
        return _tree_kernel.warmup(*args, grid=(progs,), **kw)
    first = launch.Launch.first(_tree_kernel, (progs,), args, kw, slots=(0, 1, 2, 3))
    if first is not None and cfg is None and default_progs:
        launch.cache_put(
            _PLANS,
            _key(x, w, leaves, out_dtype),
            _Plan(
                first,
                (list(x_desc.shape), list(x_desc.strides), list(x_desc.block_shape), x_desc.layout),
                (list(w_desc.shape), list(w_desc.strides), list(w_desc.block_shape), w_desc.layout),
                tuple(out_full.shape),
                out_dtype,
                m,
                n,
                scratch_n,
            ),
        )
    return out_full[:m, :n]


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count
