"""The bio attention kernel as it was before it addressed query rows through strides (main at 4541b76):
q[G, R, D] (each (request, KV head)'s query rows copied position-major), k / v[G, L, D], pos[G, R] ->
[G, R, D]. The in-place kernel (`triton_attn.attention_heads`) is checked bitwise against it: under the
Triton interpreter (`triton_checks.py`) and on a GPU (tests/gpu). Kept verbatim but for the JIT-only
launch: only the addressing of the new kernel may differ."""

from __future__ import annotations

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the install
    triton = None

BLOCK_R = 16
NO_WINDOW = 2**30


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
        if UPCAST:
            q = q.to(tl.float32)
        pos = tl.load(pos_ptr + g * spg + rows, mask=live, other=0)
        m = tl.full([BLOCK_R], float("-inf"), tl.float32)
        l = tl.zeros([BLOCK_R], tl.float32)
        acc = tl.zeros([BLOCK_R, D], tl.float32)
        chunks = tl.max(pos, 0) // SPLIT + 1
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
            alpha = tl.where(m_new == m, 1.0, tl.exp(m - safe))
            p = tl.exp(s - safe[:, None])
            l = l * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / l[:, None]
        tl.store(
            out_ptr + g * sog + rows[:, None] * sor + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None]
        )


def attention(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float, split: int, window=None) -> Tensor:
    g, rows, d = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    pos = pos.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    win = NO_WINDOW if window is None else int(window)
    _attn_kernel[(g, triton.cdiv(rows, BLOCK_R))](
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
        D=d,
        SPLIT=split,
        BLOCK_R=BLOCK_R,
        PRECISION="ieee" if q.dtype == torch.float32 or not q.is_cuda else "tf32",
        UPCAST=not q.is_cuda,
        num_warps=4,
        num_stages=2,
    )
    return out


def heads(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, scale: float, split: int, window=None) -> Tensor:
    """What `fixed.attention` did around the kernel on GPU at 4541b76, q[B, Hq, T, D], k / v[B, Hkv, L, D],
    pos[B, T]: the position-major copy of the query rows, the kernel, the transpose back, then the copy the
    decoder made into o_proj's input [B, T, Hq, D]."""
    bsz, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    groups, g = hq // hkv, bsz * hkv
    qg = q.reshape(bsz, hkv, groups, t, d).transpose(2, 3).reshape(g, t * groups, d)
    rows_pos = pos[:, None, :, None].expand(bsz, hkv, t, groups).reshape(g, t * groups).to(torch.int32).contiguous()
    out = attention(qg, k.reshape(g, length, d), v.reshape(g, length, d), rows_pos, scale, split, window)
    out = out.view(bsz, hkv, t, groups, d).transpose(2, 3).reshape(bsz, hq, t, d)
    return out.transpose(1, 2).contiguous()
