"""Tree matmul and tree sums for row-parallel layers (TBIK).

The full K of a row-parallel layer (o_proj, down_proj) is cut into TP_MAX = 8 contiguous blocks: the
top 3 levels of one complete binary tree. A block is one leaf. Rank r of C ranks owns blocks
[r*8/C, (r+1)*8/C), one subtree; `tree_matmul` returns that subtree's value in fp32 and `tree_sum`
adds the ranks' subtrees along the top of the same tree. Every leaf is computed the same way whatever
C is (same shapes, same order) and leaves are added pairwise in the same order, so the result is
bitwise identical for C = 1, 2, 4, 8.

- CPU: a leaf is the fixed-shape block product of `fixed` ([R, K/8] @ [K/8, N] per R rows): bf16
  operands through `cpu_bf16`'s micro-kernel where this process chose it (fp32 accumulation; with the
  compiled call loop each output block's leaves are summed by the thread that computed them, in cache,
  `cpu_bf16.leaf_sums`: the same adds in the same pairs as `pairwise`), fp32 products otherwise.
- GPU: the Triton tree kernel of `triton_mm` (bf16 / fp16 up to 32 rows: `triton_swap`'s) with NUM_LEAVES = 8/C
  (leaves unrolled at compile time, each a pipelined K loop accumulated in fp32 registers, compile-time
  binary-counter carries held in registers, one fixed reduction per dtype); on Hopper at M > 256 the
  Gluon kernel of `gluon_tree`, which computes the same bits with a warp-specialised TMA pipeline.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.backends.kernels import cpu_bf16, cpu_gemm, fixed, gluon_tree, triton_mm
from detaudit.errors import DetauditError

TP_MAX = 8


def leaf_plan(k_local: int, tp_size: int, name: str = "") -> tuple[int, int]:
    """(leaf size K/8, leaves on this rank) for a rank holding k_local = K/C columns."""
    layer = name or "row-parallel layer"
    if tp_size not in (1, 2, 4, 8):
        raise DetauditError(f"{layer}: bio+tbik supports TP sizes 1, 2, 4, 8, got {tp_size}")
    k = k_local * tp_size
    if k == 0 or k % TP_MAX:
        raise DetauditError(
            f"{layer}: bio+tbik needs the reduction size K (here {k} = {k_local} x TP {tp_size}) to be a "
            f"positive multiple of {TP_MAX}, so that K splits into {TP_MAX} equal tree blocks"
        )
    return k // TP_MAX, TP_MAX // tp_size


def tree_sum(parts: list[Tensor]) -> Tensor:
    """((p0 + p1) + (p2 + p3)) + ...: pairwise along a complete binary tree (len must be 2^k)."""
    n = len(parts)
    if n == 0 or n & (n - 1):
        raise ValueError(f"tree_sum needs a power-of-two number of parts, got {n}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]


def _packed(w: Tensor, leaves: int, leaf: int) -> Tensor:
    """fp32 leaf-major copy [leaves, K/8, N] of w[N, K_local] (laid out in w's dtype, then widened, as
    `fixed.weight_t`)."""
    return fixed.derived(
        w, f"leaves{leaves}x{leaf}", lambda d: d.reshape(d.shape[0], leaves, leaf).permute(1, 2, 0).contiguous().float()
    )


def tree_matmul(x: Tensor, w: Tensor, tp_size: int, name: str = "", out_dtype: torch.dtype = torch.float32) -> Tensor:
    """This rank's subtree of x[..., K/C] @ w[N, K/C]^T in fp32, rounded once to `out_dtype` (a TP subtree
    stays fp32 for the all-reduce; a TP-1 layer's whole tree may be rounded to the model dtype)."""
    k_local = x.shape[-1]
    if k_local != w.shape[1]:
        raise DetauditError(f"{name or 'row-parallel layer'}: x has K={k_local}, weight has K={w.shape[1]}")
    if x.is_cuda and x.dim() == 2:  # the engine's layers: checked leaf plans, no reshapes
        leaves = _leaves(k_local, tp_size, name)
        x = x if x.is_contiguous() else x.contiguous()
        return triton_mm.mm(x, w, leaves=leaves, tree=True, out_dtype=out_dtype)
    leaf, leaves = leaf_plan(k_local, tp_size, name)
    lead, n = x.shape[:-1], w.shape[0]
    x2 = x.reshape(-1, k_local)
    if x.is_cuda:
        return triton_mm.mm(x2.contiguous(), w, leaves=leaves, tree=True, out_dtype=out_dtype).reshape(*lead, n)
    return tree_matmul_cpu(x2, w, leaf, leaves, out_dtype).reshape(*lead, n).to(out_dtype)


def routed(x: Tensor, w: Tensor, tp_size: int, name: str = ""):
    """`write` for `peer.PeerTransport.routed_all_reduce` where the Gluon kernel computes this rank's
    subtree (Hopper, the large-M rows `triton_mm` gives it, up to 4 leaves: TP >= 2): `write(areas, route,
    rows, rank)` runs `gluon_tree.tree_mm_routed` (tiles of BLOCK_M = 128 rows), the same bits as
    `tree_matmul`, stored in other places. Else None."""
    if not (x.is_cuda and x.dim() == 2 and x.dtype in triton_mm.TREE_TILINGS and gluon_tree.available(x)):
        return None
    if not triton_mm.tiling(x.dtype, x.shape[0], True, w.shape[0], True).get("GLUON"):
        return None
    leaves = _leaves(x.shape[1], tp_size, name)
    if leaves > 4 or not gluon_tree.supports(x, w, leaves):
        return None

    def write(areas: list[Tensor], route: Tensor, rows: int, rank: int) -> None:
        gluon_tree.tree_mm_routed(x, w, leaves, areas, route, rows, rank)

    return write


_LEAVES: dict[tuple[int, int], int] = {}  # (K/C, C) -> leaves on a rank, for shapes leaf_plan accepted


def _leaves(k_local: int, tp_size: int, name: str) -> int:
    """Leaves on a rank (`leaf_plan`), memoised: the engine's layers ask at every call."""
    leaves = _LEAVES.get((k_local, tp_size))
    if leaves is None:
        leaves = _LEAVES[(k_local, tp_size)] = leaf_plan(k_local, tp_size, name)[1]
    return leaves


def _packed_bf16(w: Tensor, leaves: int, leaf: int) -> Tensor:
    """bf16 panels of each leaf, [leaves, P, leaf2/2, W, 2] (`cpu_bf16.pack` of w[:, leaf j]; W depends on
    N only, so a leaf is the same call whatever the TP size)."""
    return fixed.derived(
        w,
        f"bf16-leaves{leaves}x{leaf}",
        lambda d: torch.stack(
            [cpu_bf16.pack(d[:, j * leaf : (j + 1) * leaf], cpu_bf16.LEAF_PANEL_MAX) for j in range(leaves)]
        ),
    )


def tree_matmul_cpu(x2: Tensor, w: Tensor, leaf: int, leaves: int, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """The tree's sum, fp32, or (`out_dtype` bf16, where `cpu_bf16.leaf_sums` or `leaf_tree` runs) already
    rounded to bf16: the caller's cast then does nothing, the same bits."""
    m, n = x2.shape[0], w.shape[0]
    if cpu_bf16.usable(x2, w):  # every leaf's products in one spread over the threads
        if leaf % 2:  # an odd leaf: each leaf's columns blocked (padded to an even K) on their own
            xl = torch.stack([cpu_bf16.blocks_of(x2[:, j * leaf : (j + 1) * leaf]) for j in range(leaves)])
        else:  # the leaves as K slices of the rows' blocks: a view, the kernel takes the row stride
            xb = cpu_bf16.blocks_of(x2)
            xl = xb.view(xb.shape[0], xb.shape[1], leaves, leaf).permute(2, 0, 1, 3)
        packed = _packed_bf16(w, leaves, leaf)
        out = cpu_bf16.leaf_sums(xl, packed, out_dtype) if leaves > 1 else None  # in cache; else the same adds
        if out is None:
            products = cpu_bf16.products(xl, packed)
            out = cpu_bf16.leaf_tree(products, out_dtype)  # (None for one leaf, or nothing compiled)
            out = pairwise(products) if out is None else out
        return out.view(-1, out.shape[-1])[:m, :n]
    xb = fixed.blocks_of(x2)  # [nb, R, K_local]
    wf = _packed(w, leaves, leaf)
    stack: list[Tensor] = []  # binary-counter carries: stack[i] is a finished node of level i
    for j in range(leaves):
        c = cpu_gemm.block_products(xb[:, :, j * leaf : (j + 1) * leaf].contiguous(), wf[j])
        level = 0
        while (j >> level) & 1:  # a right child: left sibling + it
            c = stack.pop() + c
            level += 1
        stack.append(c)
    out = stack[0]
    return out.view(-1, out.shape[-1])[:m, :n]


def pairwise(leaves: Tensor) -> Tensor:
    """The tree over the leading dim of leaves[2^k, ...]: each level adds every left node to its right
    sibling in one op (node 2i + node 2i+1: the same adds, in the same pairs, as the carries above)."""
    while leaves.shape[0] > 1:
        leaves = leaves[0::2] + leaves[1::2]
    return leaves[0]


def describe() -> dict[str, str]:
    return {
        "tree": f"K cut into {TP_MAX} equal blocks (top 3 levels, TP_max={TP_MAX}); leaves added pairwise "
        "((l0+l1)+(l2+l3))+... in fp32; K % 8 != 0 is refused naming the layer",
        "tree_matmul_cpu": "per leaf the products of matmul_cpu (cpu_gemm's path), K/8 for K; bf16 operands: "
        f"W up to {cpu_bf16.LEAF_PANEL_MAX}",
        "tree_matmul_gpu": "Triton kernels (persistent; SWAP=1: bf16 / fp16 up to 32 rows, operands swapped, a "
        "program a tile), NUM_LEAVES=8/C "
        "unrolled leaves, each a pipelined K loop "
        "into an fp32 accumulator, compile-time binary-counter carries in registers, no split-K, "
        f"no autotune; {triton_mm.describe(tree=True)}; GLUON=1: on Hopper the warp-specialised "
        f"Gluon kernel (same leaves, same adds; {gluon_tree.CONFIG})",
    }
