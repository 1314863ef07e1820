"""One Triton matmul kernel for `bio` and `bio+tbik` on GPU (and CPU tensors under TRITON_INTERPRET=1).

out[b] = x[b] @ w[b]^T, fp32 accumulation, written in fp32. Persistent: a fixed grid of programs walks
the output tiles. Each tile's K loop is sequential in BLOCK_K steps over one fixed configuration per
input dtype (no autotune, no split-K, never keyed on shape), so an output element's reduction order
depends only on K: never on M, N, the batch, the tile's position or the other rows.

`_tree_kernel` (the TBIK tree matmul) cuts K into NUM_LEAVES (1, 2, 4, 8) leaves of LEAF columns; the
leaves are unrolled at compile time, each accumulated alone by a branch-free pipelined K loop, and the
finished leaves are added pairwise along a complete binary tree with compile-time carries held in
registers. Its result stays fp32 (the tree all-reduce adds ranks' subtrees before the one cast).
"""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.errors import DetauditError

try:  # optional: GPU kernels and the interpreter tests only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# One fixed config per input dtype (never keyed on shape). Changing one changes bits, so it is part of
# `describe()`. Chosen on an H100 from a sweep of candidates (tiles, warps, stages) by the geometric
# mean of the throughput ratio to cuBLAS over the `detaudit bench kernels` grid.
CONFIGS: dict[torch.dtype, dict[str, int]] = {
    torch.bfloat16: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    torch.float16: dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
}
# The tree kernel (TBIK) uses its own fixed config for every leaf count, so that a rank's subtree is
# computed by the same tiles whatever the TP size.
TREE_CONFIGS: dict[torch.dtype, dict[str, int]] = {
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=4, num_stages=4),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
}
# Small configs for the CPU interpreter (tests only: the interpreter is slow at real tile sizes).
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(batch index, row offsets, column offsets) of a persistent program's tile, grouped along M
        for L2 reuse. Which program computes a tile never changes how the tile is computed."""
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        tiles_per_batch = num_pid_m * num_pid_n
        group = GROUP_M * num_pid_n
        bid = tile // tiles_per_batch
        t = tile % tiles_per_batch
        first_m = (t // group) * GROUP_M
        size_m = min(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + ((t % group) % size_m)
        pid_n = (t % group) // size_m
        return bid, pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)

    @triton.jit
    def _span(x_ptr, w_ptr, rows, cols, start, length, sxm, sxk, swn, swk,
              EVEN: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """fp32 x[rows, start:start+length] @ w[cols, start:start+length]^T, accumulated sequentially in
        BLOCK_K steps from zero: the one reduction order of every output element (a leaf, or all of K)."""
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = x_ptr + rows[:, None] * sxm + (start + offs_k)[None, :] * sxk
        b_ptrs = w_ptr + (start + offs_k)[:, None] * swk + cols[None, :] * swn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(0, tl.cdiv(length, BLOCK_K)):
            if EVEN:
                a = tl.load(a_ptrs)
                b = tl.load(b_ptrs)
            else:
                left = length - kk * BLOCK_K
                a = tl.load(a_ptrs, mask=offs_k[None, :] < left, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < left, other=0.0)
            if UPCAST:  # the CPU interpreter cannot multiply bf16 (numpy has none); bf16 x bf16 is exact in fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * sxk
            b_ptrs += BLOCK_K * swk
        return acc

    @triton.jit
    def _store(out_ptr, offs_m, offs_n, M, N, som, son, value):
        mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
        tl.store(out_ptr + offs_m[:, None] * som + offs_n[None, :] * son, value.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _mm_kernel(
        x_ptr, w_ptr, out_ptr,
        BATCH, M, N, K,
        sxb, sxm, sxk, swb, swn, swk, sob, som, son,
        NUM_PROGRAMS,
        EVEN_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        total = BATCH * tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
        for tile in range(tl.program_id(0), total, NUM_PROGRAMS):
            bid, offs_m, offs_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
            # out-of-range rows/cols read valid data and are never stored: an output element depends
            # only on its own row and column
            acc = _span(x_ptr + bid * sxb, w_ptr + bid * swb, offs_m % M, offs_n % N, 0, K, sxm, sxk, swn, swk,
                        EVEN_K, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
            _store(out_ptr + bid * sob, offs_m, offs_n, M, N, som, son, acc)  # one rounding (RNE) to out's dtype


if triton is not None:

    @triton.jit
    def _tree_kernel(
        x_ptr, w_ptr, out_ptr,
        BATCH, M, N, LEAF,
        sxb, sxm, sxk, swb, swn, swk, sob, som, son,
        NUM_PROGRAMS,
        NUM_LEAVES: tl.constexpr, EVEN_LEAF: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
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
                acc = _span(x_ptr + bid * sxb, w_ptr + bid * swb, offs_m % M, offs_n % N, j * LEAF, LEAF,
                            sxm, sxk, swn, swk, EVEN_LEAF, PRECISION, UPCAST, BLOCK_M, BLOCK_N, BLOCK_K)
                # carry the finished leaf up the tree (j is a compile-time constant)
                if j % 2 == 0:
                    s0 = acc
                    node = acc
                else:
                    node = s0 + acc  # level 1
                    if j % 4 == 1:
                        s1 = node
                    else:
                        node = s1 + node  # level 2
                        if j % 8 == 3:
                            s2 = node
                        else:
                            node = s2 + node  # level 3
            _store(out_ptr + bid * sob, offs_m, offs_n, M, N, som, son, node)


def _num_programs(device: torch.device, tiles: int) -> int:
    if device.type == "cuda":
        return max(1, min(tiles, torch.cuda.get_device_properties(device).multi_processor_count * 2))
    return max(1, min(tiles, 4))  # interpreter


def mm(x: Tensor, w: Tensor, leaves: int = 1, config: dict[str, int] | None = None, tree: bool = False,
       out_dtype: torch.dtype = torch.float32) -> Tensor:
    """x @ w^T for x[B?, M, K], w[B?, N, K] (w may be a strided view, e.g. a transpose), accumulated in
    fp32 and stored as `out_dtype` (the store rounds once, like a cast); with `leaves` > 1 the K reduction
    is the fixed tree of `leaves` equal leaves (tree results are always fp32)."""
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
    cfg = dict(config or (INTERPRET_CONFIG if interpret else (TREE_CONFIGS if tree else CONFIGS)[x.dtype]))
    # tree results stay fp32; the interpreter's fp32 -> bf16 store does not round like torch, so it
    # stores fp32 and torch rounds below
    out = torch.empty(batch, m, n, dtype=torch.float32 if (tree or interpret) else out_dtype, device=x.device)
    if m and n and batch:
        leaf = k // leaves
        tiles = batch * triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
        progs = _num_programs(x.device, tiles)
        strides = (*x3.stride(), *w3.stride(), *out.stride())
        common = dict(PRECISION="ieee" if (x.dtype == torch.float32 or interpret) else "tf32", UPCAST=interpret, **cfg)
        if tree:
            _tree_kernel[(progs,)](x3, w3, out, batch, m, n, leaf, *strides, progs,
                                   NUM_LEAVES=leaves, EVEN_LEAF=leaf % cfg["BLOCK_K"] == 0, **common)
        else:
            _mm_kernel[(progs,)](x3, w3, out, batch, m, n, k, *strides, progs, EVEN_K=k % cfg["BLOCK_K"] == 0, **common)
    if not tree:
        out = out.to(out_dtype)  # a no-op unless the interpreter stored fp32
    return out[0] if squeeze else out


def describe(tree: bool = False) -> str:
    return "; ".join(f"{str(dt).removeprefix('torch.')}: " + ", ".join(f"{k}={v}" for k, v in c.items())
                     for dt, c in (TREE_CONFIGS if tree else CONFIGS).items())
