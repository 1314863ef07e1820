"""Batch-invariant primitives: every reduction has one fixed shape, so its order never depends on the
batch.

CPU: rows are processed in zero-padded blocks of R rows, one fp32 product of fixed shape
[R, K] @ [K, N] per block, each computed by one thread (`cpu_gemm`: the library's own threading may
split K, and does so differently for one block than for several). A row's bits then depend on
nothing but its own values and the weight: not on its position, the number of blocks or the thread
count (tests/test_bio.py checks each). GPU: the Triton kernel in `triton_mm`.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from detaudit.backends.kernels import cpu_gemm, triton_mm

ROWS = 16  # R: rows per fixed-shape block on CPU

# Derived copies of weights (fp32, re-laid-out), keyed by the weight's identity and dropped with it;
# rebuilt when the weight is modified in place. (A WeakKeyDictionary cannot hold tensors: their == is
# elementwise.)
_DERIVED: dict[tuple[int, str], tuple[int, Tensor]] = {}


def _version(w: Tensor) -> int:
    try:
        return w._version
    except RuntimeError:  # an inference tensor: no version counter (weights loaded under inference_mode)
        return -1


def derived(w: Tensor, key: str, build) -> Tensor:
    slot = (id(w), key)
    hit = _DERIVED.get(slot)
    if hit is not None and hit[0] == _version(w):
        return hit[1]
    if hit is None:
        weakref.finalize(w, _DERIVED.pop, slot, None)
    value = build(w.detach())
    _DERIVED[slot] = (_version(w), value)
    return value


def weight_t(w: Tensor) -> Tensor:
    """fp32 [K, N] contiguous copy of w[N, K]."""
    return derived(w, "t", lambda d: d.float().t().contiguous())


def blocks_of(x2: Tensor, rows: int = ROWS) -> Tensor:
    """x2[M, K] as fp32 [ceil(M/R), R, K], zero padded."""
    m, k = x2.shape
    nb = -(-m // rows)
    if m == nb * rows:
        return x2.float().reshape(nb, rows, k)
    xp = torch.zeros(nb * rows, k, dtype=torch.float32, device=x2.device)
    xp[:m] = x2
    return xp.view(nb, rows, k)


def bmm_fixed(a: Tensor, b: Tensor) -> Tensor:
    """fp32 a[G, M, K] @ b[G or 1, K, N] where each product is computed in zero-padded R-row blocks."""
    g, m, k = a.shape
    n = b.shape[-1]
    nb = -(-m // ROWS)
    if m != nb * ROWS:
        ap = torch.zeros(g, nb * ROWS, k, dtype=torch.float32, device=a.device)
        ap[:, :m] = a
    else:
        ap = a.float()
    ap = ap.reshape(g * nb, ROWS, k)
    bb = b.float()
    bb = bb.unsqueeze(1).expand(bb.shape[0], nb, k, n).reshape(-1, k, n) if bb.shape[0] > 1 else bb[0]
    return cpu_gemm.block_products(ap, bb).view(g, nb * ROWS, n)[:, :m]


def matmul(x: Tensor, w: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """x[..., K] @ w[N, K]^T accumulated in fp32, batch invariant, rounded once to `out_dtype` (on GPU
    inside the kernel's epilogue: no separate cast pass)."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x.is_cuda:
        return triton_mm.mm(x2, w, out_dtype=out_dtype).reshape(*lead, w.shape[0])
    out = cpu_gemm.block_products(blocks_of(x2), weight_t(w))
    return out.view(-1, w.shape[0])[: x2.shape[0]].reshape(*lead, w.shape[0]).to(out_dtype)


_ONES: dict[tuple[int, str], Tensor] = {}


def row_sum(x: Tensor) -> Tensor:
    """fp32 sum over the last dim, as a fixed-shape product with ones. [..., K] -> [..., 1]

    The ones have 8 columns, not 1: with N = 1 MKL takes a GEMV path whose order depends on M
    (measured on the CI CPU; tests/test_bio.py guards it)."""
    k = x.shape[-1]
    key = (k, str(x.device))
    if key not in _ONES:
        _ONES[key] = torch.ones(8, k, dtype=torch.float32, device=x.device)
    ones = _ONES[key]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).float()
    out = triton_mm.mm(x2.contiguous(), ones) if x.is_cuda else matmul(x2, ones)
    return out[:, :1].reshape(*lead, 1)


def batched(a: Tensor, b_t: Tensor) -> Tensor:
    """fp32 a[G, M, K] @ b_t[G, N, K]^T (b_t may be a strided view), batch invariant in G and M."""
    if a.is_cuda:  # fp32 operands (IEEE, no TF32), as on CPU
        return triton_mm.mm(a.float(), b_t.float())
    return bmm_fixed(a.float(), b_t.float().transpose(1, 2))


def attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, split: int) -> Tensor:
    """Causal attention over the cache in fixed-size KV chunks of `split` keys (never a fixed number of
    chunks), with an fp32 online softmax. A chunk a row cannot see is an exact no-op for that row, so the
    result does not depend on how long the batch's longest sequence is, and a query's output is the same
    whether it is computed in prefill (many queries) or decode (one)."""
    bsz, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    groups = hq // hkv
    # queries of one KV head together: [B*Hkv, groups*T, D]
    qg = q.reshape(bsz, hkv, groups * t, d).reshape(bsz * hkv, groups * t, d)
    pos = q_pos[:, None, None, :].expand(bsz, hkv, groups, t).reshape(bsz * hkv, groups * t, 1)
    kf = k.reshape(bsz * hkv, length, d)
    vf = v.reshape(bsz * hkv, length, d)
    rows = qg.shape[1]
    m = torch.full((bsz * hkv, rows, 1), float("-inf"), device=q.device)
    l = torch.zeros((bsz * hkv, rows, 1), device=q.device)
    acc = torch.zeros((bsz * hkv, rows, d), device=q.device)
    qs = qg.float() * scale
    for start in range(0, length, split):
        kc = kf[:, start : start + split]
        vc = vf[:, start : start + split]
        width = kc.shape[1]
        if width < split:  # pad the last chunk: same shapes for every chunk
            kc = torch.nn.functional.pad(kc, (0, 0, 0, split - width))
            vc = torch.nn.functional.pad(vc, (0, 0, 0, split - width))
        s = batched(qs, kc)  # [G, rows, split]
        keys = torch.arange(start, start + split, device=q.device).view(1, 1, -1)
        visible = keys <= pos
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m - safe)  # exp(-inf) = 0 on the first visible chunk; 1 on an unseen chunk
        p = torch.exp(s - safe)  # masked keys: exp(-inf) = 0
        l = l * alpha + row_sum(p)
        acc = acc * alpha + batched(p, vc.transpose(1, 2))
        m = m_new
    out = acc / l
    return out.view(bsz, hkv, groups, t, d).reshape(bsz, hq, t, d).to(q.dtype)
