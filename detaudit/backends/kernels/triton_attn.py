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

BLOCK_R = 16  # query rows per program (the smallest tl.dot M)
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
    def _attn_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        pos_ptr,
        out_ptr,
        ROWS,
        L,
        scale,
        WINDOW,
        sqg,
        sqr,
        skg,
        skl,
        svg,
        svl,
        spg,
        sog,
        sor,
        D: tl.constexpr,
        SPLIT: tl.constexpr,
        BLOCK_R: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        g = tl.program_id(0)
        rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = rows < ROWS
        d = tl.arange(0, D)
        q = tl.load(q_ptr + g * sqg + rows[:, None] * sqr + d[None, :], mask=live[:, None], other=0.0)
        if UPCAST:  # the CPU interpreter cannot multiply bf16 (numpy has none)
            q = q.to(tl.float32)
        pos = tl.load(pos_ptr + g * spg + rows, mask=live, other=0)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        chunks = tl.max(pos, 0) // SPLIT + 1  # the chunks this program's rows can reach
        for c in range(0, chunks):
            keys = c * SPLIT + tl.arange(0, SPLIT)
            inside = keys < L
            k = tl.load(k_ptr + g * skg + keys[:, None] * skl + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_ptr + g * svg + keys[:, None] * svl + d[None, :], mask=inside[:, None], other=0.0)
            if UPCAST:
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
            m = m_new
        out = acc / l[:, None]
        tl.store(
            out_ptr + g * sog + rows[:, None] * sor + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None]
        )


def attention(
    q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float, split: int, window: int | None = None
) -> Tensor:
    """q[G, R, D] (the group's query rows), k / v[G, L, D], pos[G, R] (each row's position: key j is
    visible iff j <= pos, and with a sliding window iff pos - window < j <= pos) -> [G, R, D] in q.dtype.
    A chunk wholly before a row's window leaves it as it was (m stays -inf, alpha is 1), as past it."""
    g, rows, d = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # cache slices stay views
    if pos.dtype != torch.int32:
        pos = pos.to(torch.int32)
    if not pos.is_contiguous():
        pos = pos.contiguous()
    out = torch.empty_like(q)
    win = NO_WINDOW if window is None else int(window)
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
            q.dtype,
            float(scale),
            split,
            win,
            q.device.index,
            *(t.data_ptr() % 16 == 0 for t in (q, k, v, pos, out)),
        )
        plan = _PLANS.get(key)
        if plan is not None:
            plan(q.device.index, q, k, v, pos, out)
            return out
    grid = (g, triton.cdiv(rows, BLOCK_R))
    first = launch.Launch.first(
        _attn_kernel,
        grid,
        (
            q,
            k,
            v,
            pos,
            out,
            rows,
            k.shape[1],
            float(scale),
            win,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            pos.stride(0),
            out.stride(0),
            out.stride(1),
        ),
        dict(
            D=d,
            SPLIT=split,
            BLOCK_R=BLOCK_R,
            PRECISION="ieee" if q.dtype == torch.float32 or not q.is_cuda else "tf32",
            UPCAST=not q.is_cuda,
            num_warps=4,
            num_stages=2,
        ),
        slots=(0, 1, 2, 3, 4),
    )
    if first is not None and key is not None:
        launch.cache_put(_PLANS, key, first)
    return out


_PLANS: dict[tuple, launch.Launch] = {}
