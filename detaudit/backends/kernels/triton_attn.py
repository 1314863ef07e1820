"""bio attention on GPU as one Triton kernel: the KV sequence in chunks of a fixed size (SPLIT keys, never
a fixed number of chunks), an fp32 online softmax, one launch per layer instead of ~70 PyTorch kernels.

A program owns BLOCK_R query rows of one (request, KV head) group and walks the chunks in order up to the
furthest position among its rows. Every row's arithmetic depends only on that row (its scores are the
row of one tl.dot, its max and sum are row reductions), so which rows share a program, how many there
are and how many chunks the program walks never change a row's bits: a chunk a row cannot see leaves
it exactly as it was (p = 0, and alpha is set to exactly 1 when the running max does not move). Prefill
(many rows) and decode (one position per request) therefore give the same bits. The CPU path
(`fixed.attention`'s PyTorch formulation) computes the same function with other bits; the two are not
mixed: a run is either on CPU or on GPU.

The rows of a group are position-major (row r: position r // groups of query head r % groups of the KV
head), so a program's rows are consecutive positions and the chunks it walks end at the furthest of
them. `attention_heads` reads those rows from the model's q[B, Hq, T, D] through its strides and writes
[B, T, Hq, D] directly (o_proj's input); `attention` takes rows already laid out as [G, R, D]. The rows
and programs are the same either way: only the addresses differ, never the bits (checked against the
kernel that read a copied layout, `tests/unit/attn_reference.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.backends.kernels import launch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_R = 16  # query rows per program (the smallest tl.dot M): the backends' choice, named in bio's description
BLOCK_RS = (16, 32, 64, 128)  # the row counts a caller may ask for (`bench attention` compares them)
NO_WINDOW = 2**30  # a window no position reaches past (int32-safe: pos - NO_WINDOW stays negative)


def supported(q: Tensor) -> bool:
    d = q.shape[-1]
    return (
        triton is not None
        and q.is_cuda
        and d >= 16
        and d & (d - 1) == 0
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


if triton is not None:

    @triton.jit
    def visit(q, k, v, keys, pos, m, l, acc, scale, WINDOW, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """One chunk of keys (k / v [SPLIT, D], zero where there is no key) into the rows' online softmax
        state (m, l, acc). Every kernel that walks chunks calls this one function, so a row's arithmetic
        is the same whichever layout its keys were read from (`triton_paged`)."""
        if UPCAST:  # the CPU interpreter cannot multiply bf16 (numpy has none)
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (keys[None, :] <= pos[:, None]) & (keys[None, :] > pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_new == m, 1.0, tl.exp(m - safe))  # exactly 1 when nothing new is seen
        p = tl.exp(s - safe[:, None])  # masked keys: exp(-inf) = 0
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return m_new, l, acc

    @triton.jit
    def fresh(BLOCK_R: tl.constexpr, D: tl.constexpr):
        """A block of rows' online softmax state before its first chunk: m, l, acc."""
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        return m, tl.zeros([BLOCK_R], tl.float32), tl.zeros([BLOCK_R, D], tl.float32)

    @triton.jit
    def _heads_rows(
        q_g,
        pos_g,
        out_g,
        first,
        ROWS,
        h,
        sqh,
        sqt,
        spt,
        soh,
        sot,
        GROUPS: tl.constexpr,
        D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Rows first .. first + BLOCK_R of group (b, h), `q_g` / `pos_g` / `out_g` request b's q, pos and out:
        the rows' queries, positions, liveness and output rows. Row r of the group: position t = r // GROUPS
        of query head h * GROUPS + r % GROUPS (position-major: a block's rows are consecutive positions),
        addressed in q and out through their strides."""
        rows = first + tl.arange(0, BLOCK_R)
        live = rows < ROWS
        t = rows // GROUPS
        head = h * GROUPS + rows % GROUPS
        d = tl.arange(0, D)
        q = tl.load((q_g + head * sqh + t * sqt)[:, None] + d[None, :], mask=live[:, None], other=0.0)
        if UPCAST:  # the CPU interpreter cannot multiply bf16 (numpy has none)
            q = q.to(tl.float32)
        pos = tl.load(pos_g + t * spt, mask=live, other=0)
        return q, pos, live, out_g + head * soh + t * sot

    @triton.jit
    def store_rows(dst, acc, l, live, D: tl.constexpr):
        """A block's finished rows, acc / l in the output's dtype, at their output rows `dst` (every
        attention kernel's one copy of it)."""
        d = tl.arange(0, D)
        tl.store(dst[:, None] + d[None, :], (acc / l[:, None]).to(dst.dtype.element_ty), mask=live[:, None])

    @triton.jit
    def _attn_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        pos_ptr,
        out_ptr,
        ROWS,
        HKV,
        L,
        scale,
        WINDOW,
        sqb,
        sqh,
        sqt,
        skb,
        skh,
        skl,
        svb,
        svh,
        svl,
        spb,
        spt,
        sob,
        soh,
        sot,
        GROUPS: tl.constexpr,
        D: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_R: tl.constexpr,
        SUB: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """A program owns SUB blocks of BLOCK_R rows (SUB 1, 2 or 4): each chunk's keys and values are
        loaded once for all of them, and each block is updated by `visit` alone, with the operands and
        shapes it has when SUB is 1, so a row's bits do not depend on SUB."""
        g = tl.program_id(0)  # (request b, KV head h) = b * HKV + h
        b = g // HKV
        h = g % HKV
        first = tl.program_id(1) * (BLOCK_R * SUB)
        q_g, pos_g, out_g = q_ptr + b * sqb, pos_ptr + b * spb, out_ptr + b * sob  # request b's
        q0, pos0, live0, dst0 = _heads_rows(
            q_g, pos_g, out_g, first, ROWS, h, sqh, sqt, spt, soh, sot, GROUPS, D, BLOCK_R, UPCAST
        )
        m0, l0, acc0 = fresh(BLOCK_R, D)
        top = tl.max(pos0, 0)
        if SUB > 1:
            q1, pos1, live1, dst1 = _heads_rows(
                q_g, pos_g, out_g, first + BLOCK_R, ROWS, h, sqh, sqt, spt, soh, sot, GROUPS, D, BLOCK_R, UPCAST
            )
            m1, l1, acc1 = fresh(BLOCK_R, D)
            top = tl.maximum(top, tl.max(pos1, 0))
        if SUB > 2:
            q2, pos2, live2, dst2 = _heads_rows(
                q_g, pos_g, out_g, first + 2 * BLOCK_R, ROWS, h, sqh, sqt, spt, soh, sot, GROUPS, D, BLOCK_R, UPCAST
            )
            q3, pos3, live3, dst3 = _heads_rows(
                q_g, pos_g, out_g, first + 3 * BLOCK_R, ROWS, h, sqh, sqt, spt, soh, sot, GROUPS, D, BLOCK_R, UPCAST
            )
            m2, l2, acc2 = fresh(BLOCK_R, D)
            m3, l3, acc3 = fresh(BLOCK_R, D)
            top = tl.maximum(top, tl.maximum(tl.max(pos2, 0), tl.max(pos3, 0)))
        d = tl.arange(0, D)
        k_base = k_ptr + b * skb + h * skh
        v_base = v_ptr + b * svb + h * svh
        chunks = top // SPLIT + 1  # the chunks this program's rows can reach
        for c in range(0, chunks):
            keys = c * SPLIT + tl.arange(0, SPLIT)
            inside = keys < L
            k = tl.load(k_base + keys[:, None] * skl + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_base + keys[:, None] * svl + d[None, :], mask=inside[:, None], other=0.0)
            m0, l0, acc0 = visit(q0, k, v, keys, pos0, m0, l0, acc0, scale, WINDOW, PRECISION, UPCAST)
            if SUB > 1:
                m1, l1, acc1 = visit(q1, k, v, keys, pos1, m1, l1, acc1, scale, WINDOW, PRECISION, UPCAST)
            if SUB > 2:
                m2, l2, acc2 = visit(q2, k, v, keys, pos2, m2, l2, acc2, scale, WINDOW, PRECISION, UPCAST)
                m3, l3, acc3 = visit(q3, k, v, keys, pos3, m3, l3, acc3, scale, WINDOW, PRECISION, UPCAST)
        store_rows(dst0, acc0, l0, live0, D)
        if SUB > 1:
            store_rows(dst1, acc1, l1, live1, D)
        if SUB > 2:
            store_rows(dst2, acc2, l2, live2, D)
            store_rows(dst3, acc3, l3, live3, D)


SUBS = (1, 2, 4)  # blocks of rows a program may own, sharing each chunk's loads (`_attn_kernel`)
WIDE_R = 32  # rows a block of 16-bit queries where a group has more than BLOCK_R rows (prefill)
WIDE_DS = (128,)  # ...and the head size one of these: where an H200 ran 32 rows (bits and speed measured)


def rows_per_block(rows: int, dtype: torch.dtype, head_dim: int, split: int) -> int:
    """The backends' rows a block for groups of up to `rows` rows: WIDE_R for bf16 / fp16 queries in
    prefill with a head size in WIDE_DS and chunks of at least 64 keys (each chunk's keys
    and values loaded once for twice the rows), else BLOCK_R. Not a bit: there a tile of 32 rows is
    covered by the same m16 MMA instructions as one of 16, with the warps laid out the same way (Triton's
    rule for chained dots, as its source reads, puts them along a tile's columns while the columns, D or
    SPLIT, outnumber the rows), so each row's products and sums are unchanged;
    `tests/gpu/test_attention_in_place.py` checks it for every head size and dtype this rule widens,
    `bench attention`'s `bits_as_default` at its shape. Other head sizes stay at BLOCK_R until a GPU has
    checked them (a 32-column tile, D or SPLIT 32, could lay the warps along the rows instead), and so
    do fp32 queries: their "ieee" product is no MMA, and 32 rows gave other bits on an H200."""
    wide = head_dim in WIDE_DS and split >= 64 and dtype in (torch.bfloat16, torch.float16)
    return WIDE_R if wide and rows > BLOCK_R else BLOCK_R


def check_layout(block_r: int, sub: int) -> None:
    """Refuses a layout the kernels are not compiled for: `block_r` rows a block, `sub` blocks a program."""
    if block_r not in BLOCK_RS or sub not in SUBS:
        raise ValueError(f"attention layout {block_r}x{sub}: rows one of {BLOCK_RS}, blocks one of {SUBS}")


def warps(block_r: int) -> int:
    """Warps per program: one warpgroup up to 64 rows, two for 128."""
    return 4 if block_r <= 64 else 8


def attention_heads(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    scale: float,
    split: int,
    window: int | None = None,
    block_r: int | None = None,
    sub: int = 1,
) -> Tensor:
    """The model's layout: q[B, Hq, T, D] (any strides, D contiguous), k / v[B, Hkv, L, D] (the cache or a
    slice of it), pos[B, T] (each query position's absolute position) -> [B, Hq, T, D], a view of a
    contiguous [B, T, Hq, D]: the output o_proj reads as [B*T, Hq*D] without a copy. Each (request, KV
    head) is one group of T * Hq / Hkv rows, position-major, read and written in place through the
    strides: the rows and programs of `attention` over the copied layout, so the same bits."""
    bsz, hq, t, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(bsz, t, hq, d, dtype=q.dtype, device=q.device).transpose(1, 2)
    _run(q, k, v, pos, out, hkv, hq // hkv, t * (hq // hkv), scale, split, window, block_r, sub)
    return out


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pos: Tensor,
    scale: float,
    split: int,
    window: int | None = None,
    block_r: int | None = None,
    sub: int = 1,
) -> Tensor:
    """q[G, R, D] (the group's query rows), k / v[G, L, D], pos[G, R] (each row's position: key j is
    visible iff j <= pos, and with a sliding window iff pos - window < j <= pos) -> [G, R, D] in q.dtype.
    A chunk wholly before a row's window leaves it as it was (m stays -inf, alpha is 1), as past it.
    (`attention_heads` with one KV head of one query head per group: row r is position r.)"""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _run(q[:, None], k[:, None], v[:, None], pos, out[:, None], 1, 1, q.shape[1], scale, split, window, block_r, sub)
    return out


def _run(q, k, v, pos, out, hkv, groups, rows, scale, split, window, block_r: int | None, sub: int) -> None:
    """Launch the kernel over q / out [B, Hq, T, D], k / v [B, Hkv, L, D], pos [B, T]: B * Hkv groups of
    `rows` rows (T positions x `groups` query heads), `sub` blocks of `block_r` rows a program (None:
    `rows_per_block`)."""
    block_r = rows_per_block(rows, q.dtype, q.shape[-1], split) if block_r is None else block_r
    check_layout(block_r, sub)
    bsz, d = q.shape[0], q.shape[-1]
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))  # cache slices stay views
    if pos.dtype != torch.int32:
        pos = pos.to(torch.int32)
    win = NO_WINDOW if window is None else int(window)
    tensors = (q, k, v, pos, out)
    key = None
    if q.is_cuda:  # a kept launch per plan key (see `launch`): every integer argument and alignment
        key = (
            q.shape,
            q.stride(),
            k.shape,
            k.stride(),
            v.stride(),
            pos.stride(),
            out.stride(),
            hkv,
            groups,
            q.dtype,
            float(scale),
            split,
            win,
            block_r,
            sub,
            q.device.index,
            *(x.data_ptr() % 16 == 0 for x in tensors),
        )
        plan = _PLANS.get(key)
        if plan is not None:
            plan(q.device.index, *tensors)
            return
    grid = (bsz * hkv, triton.cdiv(rows, block_r * sub))
    first = launch.Launch.first(
        _attn_kernel,
        grid,
        (
            *tensors,
            rows,
            hkv,
            k.shape[2],
            float(scale),
            win,
            q.stride(0),
            q.stride(1),
            q.stride(2),
            k.stride(0),
            k.stride(1),
            k.stride(2),
            v.stride(0),
            v.stride(1),
            v.stride(2),
            pos.stride(0),
            pos.stride(1),
            out.stride(0),
            out.stride(1),
            out.stride(2),
        ),
        dict(
            GROUPS=groups,
            D=d,
            SPLIT=split,
            BLOCK_R=block_r,
            SUB=sub,
            PRECISION="ieee" if q.dtype == torch.float32 or not q.is_cuda else "tf32",
            UPCAST=not q.is_cuda,
            num_warps=warps(block_r),
            num_stages=2,
        ),
        slots=(0, 1, 2, 3, 4),
    )
    if first is not None and key is not None:
        launch.cache_put(_PLANS, key, first)


_PLANS: dict[tuple, launch.Launch] = {}
