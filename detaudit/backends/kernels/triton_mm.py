"""One Triton matmul kernel for `bio` and `bio+tbik` on GPU (and CPU tensors under TRITON_INTERPRET=1).

out[b] = x[b] @ w[b]^T, fp32 accumulation, written in fp32. Persistent: a fixed grid of programs walks
the output tiles. Each tile's K loop is sequential in BLOCK_K steps over one fixed configuration per
input dtype (no autotune, no split-K, never keyed on shape), so an output element's reduction order
depends only on K: never on M, N, the batch, the tile's position or the other rows.

With NUM_LEAVES > 1 (the TBIK tree matmul) K is cut into NUM_LEAVES leaves of LEAF columns; a leaf is
accumulated alone and finished leaves are added pairwise along a complete binary tree by a binary
counter inside one flat K loop (the level-0 carry in registers, level-1 and level-2 nodes parked in
global fp32 tiles), so two fp32 tiles are live. NUM_LEAVES = 1 is the plain batch-invariant matmul.
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
    torch.bfloat16: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    torch.float16: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4),
    torch.float32: dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3),
}
# Small configs for the CPU interpreter (tests only: the interpreter is slow at real tile sizes).
INTERPRET_CONFIG = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1)


def available() -> bool:
    return triton is not None


if triton is not None:

    @triton.jit
    def _mm_kernel(
        x_ptr, w_ptr, out_ptr, park_ptr,
        BATCH, M, N, LEAF,
        sxb, sxm, sxk, swb, swn, swk, sob, som, son,
        NUM_PROGRAMS,
        NUM_LEAVES: tl.constexpr, EVEN_LEAF: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        num_pid_m = tl.cdiv(M, BLOCK_M)
        num_pid_n = tl.cdiv(N, BLOCK_N)
        tiles_per_batch = num_pid_m * num_pid_n
        total = BATCH * tiles_per_batch
        group = GROUP_M * num_pid_n
        leaf_iters = tl.cdiv(LEAF, BLOCK_K)
        offs_k = tl.arange(0, BLOCK_K)
        for tile in range(tl.program_id(0), total, NUM_PROGRAMS):
            bid = tile // tiles_per_batch
            t = tile % tiles_per_batch
            first_m = (t // group) * GROUP_M
            size_m = min(num_pid_m - first_m, GROUP_M)
            pid_m = first_m + ((t % group) % size_m)
            pid_n = (t % group) // size_m
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            rows = offs_m % M  # out-of-range rows/cols read valid data and are never stored;
            cols = offs_n % N  # an output element depends only on its own row and column
            out_ptrs = out_ptr + bid * sob + offs_m[:, None] * som + offs_n[None, :] * son
            out_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
            a_ptrs = x_ptr + bid * sxb + rows[:, None] * sxm + offs_k[None, :] * sxk
            b_ptrs = w_ptr + bid * swb + offs_k[:, None] * swk + cols[None, :] * swn
            # One flat K loop (software-pipelined as a whole). When a leaf ends it is carried up the
            # tree: level-0 left children wait in registers (s0); level-1 and level-2 left children are
            # parked in global memory (park tile, then the output tile): two live fp32 tiles.
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            s0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            park_ptrs = park_ptr + bid * sob + offs_m[:, None] * som + offs_n[None, :] * son
            for step in range(0, leaf_iters * NUM_LEAVES):
                if EVEN_LEAF:
                    a = tl.load(a_ptrs)
                    b = tl.load(b_ptrs)
                else:
                    left = LEAF - (step % leaf_iters) * BLOCK_K
                    a = tl.load(a_ptrs, mask=offs_k[None, :] < left, other=0.0)
                    b = tl.load(b_ptrs, mask=offs_k[:, None] < left, other=0.0)
                if UPCAST:  # the CPU interpreter cannot multiply bf16 (numpy has none); bf16 x bf16 is exact in fp32
                    a = a.to(tl.float32)
                    b = b.to(tl.float32)
                acc = tl.dot(a, b, acc, input_precision=PRECISION)
                a_ptrs += BLOCK_K * sxk
                b_ptrs += BLOCK_K * swk
                if NUM_LEAVES > 1:
                    if (step + 1) % leaf_iters == 0:  # a leaf is finished
                        if not EVEN_LEAF:  # back to the first column of the next leaf
                            a_ptrs += (LEAF - leaf_iters * BLOCK_K) * sxk
                            b_ptrs += (LEAF - leaf_iters * BLOCK_K) * swk
                        j = step // leaf_iters
                        if j % 2 == 0:
                            s0 = acc
                            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                        else:
                            acc = s0 + acc  # a level-1 node
                            if NUM_LEAVES > 2:
                                if j % 4 == 1:
                                    tl.store(park_ptrs, acc, mask=out_mask)
                                    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                                else:
                                    acc = tl.load(park_ptrs, mask=out_mask, other=0.0) + acc  # a level-2 node
                                    if NUM_LEAVES > 4:
                                        if j % 8 == 3:
                                            tl.store(out_ptrs, acc, mask=out_mask)
                                            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                                        else:
                                            acc = tl.load(out_ptrs, mask=out_mask, other=0.0) + acc
            tl.store(out_ptrs, acc, mask=out_mask)


def _num_programs(device: torch.device, tiles: int) -> int:
    if device.type == "cuda":
        return max(1, min(tiles, torch.cuda.get_device_properties(device).multi_processor_count * 2))
    return max(1, min(tiles, 4))  # interpreter


def mm(x: Tensor, w: Tensor, leaves: int = 1, config: dict[str, int] | None = None, tree: bool = False) -> Tensor:
    """fp32 x @ w^T for x[B?, M, K], w[B?, N, K] (w may be a strided view, e.g. a transpose); with
    `leaves` > 1 the K reduction is the fixed tree of `leaves` equal leaves."""
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
    cfg = dict(config or (INTERPRET_CONFIG if x.device.type == "cpu" else (TREE_CONFIGS if tree else CONFIGS)[x.dtype]))
    out = torch.empty(batch, m, n, dtype=torch.float32, device=x.device)
    park = torch.empty_like(out) if leaves > 2 else out  # level-1 nodes (tree only)
    if m and n and batch:
        leaf = k // leaves
        tiles = batch * triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"])
        progs = _num_programs(x.device, tiles)
        _mm_kernel[(progs,)](
            x3, w3, out, park, batch, m, n, leaf,
            x3.stride(0), x3.stride(1), x3.stride(2), w3.stride(0), w3.stride(1), w3.stride(2),
            out.stride(0), out.stride(1), out.stride(2), progs,
            NUM_LEAVES=leaves, EVEN_LEAF=leaf % cfg["BLOCK_K"] == 0,
            PRECISION="ieee" if (x.dtype == torch.float32 or x.device.type == "cpu") else "tf32",
            UPCAST=x.device.type == "cpu",
            **cfg,
        )
    return out[0] if squeeze else out


def describe(tree: bool = False) -> str:
    return "; ".join(f"{str(dt).removeprefix('torch.')}: " + ", ".join(f"{k}={v}" for k, v in c.items())
                     for dt, c in (TREE_CONFIGS if tree else CONFIGS).items())
