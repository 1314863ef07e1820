"""The Triton matmul kernels of `bio` and `bio+tbik` on GPU (and CPU tensors under TRITON_INTERPRET=1).

out[b] = x[b] @ w[b]^T, fp32 accumulation, rounded once to the output's dtype in the store.
Persistent: a fixed grid of programs walks the output tiles (bf16 / fp16 products of up to 32 rows run
`triton_swap`'s kernel instead, one program a tile, the same reduction). Each tile's K loop is sequential in
BLOCK_K steps over one fixed configuration per input dtype (no autotune, no split-K, never keyed on
shape), so an output element's reduction order depends only on K: never on M, N, the batch, the tile's
position or the other rows.

`_tree_kernel` (the TBIK tree matmul) cuts K into NUM_LEAVES (1, 2, 4, 8) leaves of LEAF columns; the
leaves are unrolled at compile time, each accumulated alone by a branch-free pipelined K loop, and the
finished leaves are added pairwise along a complete binary tree with compile-time carries held in
registers. A rank's subtree stays fp32 (the tree all-reduce adds ranks' subtrees before the one cast);
a TP-1 layer's whole tree is rounded once to the model dtype in the store.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from detaudit.backends.kernels import gluon_tree, launch, triton_swap
from detaudit.backends.kernels.triton_carry import carry as _carry
from detaudit.backends.kernels.triton_carry import span as _span
from detaudit.errors import DetauditError

try:  # optional: GPU kernels and the interpreter tests only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# The reduction is fixed per dtype, never keyed on shape: each output element is one fp32 accumulator
# from zero, fed one K = 16 wgmma slice per instruction in K order, no split-K; BLOCK_K only groups
# slices per loop step. So the output tiling may follow M without changing an element's sum: `TILINGS`
# holds rules (max M, min N, config), first match wins. TMA=1 (Hopper, 2-D bf16/fp16) loads through
# descriptors (`_tma_kernel`, WS = warp specialised); MASK_M: rows past M are not loaded. tests/gpu checks
# every tiling and both load paths bitwise; each tiling was chosen from timing sweeps on an H100 at its M
# range. The configs are part of `describe()`.
_SMALL_M = dict(BLOCK_M=64, BLOCK_N=32, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=8, TMA=0, MASK_M=1)
_NARROW = dict(_SMALL_M, BLOCK_N=16)
_MID_M = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=5, TMA=0)
_LARGE_M = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3, TMA=1, WS=1)
_FP32 = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
Tilings = tuple[tuple[int | None, int, dict[str, int]], ...]
# Up to 32 rows (decode; one 2-D bf16 / fp16 product): the weight's rows on the MMA's M side (`triton_swap`,
# SWAP=1), BLOCK_M rows of tokens on its N side. BLOCK_N = 64 keeps Hopper's wgmma (64 rows a warpgroup),
# the instruction every other tiling runs; 32 would fall back to mma.sync. Timed on an H100 at Qwen3-8B's
# TP 1/2/4 shards, M = 8 and 32 (a one-off sweep of BLOCK_N 32-128, BLOCK_K 64-256, 3-8 stages; every
# config the same bits): 0.9-1.2x cuBLAS on column products and 0.76-1.0x on the tree, from 0.68-1.04x and
# 0.72-0.97x with `_SMALL_M` / `_NARROW` (32-column tree tiles were up to 7% faster than 64 on mma.sync).
_SWAP16 = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=6, SWAP=1)
_SWAP32 = dict(_SWAP16, BLOCK_M=32)
_HALF: Tilings = (
    (16, 0, _SWAP16),
    (32, 0, _SWAP32),
    (64, 4096, _SMALL_M),
    (64, 0, _NARROW),
    (1024, 0, _MID_M),
    (None, 0, _LARGE_M),
)
TILINGS: dict[torch.dtype, Tilings] = {torch.bfloat16: _HALF, torch.float16: _HALF, torch.float32: ((None, 0, _FP32),)}
CONFIGS: dict[torch.dtype, dict[str, int]] = {dt: t[-1][2] for dt, t in TILINGS.items()}  # the large-M tiling
# The tree kernel (TBIK): the same rules over its leaves; pointer loads at large M, or on Hopper
# (GLUON=1) the warp-specialised Gluon kernel of `gluon_tree`, same bits.
_TREE_LARGE = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4, GLUON=1)
_TREE_HALF: Tilings = (
    (16, 0, _SWAP16),
    (32, 0, _SWAP32),
    (64, 4096, dict(_SMALL_M, num_stages=6)),
    (64, 0, _NARROW),
    (256, 0, _MID_M),
    (None, 0, _TREE_LARGE),
)
TREE_TILINGS: dict[torch.dtype, Tilings] = {
    torch.bfloat16: _TREE_HALF,
    torch.float16: _TREE_HALF,
    torch.float32: TILINGS[torch.float32],
}
TREE_CONFIGS: dict[torch.dtype, dict[str, int]] = {dt: t[-1][2] for dt, t in TREE_TILINGS.items()}
# Batched products of few rows (a MoE layer's experts in a decode step: [E, T, K] @ [E, N, K]^T) stream
# every expert's weight once; the batch, not narrow tiles, gives the programs their work. Measured on an
# H100 at Qwen3-30B-A3B's expert shapes (128 experts, 8 rows; one-off sweep, every config the same bits):
# 16-column tiles streamed 1.0-1.5 TB/s, 64 columns x BLOCK_K 128 2.8-2.95 TB/s (cuBLAS bmm 2.7-2.8);
# at K <= 128 (a tree leaf of an expert) BLOCK_K 32 with 8 programs an SM 2.1 TB/s against 0.2.
# PER_SM: persistent programs per SM.
_BATCHED = dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=3, MASK_M=1, PER_SM=2)
_BATCHED_SHORT_K = dict(_BATCHED, BLOCK_K=32, num_stages=4, PER_SM=8)
BATCHED_MIN = 8  # batches of at least this many products of at most 64 rows take `batched_tiling`


def batched_tiling(dtype: torch.dtype, batch: int, m: int, k: int) -> dict[str, int] | None:
    """The config of a batched half-precision product of few rows (see _BATCHED), or None."""
    if dtype not in (torch.bfloat16, torch.float16) or batch < BATCHED_MIN or m > 64:
        return None
    return _BATCHED_SHORT_K if k <= 128 else _BATCHED


def tiling(dtype: torch.dtype, m: int, tree: bool = False, n: int | None = None, swap: bool = True) -> dict[str, int]:
    """The fixed config for a product with m rows and n output columns (see TILINGS; n unknown: the
    first rule for m; `swap` False: not the swapped kernel, which takes one 2-D product)."""
    for max_m, min_n, cfg in (TREE_TILINGS if tree else TILINGS)[dtype]:
        if (max_m is None or m <= max_m) and (n is None or n >= min_n) and (swap or not cfg.get("SWAP")):
            return cfg
    raise AssertionError("the last tiling has no bound")


# Small configs for the CPU interpreter (tests only: the interpreter is slow at real tile sizes).
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _tile_ids(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(batch index, tile row, tile column) of a persistent program's tile, grouped along M for L2
        reuse. Which program computes a tile never changes how the tile is computed."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        tiles_per_batch = num_pid_m * num_pid_n
        group = GROUP_M * num_pid_n
        bid = tile // tiles_per_batch
        t = tile % tiles_per_batch
        first_m = (t // group) * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        return bid, first_m + ((t % group) % size_m), (t % group) // size_m

    @triton.jit
    def _tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(batch index, row offsets, column offsets) of a tile (see `_tile_ids`)."""
        bid, pid_m, pid_n = _tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        return bid, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def _store(out_ptr, offs_m, offs_n, M, N, som, son, value):
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptr + offs_m[:, None] * som + offs_n[None, :] * son, value.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _mm_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        BATCH,
        M,
        N,
        K,
        sxb,
        sxm,
        sxk,
        swb,
        swn,
        swk,
        sob,
        som,
        son,
        NUM_PROGRAMS,
        EVEN_K: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        MASK_M: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        total = BATCH * tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in range(tl.program_id(0), total, NUM_PROGRAMS):
            bid, offs_m, offs_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            # out-of-range rows/cols read valid data and are never stored: an output element depends
            # only on its own row and column
            acc = _span(
                x_ptr + bid * sxb,
                w_ptr + bid * swb,
                offs_m,
                M,
                offs_n % N,
                0,
                K,
                sxm,
                sxk,
                swn,
                swk,
                EVEN_K,
                PRECISION,
                UPCAST,
                MASK_M,
                BLOCK_M,
                BLOCK_N,
                BLOCK_K,
            )
            _store(out_ptr + bid * sob, offs_m, offs_n, M, N, som, son, acc)  # one rounding (RNE) to out's dtype


if triton is not None:

    @triton.jit
    def _span_desc(
        x_desc,
        w_desc,
        off_m,
        off_n,
        start,
        length,
        W_KN: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """`_span` with TMA loads (Hopper+): the same sequential BLOCK_K steps from zero; the hardware
        zero-fills rows and columns past the tensor's edge, and zeros add nothing to a sum."""
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(length, BLOCK_K)):
            k = start + kk * BLOCK_K
            a = x_desc.load([off_m, k])
            if W_KN:  # the weight arrives transposed: [K, N] rows
                b = w_desc.load([k, off_n])
            else:
                b = w_desc.load([off_n, k]).T
            acc = tl.dot(a, b, acc)
        return acc

    @triton.jit
    def _tma_kernel(
        x_desc,
        w_desc,
        out_ptr,
        M,
        N,
        K,
        LEAF,
        som,
        son,
        NUM_PROGRAMS,
        NUM_LEAVES: tl.constexpr,
        W_KN: tl.constexpr,
        FLATTEN: tl.constexpr,
        WS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """Both kernels for one 2-D product on Hopper and later, with TMA loads: NUM_LEAVES == 1 is the
        plain bio matmul over all of K, more leaves the tree matmul (leaves of LEAF columns, LEAF a
        multiple of BLOCK_K). Per output element the same reduction as `_mm_kernel` / `_tree_kernel`."""
        total = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in tl.range(tl.program_id(0), total, NUM_PROGRAMS, flatten=FLATTEN, warp_specialize=WS):
            _, pid_m, pid_n = _tile_ids(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N
            if NUM_LEAVES == 1:
                node = _span_desc(x_desc, w_desc, off_m, off_n, 0, K, W_KN, BLOCK_M, BLOCK_N, BLOCK_K)
            else:
                s0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                s1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                s2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                node = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for j in tl.static_range(NUM_LEAVES):
                    acc = _span_desc(x_desc, w_desc, off_m, off_n, j * LEAF, LEAF, W_KN, BLOCK_M, BLOCK_N, BLOCK_K)
                    s0, s1, s2, node = _carry(j, acc, s0, s1, s2, node)
            _store(out_ptr, off_m + tl.arange(0, BLOCK_M), off_n + tl.arange(0, BLOCK_N), M, N, som, son, node)

    @triton.jit
    def _tree_kernel(
        x_ptr,
        w_ptr,
        out_ptr,
        BATCH,
        M,
        N,
        LEAF,
        sxb,
        sxm,
        sxk,
        swb,
        swn,
        swk,
        sob,
        som,
        son,
        NUM_PROGRAMS,
        NUM_LEAVES: tl.constexpr,
        EVEN_LEAF: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        MASK_M: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
    ):
        """The tree matmul with the leaves unrolled (static_range): each leaf is its own branch-free,
        software-pipelined K loop, and the binary-counter carries are chosen at compile time, so the
        finished nodes live in registers (at most log2(NUM_LEAVES) + 1 fp32 tiles). A leaf is `_span`
        over its LEAF columns (BLOCK_K steps from zero); leaves are then added pairwise up the tree."""
        total = BATCH * tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in range(tl.program_id(0), total, NUM_PROGRAMS):
            bid, offs_m, offs_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            s0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            s1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            s2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            node = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for j in tl.static_range(NUM_LEAVES):
                acc = _span(
                    x_ptr + bid * sxb,
                    w_ptr + bid * swb,
                    offs_m,
                    M,
                    offs_n % N,
                    j * LEAF,
                    LEAF,
                    sxm,
                    sxk,
                    swn,
                    swk,
                    EVEN_LEAF,
                    PRECISION,
                    UPCAST,
                    MASK_M,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                )
                s0, s1, s2, node = _carry(j, acc, s0, s1, s2, node)
            _store(out_ptr + bid * sob, offs_m, offs_n, M, N, som, son, node)


@functools.lru_cache(maxsize=None)
def _device_info(index: int) -> tuple[int, int]:
    """(SM count, major compute capability) of a CUDA device, asked once."""
    props = torch.cuda.get_device_properties(index)
    return props.multi_processor_count, props.major


def _num_programs(device: torch.device, tiles: int, per_sm: int = 2) -> int:
    if device.type == "cuda":
        return max(1, min(tiles, _device_info(device.index or 0)[0] * per_sm))
    return max(1, min(tiles, 4))  # interpreter


def _launch_args(cfg: dict[str, int]) -> dict[str, int]:
    """A config less its kernel-choice flags (TMA, FLATTEN, WS, MASK_M, GLUON, PER_SM, SWAP)."""
    return {k: v for k, v in cfg.items() if k not in ("TMA", "FLATTEN", "WS", "MASK_M", "GLUON", "PER_SM", "SWAP")}


def _tma_ready(t: Tensor) -> bool:
    """A TMA descriptor needs a 16-byte aligned base, unit stride in one dimension and 16-byte aligned
    strides in the other."""
    inner = 1 if t.stride(1) == 1 else 0
    return t.stride(inner) == 1 and t.data_ptr() % 16 == 0 and (t.stride(1 - inner) * t.element_size()) % 16 == 0


def _use_tma(x3: Tensor, w3: Tensor, cfg: dict[str, int], leaf: int) -> bool:
    return (
        bool(cfg.get("TMA"))
        and x3.is_cuda
        and x3.shape[0] == 1
        and x3.dtype in (torch.bfloat16, torch.float16)
        and _device_info(x3.device.index or 0)[1] >= 9
        and leaf % cfg["BLOCK_K"] == 0
        and x3[0].stride(1) == 1
        and _tma_ready(x3[0])
        and _tma_ready(w3[0])
    )


def _launch_tma(x: Tensor, w: Tensor, out: Tensor, leaves: int, leaf: int, cfg: dict[str, int]) -> launch.Launch | None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    w_kn = w.stride(1) != 1  # a transposed view: describe it as the [K, N] tensor it is
    x_desc = TensorDescriptor.from_tensor(x, [bm, bk])
    w_desc = TensorDescriptor.from_tensor(w.t(), [bk, bn]) if w_kn else TensorDescriptor.from_tensor(w, [bn, bk])
    m, n = out.shape
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    progs = _num_programs(x.device, tiles, per_sm=1)
    plan = launch.Launch.first(
        _tma_kernel,
        (progs,),
        (x_desc, w_desc, out, m, n, x.shape[1], leaf, *out.stride(), progs),
        dict(
            NUM_LEAVES=leaves,
            W_KN=w_kn,
            FLATTEN=bool(cfg.get("FLATTEN")) and leaves == 1,
            WS=bool(cfg.get("WS")),
            **_launch_args(cfg),
        ),
        slots=(0, 1, 2),
    )
    if plan is None:
        return None
    xd = (list(x_desc.shape), list(x_desc.strides), list(x_desc.block_shape))
    wd = (list(w_desc.shape), list(w_desc.strides), list(w_desc.block_shape))
    return _TmaPlan(plan, xd, wd)


class _Plan:
    """A pointer-kernel product of one plan key: allocate the output, launch the kept kernel."""

    __slots__ = ("launch", "out_shape", "out_dtype")

    def __init__(self, plan: launch.Launch, out_shape: tuple[int, ...], out_dtype: torch.dtype) -> None:
        self.launch, self.out_shape, self.out_dtype = plan, out_shape, out_dtype

    def __call__(self, x: Tensor, w: Tensor) -> Tensor:
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=x.device)
        self.launch(x.device.index, x, w, out)
        return out


class _TmaPlan:
    """The TMA kernel of one plan key: descriptors rebuilt per call from the kept shapes and strides
    (only the base pointers change; the launcher encodes the CUtensorMap)."""

    __slots__ = ("launch", "xd", "wd", "out_shape", "out_dtype")

    def __init__(self, plan: launch.Launch, xd: tuple, wd: tuple) -> None:
        self.launch, self.xd, self.wd = plan, xd, wd
        self.out_shape: tuple[int, ...] = ()
        self.out_dtype = torch.float32

    def __call__(self, x: Tensor, w: Tensor) -> Tensor:
        out = torch.empty(self.out_shape, dtype=self.out_dtype, device=x.device)
        self.launch(x.device.index, launch.Desc(x, *self.xd), launch.Desc(w, *self.wd), out)
        return out


class _GluonPlan:
    __slots__ = ("fn",)

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self, x: Tensor, w: Tensor) -> Tensor:
        return self.fn(x, w).contiguous()


# plan key -> plan: a product whose shapes, strides, dtypes and pointer alignment were seen before is
# launched without the JIT's per-call binding (see `launch`)
_PLANS: dict[tuple, _Plan | _TmaPlan | _GluonPlan] = {}


def _plan_key(x: Tensor, w: Tensor, leaves: int, tree: bool, out_dtype: torch.dtype) -> tuple:
    return (
        x.shape,
        x.stride(),
        w.shape,
        w.stride(),
        x.dtype,
        w.dtype,
        leaves,
        tree,
        out_dtype,
        x.device.index,
        x.data_ptr() % 16 == 0,
        w.data_ptr() % 16 == 0,
    )


def mm(
    x: Tensor,
    w: Tensor,
    leaves: int = 1,
    config: dict[str, int] | None = None,
    tree: bool = False,
    out_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """x @ w^T for x[B?, M, K], w[B?, N, K] (w may be a strided view, e.g. a transpose), accumulated in
    fp32 and stored as `out_dtype` (the store rounds once, like a cast); with `leaves` > 1 (or `tree`) the
    K reduction is the fixed tree of `leaves` equal leaves.

    On GPU, the first call of a plan key (shapes, strides, dtypes, pointer alignment) launches through
    the JIT and keeps the compiled kernel; later calls launch it directly (`launch`): the same kernel
    with the same arguments, without ~50 us of per-call Python. An explicit `config` never uses plans."""
    if config is None and x.is_cuda:
        key = _plan_key(x, w, leaves, tree, out_dtype)
        plan = _PLANS.get(key)
        if plan is not None:
            return plan(x, w)
        return _mm(x, w, leaves, None, tree, out_dtype, key)
    return _mm(x, w, leaves, config, tree, out_dtype, None)


def _mm(
    x: Tensor,
    w: Tensor,
    leaves: int,
    config: dict[str, int] | None,
    tree: bool,
    out_dtype: torch.dtype,
    key: tuple | None,
) -> Tensor:
    if triton is None:
        raise DetauditError("the GPU kernels need triton (pip install 'detaudit[triton]')")
    if x.dtype != w.dtype:
        raise DetauditError(f"matmul operands differ in dtype: {x.dtype} vs {w.dtype}")
    if x.dtype not in CONFIGS:
        raise DetauditError(f"no matmul config for {x.dtype}")
    squeeze = x.dim() == 2
    x3 = x.unsqueeze(0) if squeeze else x
    w3 = w.unsqueeze(0) if w.dim() == 2 else w
    batch, m, k = x3.shape
    n = w3.shape[1]
    if w3.shape[0] == 1 and batch > 1:
        w3 = w3.expand(batch, n, k)
    if k % leaves:
        raise DetauditError(f"K={k} does not split into {leaves} leaves")
    if leaves > 8 or leaves & (leaves - 1):
        raise DetauditError(f"the tree kernel takes 1, 2, 4 or 8 leaves, got {leaves}")
    tree = tree or leaves > 1
    interpret = x.device.type == "cpu"  # TRITON_INTERPRET on CPU tensors
    batched = None if (config or interpret or tree) else batched_tiling(x.dtype, batch, m, k)
    cfg = dict(config or (INTERPRET_CONFIG if interpret else batched or tiling(x.dtype, m, tree, n, batch == 1)))
    if cfg.get("SWAP") and batch != 1:
        raise DetauditError("a swapped (SWAP=1) config takes one 2-D product, not a batch")
    leaf = k // leaves
    if m and n and batch == 1 and tree and cfg.get("GLUON") and gluon_tree.supports(x3[0], w3[0], leaves):
        # the Gluon tree kernel (Hopper, many rows): the same bits as the Triton kernel's
        fast = gluon_tree.try_tree_mm(x3[0], w3[0], leaves, out_dtype)
        if fast is not None:
            if key is not None and squeeze and w.dim() == 2:  # (a batch of one 3-D x: the JIT each time)
                g = gluon_tree.plan(x, w, leaves, out_dtype)
                if g is not None:
                    launch.cache_put(_PLANS, key, _GluonPlan(g))
            return fast.contiguous() if squeeze else fast.contiguous().unsqueeze(0)
    # the interpreter's fp32 -> bf16 store does not round like torch, so it stores fp32 and torch rounds
    # below
    store_dtype = torch.float32 if interpret else out_dtype
    out = torch.empty(batch, m, n, dtype=store_dtype, device=x.device)
    plan: _Plan | _TmaPlan | None = None
    if m and n and cfg.get("SWAP"):
        swapped = triton_swap.first(x3[0], w3[0], out[0], leaves, cfg)
        if swapped is not None:
            plan = _Plan(swapped, (m, n) if squeeze else (1, m, n), store_dtype)
    elif m and n and batch and _use_tma(x3, w3, cfg, leaf):
        tma = _launch_tma(x3[0], w3[0], out[0], leaves, leaf, cfg)
        if tma is not None and squeeze:
            tma.out_shape, tma.out_dtype = (m, n), store_dtype
            plan = tma
    elif m and n and batch:
        mask_m, per_sm = bool(cfg.get("MASK_M")), cfg.get("PER_SM", 2)
        cfg = _launch_args(cfg)
        tiles = batch * triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
        progs = _num_programs(x.device, tiles, per_sm)
        strides = (*x3.stride(), *w3.stride(), *out.stride())
        common = dict(
            PRECISION="ieee" if (x.dtype == torch.float32 or interpret) else "tf32",
            UPCAST=interpret,
            MASK_M=mask_m,
            **cfg,
        )
        if tree:
            first = launch.Launch.first(
                _tree_kernel,
                (progs,),
                (x3, w3, out, batch, m, n, leaf, *strides, progs),
                dict(NUM_LEAVES=leaves, EVEN_LEAF=leaf % cfg["BLOCK_K"] == 0, **common),
                slots=(0, 1, 2),
            )
        else:
            first = launch.Launch.first(
                _mm_kernel,
                (progs,),
                (x3, w3, out, batch, m, n, k, *strides, progs),
                dict(EVEN_K=k % cfg["BLOCK_K"] == 0, **common),
                slots=(0, 1, 2),
            )
        if first is not None:
            # the kernel reads x, w and out through their pointers only (strides are arguments): the
            # plan passes the caller's tensors and allocates out in the shape it returns
            plan = _Plan(first, (m, n) if squeeze else (batch, m, n), store_dtype)
    if plan is not None and key is not None:
        launch.cache_put(_PLANS, key, plan)
    out = out.to(out_dtype)  # a no-op unless the interpreter stored fp32
    return out[0] if squeeze else out


def describe(tree: bool = False) -> str:
    def rule(max_m: int | None, min_n: int, c: dict) -> str:
        when = ("larger M" if max_m is None else f"M<={max_m}") + (f", N>={min_n}" if min_n else "")
        return f"{when}: " + " ".join(f"{k}={v}" for k, v in c.items())

    text = "; ".join(
        f"{str(dt).removeprefix('torch.')}: " + " | ".join(rule(*r) for r in t)
        for dt, t in (TREE_TILINGS if tree else TILINGS).items()
    )
    if tree:
        return text
    short = " ".join(f"{k}={v}" for k, v in _BATCHED_SHORT_K.items())
    return (
        f"{text}; batches of >= {BATCHED_MIN} products of M<=64 (bf16/fp16): "
        f"{' '.join(f'{k}={v}' for k, v in _BATCHED.items())} | K<=128: {short}"
    )
