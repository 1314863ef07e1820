"""The invariant backends' MoE expert products on GPU in one launch per projection, and each token's
weighted sum of its experts (then the leaves' tree) in one more.

`Runs` sorts one step's (token, slot) rows by expert and cuts every expert's run into blocks of a config's
BLOCK_M rows of that expert, on the device: no host sync, whatever the routing (graphed decode steps of at most
one row an expert take it too: only the chosen experts' weights are read). `grouped` computes every
block's product with its expert's weight in one launch; a row is gathered from its source row of x and
stored at its destination row, so the gate / up product reads the tokens' hidden states in place and
the down product writes (token, slot) order directly (no gather, index_put or cat of fp32 rows). With
leaves, each leaf is its own K span from zero, stored apart ([leaves, rows, N]): the tree's leaves.

Bits: each output element is `triton_carry.span` over its K (or its leaf), one fp32 accumulator from zero
fed in K order, rounded once in the store, exactly as `triton_mm.mm` computes an expert's rows, whichever
tiles either uses (see triton_mm's note on the reduction). tests/gpu checks both against each other.

`weighted_tree` is `tree.pairwise(bio.weighted_experts(y, gates))` in one pass: per leaf the token's k
products times their gates added in slot order (a multiply, then an add: fp fusion off, as torch's
separate ops round), then the leaves along the pairwise tree.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.backends.kernels import triton_carry, triton_mm

try:  # optional: GPU kernels and the interpreter tests only
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None
    tl = None

# One config per projection shape class; a config only tiles, it never changes an element's sum (every
# config below gave the default's bits in `tools/grouped_sweep.py`, and tests/gpu checks the kernels
# against the per-expert products). Experts get ~T*k/E rows each (256 at 4,096 tokens, top 8 of 128).
# BLOCK_K 32 divides every tree leaf of Qwen3-30B-A3B's experts (768 / 8 = 96). Chosen on an H200 at
# Qwen3-30B-A3B's shapes (tools/grouped_sweep.py): prefill's gate / up and down at 128 x 256 tiles (0.96-
# 1.2x torch's CUTLASS grouped mm, from 1.26-1.8x at 64 x 128); decode-sized steps (at most T*k = E rows)
# 64 x 256 with two warpgroups; the tree's leaf products keep 64 x 128 in prefill, where the stores of
# every leaf's fp32 outputs bound them. Other GPUs keep the 64 x 128 tiles (their shared memory may not
# hold the larger ones' stages).
CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4, num_stages=4)
LEAF_CONFIG = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=3)
HOPPER = {
    (False, False): dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    (False, True): LEAF_CONFIG,
    (True, False): dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3),
    (True, True): dict(BLOCK_M=64, BLOCK_N=256, BLOCK_K=32, num_warps=8, num_stages=3),
}  # keyed by (decode-sized, leaves)
INTERPRET_CONFIG = dict(triton_mm.INTERPRET_CONFIG)  # the per-expert path's tiles under the interpreter
SUM_BLOCK = 512  # columns a program of `weighted_tree` sums


def usable(x: Tensor) -> bool:
    """Whether `grouped` runs the products of x (GPU, half precision)."""
    return triton is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)


def sums_usable(y: Tensor) -> bool:
    """Whether `weighted_tree` runs on y (GPU)."""
    return triton is not None and y.is_cuda


def describe() -> str:
    def cfg(c: dict) -> str:
        return " ".join(f"{k}={v}" for k, v in c.items())

    return (
        f"prefill, and decode steps of at most one row an expert: one launch a projection over every expert's "
        f"blocks of its rows, each element triton_mm's K-order sum (tiles on compute capability 9.x: "
        f"{'; '.join(cfg(c) for c in HOPPER.values())}; elsewhere {cfg(CONFIG)}, tree leaves {cfg(LEAF_CONFIG)}); "
        f"other decode steps: the batched products; weighted sums (and leaves' tree) in one kernel, fp fusion off"
    )


class Runs:
    """One MoE step's T*k (token, slot) rows sorted by expert (stable: tokens in order within an expert),
    without a host sync (so graphed decode steps take it too). `order[r]`: the (token, slot) row (t*k + j)
    of sorted row r. `tiles(block_m)`: every expert's run cut into blocks of `block_m` rows of that expert,
    (blocks, max_blocks): `blocks` [3, max_blocks] int32, each block's expert (-1 past the last), first
    sorted row and row count; max_blocks = T*k / block_m + E bounds the blocks of any routing. Made when a
    product first asks for its config's block_m, once a step."""

    def __init__(self, experts: Tensor, num_experts: int) -> None:
        flat = experts.reshape(-1)
        # a stable sort's order is the keys' alone: int16 ids sort in 2 radix passes on a GPU, int64 in 8
        key = flat.to(torch.int16) if num_experts <= torch.iinfo(torch.int16).max else flat
        by_expert, self.order = torch.sort(key, stable=True)
        # each expert's first and past-the-last sorted row, on the device (torch.bincount would read its
        # size back to the host, and a decode step's CUDA graph cannot hold a host sync)
        ids = torch.arange(num_experts, device=flat.device, dtype=by_expert.dtype)
        self.starts = torch.searchsorted(by_expert, ids)
        self.counts = torch.searchsorted(by_expert, ids, right=True) - self.starts
        self.num_experts, self.rows = num_experts, flat.numel()
        self._tiles: dict[int, tuple[Tensor, int]] = {}
        self.identity = torch.arange(flat.numel(), device=flat.device, dtype=torch.int32)

    def tiles(self, block_m: int) -> tuple[Tensor, int]:
        if block_m not in self._tiles:
            max_blocks = self.rows // block_m + self.num_experts
            self._tiles[block_m] = block_table(self.counts, self.starts, block_m, max_blocks), max_blocks
        return self._tiles[block_m]

    def decode_sized(self) -> bool:
        """At most one (token, slot) row an expert: a decode step's size, whose products stream the chosen
        experts' weights (`experts.run` takes the grouped layout for them; the tiles differ)."""
        return self.rows <= self.num_experts


TABLE_CHUNK = 128  # blocks a program of `block_table` fills


def block_table(counts: Tensor, starts: Tensor, block_m: int, max_blocks: int) -> Tensor:
    """[3, max_blocks] int32: block b's expert (-1 past the last block), first sorted row and rows (0
    past the last), every expert's run (`counts[e]` rows from sorted row `starts[e]`) cut into blocks of
    `block_m` rows in expert order. One launch where the same table took ~15 torch ops, each a launch and
    its Python: a batch-8 MoE prefill at TP 2 is host-bound (reports/gpu/moe)."""
    blocks = torch.empty(3, max_blocks, dtype=torch.int32, device=counts.device)
    experts = counts.shape[0]
    width = max(16, triton.next_power_of_2(experts))
    _table_kernel[(triton.cdiv(max_blocks, TABLE_CHUNK),)](
        counts, starts, blocks, experts, max_blocks, BLOCK_M=block_m, WIDTH=width, CHUNK=TABLE_CHUNK
    )
    return blocks


def grouped(
    x: Tensor,
    src: Tensor,
    w: Tensor,
    runs: Runs,
    dst: Tensor,
    out_rows: int,
    out_dtype: torch.dtype = torch.float32,
    config: dict | None = None,
) -> Tensor:
    """out[..., dst[r], :] = x[src[r]] @ w[e(r)]^T for every sorted row r of `runs` (e(r): its expert),
    fp32 accumulation rounded once to `out_dtype`. w: [E, N, K] gives out [out_rows, N]; leaf-major
    weights [E, leaves, N, K/leaves] (a tree's leaves, one at TP 8) give out [leaves, out_rows, N], each
    leaf its own sum."""
    if w.dim() == 4:
        e, leaves, n, leaf = w.shape
        swe, swl, swn, swk = w.stride()
    else:
        e, n, leaf = w.shape
        (swe, swn, swk), swl, leaves = w.stride(), 0, 1
    if x.shape[1] != leaf * leaves:
        raise AssertionError(f"x has K={x.shape[1]}, the weights {leaf * leaves}")
    interpret = x.device.type == "cpu"
    cfg = dict(config or (INTERPRET_CONFIG if interpret else _config(x, w.dim() == 4, runs)))
    cfg.pop("GROUP_M", None)
    blocks, max_blocks = runs.tiles(cfg["BLOCK_M"])
    store = torch.float32 if interpret else out_dtype  # the interpreter's bf16 store does not round like torch
    out = torch.empty(leaves, out_rows, n, dtype=store, device=x.device)
    grid = (max_blocks * triton.cdiv(n, cfg["BLOCK_N"]),)
    _grouped_kernel[grid](
        x,
        src,
        w,
        out,
        dst,
        blocks,
        max_blocks,
        x.shape[0],
        n,
        leaf,
        *x.stride(),
        swe,
        swl,
        swn,
        swk,
        *out.stride(),
        NUM_LEAVES=leaves,
        EVEN=leaf % cfg["BLOCK_K"] == 0,
        PRECISION="ieee" if (x.dtype == torch.float32 or interpret) else "tf32",
        UPCAST=interpret,
        **cfg,
    )
    out = out.to(out_dtype)
    return out if w.dim() == 4 else out[0]


def _config(x: Tensor, leaves: bool, runs: Runs) -> dict:
    """The tiles of a product: on Hopper (compute capability 9.x, where they were timed) by the step's size
    and whether it stores leaves; elsewhere the 64 x 128 tiles."""
    if torch.cuda.get_device_capability(x.device)[0] == 9:
        return HOPPER[runs.decode_sized(), leaves]
    return LEAF_CONFIG if leaves else CONFIG


def weighted_tree(y: Tensor, gates: Tensor) -> Tensor:
    """[T, N] fp32: the pairwise tree over the leading dim of y[leaves, T, k, N] (fp32) of each leaf's
    sum over j in order of gates[t, j] * y[leaf, t, j, :]. The bits of `tree.pairwise(weighted_experts(y,
    gates))`; y[T, k, N] is one leaf (`weighted_experts(y, gates)`)."""
    y4 = y if y.dim() == 4 else y.unsqueeze(0)
    leaves, t, k, n = y4.shape
    out = torch.empty(t, n, dtype=torch.float32, device=y.device)
    if t and n:
        g = gates.float()
        _weighted_kernel[(t, triton.cdiv(n, SUM_BLOCK))](
            y4,
            g,
            out,
            n,
            *y4.stride(),
            *g.stride(),
            LEAVES=leaves,
            SLOTS=k,
            BLOCK=SUM_BLOCK,
            num_warps=4,
            enable_fp_fusion=False,
        )
    return out


if triton is not None:

    @triton.jit
    def _table_kernel(
        counts_ptr,
        starts_ptr,
        blocks_ptr,
        experts,
        max_blocks,
        BLOCK_M: tl.constexpr,
        WIDTH: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        # expert e's blocks are numbers ends[e] - per[e] .. ends[e] - 1 (per: its blocks, ends: their
        # running total); block b belongs to the expert whose range holds it: the count of experts whose
        # ends are <= b (a right searchsorted), and every block past the last to none (-1), whose first
        # row still continues the last expert's (as the table has always held)
        e_ids = tl.arange(0, WIDTH)
        real = e_ids < experts
        counts = tl.load(counts_ptr + e_ids, mask=real, other=0).to(tl.int64)
        per = (counts + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(per, 0)
        b = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
        inside = b < max_blocks
        bb = b.to(tl.int64)
        e = tl.sum((ends[None, :] <= bb[:, None]).to(tl.int64), axis=1)  # (padded experts: ends = the total)
        live = e < experts
        ec = tl.minimum(e, experts - 1)
        before = tl.sum(tl.where(e_ids[None, :] < ec[:, None], per[None, :], 0), axis=1)  # ends[ec] - per[ec]
        local = bb - before
        first = tl.load(starts_ptr + ec, mask=inside, other=0).to(tl.int64) + local * BLOCK_M
        rows = tl.minimum(tl.load(counts_ptr + ec, mask=inside, other=0).to(tl.int64) - local * BLOCK_M, BLOCK_M)
        tl.store(blocks_ptr + b, tl.where(live, e, -1).to(tl.int32), mask=inside)
        tl.store(blocks_ptr + max_blocks + b, first.to(tl.int32), mask=inside)
        tl.store(blocks_ptr + 2 * max_blocks + b, tl.where(live, rows, 0).to(tl.int32), mask=inside)

    @triton.jit
    def _grouped_kernel(
        x_ptr,
        src_ptr,
        w_ptr,
        out_ptr,
        dst_ptr,
        blocks_ptr,
        MAX_BLOCKS,
        X_ROWS,
        N,
        LEAF,
        sxm,
        sxk,
        swe,
        swl,
        swn,
        swk,
        sol,
        som,
        son,
        NUM_LEAVES: tl.constexpr,
        EVEN: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        n_tiles = tl.cdiv(N, BLOCK_N)
        # consecutive programs: one block's column tiles, then the next block of (mostly) the same
        # expert, so an expert's weight is read from L2 by all of its blocks
        block = tl.program_id(0) // n_tiles
        pid_n = tl.program_id(0) % n_tiles
        expert = tl.load(blocks_ptr + block)
        if expert >= 0:
            first = tl.load(blocks_ptr + MAX_BLOCKS + block)
            count = tl.load(blocks_ptr + 2 * MAX_BLOCKS + block)
            offs = tl.arange(0, BLOCK_M)
            row_ok = offs < count
            # rows past the block's count gather row 0 and are never stored; 64-bit row offsets (a long
            # prefill's rows times a wide expert pass 2^31 elements)
            src = tl.load(src_ptr + first + offs, mask=row_ok, other=0).to(tl.int64)
            dst = tl.load(dst_ptr + first + offs, mask=row_ok, other=0)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            mask = row_ok[:, None] & (cols < N)[None, :]
            w_expert = w_ptr + expert.to(tl.int64) * swe
            out_leaf = out_ptr
            for j in tl.static_range(NUM_LEAVES):
                # leaf j: x's columns j*LEAF.. times w[expert, j] (or, one leaf, all of x times w[expert])
                acc = triton_carry.span(
                    x_ptr + j * LEAF * sxk,
                    w_expert + j * swl,
                    src,
                    X_ROWS,
                    cols % N,
                    0,
                    LEAF,
                    sxm,
                    sxk,
                    swn,
                    swk,
                    EVEN,
                    PRECISION,
                    UPCAST,
                    False,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                )
                ptrs = out_leaf + dst.to(tl.int64)[:, None] * som + cols[None, :] * son
                tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
                out_leaf += sol  # one leaf's stride at a time: the pointer's 64 bits, never j * sol in 32

    @triton.jit
    def _weighted_kernel(
        y_ptr,
        g_ptr,
        out_ptr,
        N,
        syl,
        syt,
        sys,
        syn,
        sgt,
        sgs,
        LEAVES: tl.constexpr,
        SLOTS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        t = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < N
        row = y_ptr + t.to(tl.int64) * syt + cols * syn
        s0 = tl.zeros((BLOCK,), dtype=tl.float32)
        s1 = tl.zeros((BLOCK,), dtype=tl.float32)
        s2 = tl.zeros((BLOCK,), dtype=tl.float32)
        node = tl.zeros((BLOCK,), dtype=tl.float32)
        for leaf in tl.static_range(LEAVES):
            z = tl.load(row, mask=ok, other=0.0) * tl.load(g_ptr + t * sgt)
            for j in tl.static_range(1, SLOTS):
                z = z + tl.load(row + j * sys, mask=ok, other=0.0) * tl.load(g_ptr + t * sgt + j * sgs)
            s0, s1, s2, node = triton_carry.carry(leaf, z, s0, s1, s2, node)
            row += syl  # the next leaf: one stride at a time in the pointer's 64 bits
        tl.store(out_ptr + t.to(tl.int64) * N + cols, node, mask=ok)
