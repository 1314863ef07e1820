"""Batch-invariant primitives: every reduction has one fixed shape, so its order never depends on the
batch.

CPU: rows are processed in zero-padded blocks of R rows, one product of fixed shape [R, K] @ [K, N]
per block, each computed by one thread (`cpu_gemm`: the library's own threading may split K, and does
so differently for one block than for several). bf16 operands on a CPU with AVX-512 BF16 or AMX go
through oneDNN's bf16 micro-kernel with fp32 accumulation (`cpu_bf16`: R = 8, or 16 on AMX, W-column
panels); everything else is an fp32 product (R = 16). A row's bits then depend on nothing but its own values and the
weight: not on its position, the number of blocks or the thread count (tests/unit/test_bio.py checks
each, on both paths). GPU: the Triton kernel in `triton_mm`.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
from torch import Tensor

from detaudit.backends.kernels import (
    cpu_bf16,
    cpu_calls,
    cpu_gemm,
    cpu_replay,
    fused,
    triton_attn,
    triton_mm,
    triton_rows,
)

ROWS = 16  # R: rows per fixed-shape fp32 block on CPU (the bf16 paths' are cpu_bf16.ROWS)

# Derived copies of weights (fp32 or packed bf16, re-laid-out), keyed by the weight's identity and dropped with it;
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
    """fp32 [K, N] contiguous copy of w[N, K]. Transposed in w's dtype, then widened: the same values
    (widening to fp32 is exact), and the strided pass moves a bf16 weight's 2-byte elements, not 4."""
    return derived(w, "t", lambda d: d.t().contiguous().float())


def blocks_of(x: Tensor) -> Tensor:
    """x[..., M, K] as fp32 [..., ceil(M/R), R, K], rows zero padded: the left operand of
    `cpu_gemm.block_products` (x2[M, K] gives [nb, R, K]; a[G, M, K] gives [G, nb, R, K])."""
    *lead, m, k = x.shape
    nb = -(-m // ROWS)
    if m == nb * ROWS:
        return x.float().reshape(*lead, nb, ROWS, k)
    xp = torch.zeros(*lead, nb * ROWS, k, dtype=torch.float32, device=x.device)
    xp[..., :m, :] = x
    return xp.view(*lead, nb, ROWS, k)


def bmm_fixed(a: Tensor, b: Tensor) -> Tensor:
    """fp32 a[G, M, K] @ b[G or 1, K, N] where each product is computed in zero-padded R-row blocks."""
    g, m, k = a.shape
    n = b.shape[-1]
    ap = blocks_of(a)
    nb = ap.shape[1]
    bb = b.float()
    out = cpu_gemm.block_products(ap, bb.expand(g, k, n) if bb.shape[0] == 1 else bb)
    return out.view(g, nb * ROWS, n)[:, :m]


def matmul(x: Tensor, w: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """x[..., K] @ w[N, K]^T accumulated in fp32, batch invariant, rounded once to `out_dtype` (on GPU
    inside the kernel's epilogue: no separate cast pass)."""
    if x.is_cuda and x.dim() == 2:  # the engine's layers: no reshapes
        return triton_mm.mm(x, w, out_dtype=out_dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    n = w.shape[0]
    if x.is_cuda:
        return triton_mm.mm(x2, w, out_dtype=out_dtype).reshape(*lead, n)
    if cpu_bf16.usable(x2, w):
        packed = derived(w, "bf16-panels", cpu_bf16.pack)
        return cpu_bf16.matmul(x2, packed, n, out_dtype).reshape(*lead, n)  # already out_dtype
    out = cpu_gemm.block_products(blocks_of(x2), weight_t(w))
    return out.view(-1, n)[: x2.shape[0]].reshape(*lead, n).to(out_dtype)


def describe_cpu() -> dict[str, str]:
    """How this process computes on CPU: `cpu_gemm` is the product path chosen for this machine and why,
    `matmul_cpu` the block shapes, `cpu_kernels` whether attention and RMSNorm run compiled."""
    c = cpu_bf16.choice()
    kernels = {"cpu_kernels": cpu_calls.describe()}
    fp32 = (
        f"fp32 products on zero-padded blocks of R={ROWS} rows, fixed shape [R, K] @ [K, N] (N widened with zero "
        f"columns to at least {cpu_gemm.MIN_COLUMNS} and {cpu_gemm.MIN_MACS} / (R K)), one thread per block product"
    )
    if not c.bf16:
        return {
            "cpu_gemm": c.describe(),
            "matmul_cpu": f"{fp32} (blocks or 64-column panels spread over worker threads)",
            **kernels,
        }
    return {
        "cpu_gemm": c.describe(),
        "matmul_cpu": "bf16 operands: bf16 x bf16 products accumulated in fp32 on zero-padded blocks of "
        f"R={c.rows} rows, one call shape [R, K] @ [K, W] per weight (W: the widest multiple of "
        f"{cpu_bf16.PANEL_UNIT} up to {cpu_bf16.PANEL_MAX} dividing N), one thread per call; fp32 operands "
        f"(attention, row sums): {fp32}",
        **kernels,
    }


def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """silu(gate) * up, each element by the same instructions wherever it sits (CPU: the result of an
    element depends on nothing but its own gate and up values).

    `F.silu` on CPU computes vectors of 2 x the SIMD width with a vector formula and the elements left
    over (a row narrower than that, the tail of a strided slice) with a scalar one whose exp is libm's:
    the two differ in the last bit of about 4% of fp32 elements. A rank's gate is a column slice of its
    merged gate / up product, so its width, and which path an element takes, changed with the TP size
    (and with the batch at a tail): that broke bio+tbik's TP invariance at fp32 on shards narrower than
    32 columns. Where numba runs (`cpu_calls.compiled`), one compiled call (`cpu_rows.silu_mul`):
    e = exp(-|gate|) by the attention's polynomial, silu = gate / (1 + e), or gate * e / (1 + e) below
    0, in fp32 IEEE operations that are the same in vector lanes and in the scalar tail. Else exp is
    `torch.exp`, whose CPU kernel (vml) runs every element, tails and strided inputs included, through
    the same vector code; negation, the add and the division are IEEE operations, exact alike in scalar
    and vector code (PyTorch's vector formula). Either way in fp32, rounded once to the gate's dtype,
    then * up; the two CPU paths' bits differ (`describe_cpu` names the one taken). GPU:
    `fused.silu_mul` (the bits of F.silu * up: one thread an element, the same code for each) where
    Triton runs, else F.silu."""
    if gate.device.type != "cpu":
        return fused.silu_mul(gate, up) if fused.usable(gate) else torch.nn.functional.silu(gate) * up
    compiled = _silu_compiled(gate, up)
    if compiled is not None:
        return compiled
    g = gate.float()
    return (g / (torch.exp(-g) + 1)).to(gate.dtype) * up


def _silu_compiled(gate: Tensor, up: Tensor) -> Tensor | None:
    """silu(gate) * up by the compiled row kernel (`cpu_rows.silu_mul`: its exp is the attention's
    polynomial, every element by the same IEEE operations; a prefill's rows spread over threads by
    `cpu_calls.rows`), or None where it does not run (no numba, DETAUDIT_CPU_COMPILED=off, a dtype other
    than bf16 / fp32). torch.exp's CPU kernel cost 0.15-0.19 ms for a decode step's [8, 1536] gate on the
    16-core AMX host (reports/cpu-bf16), with the rest of the formula 5 more ops; this is one call."""
    rows = cpu_calls.compiled("cpu_rows")
    dtype = gate.dtype
    if rows is None or dtype not in (torch.bfloat16, torch.float32) or up.dtype != dtype or gate.shape != up.shape:
        return None
    if gate.dim() == 0 or gate.numel() == 0:
        return None
    shape = gate.shape
    g2, u2 = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
    out = torch.empty(g2.shape, dtype=dtype)
    bf16 = dtype == torch.bfloat16
    as_bits = torch.int16 if bf16 else dtype  # the bf16 bits as int16 (a view of any strides)
    gn, un, on = (t.view(as_bits).numpy() for t in (g2, u2, out))

    def part(lo: int, hi: int) -> None:  # an element's bits are its own: any split gives the same
        rows.silu_mul(gn[lo:hi], un[lo:hi], bf16, on[lo:hi])

    with cpu_gemm.profiled("detaudit::cpu_silu"):
        cpu_calls.rows("silu", part, g2.shape[0], gn, un, on, bf16)
    return out.view(shape)


def rope_store(
    q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, cache, head_dim: int
) -> Tensor | None:
    """`cpu_rows.rope_rows`: the rotary embedding of q[B*T, Hq*D] and k[B*T, Hkv*D] (any row stride: the
    columns of the merged q / k / v product) by cos / sin [B, 1, T, D], k and v[B*T, Hkv*D] written into
    the cache [B, Hkv, L, D] at rows pos[B, T]; returns the rotated q as [B, Hq, T, D] (a transposed
    view). The PyTorch ops' bits (each product and the sum rounded to the model dtype), in one call instead
    of about fourteen small ops a layer, its rows spread over the team where they are many (`cpu_calls.rope`).
    None where it does not run (no numba, DETAUDIT_CPU_COMPILED=off, a dtype other than bf16 / fp32,
    positions not int64, a head's values not contiguous). A prefill's rows too: on a 16-core AMX host its
    rotary was fourteen torch ops a layer, each a parallel region or a copy (reports/cpu-bf16)."""
    k_cache, v_cache = cache
    dtype = q.dtype
    if dtype not in (torch.bfloat16, torch.float32) or q.device.type != "cpu":
        return None
    if pos.dtype != torch.int64:
        return None
    if any(t.dtype != dtype for t in (k, v, cos, sin, k_cache, v_cache)):
        return None
    rows = cpu_calls.compiled("cpu_rows")
    if rows is None:
        return None
    bsz, t = pos.shape
    out = torch.empty(bsz, t, q.shape[1] // head_dim, head_dim, dtype=dtype)
    bf16 = dtype == torch.bfloat16
    as_bits = torch.int16 if bf16 else dtype
    # numpy's views (torch's reshape and slicing cost several microseconds a call here)
    qn, kn, vn = (x.view(as_bits).numpy().reshape(bsz, t, -1, head_dim) for x in (q, k, v))
    cn, sn = (x.view(as_bits).numpy()[:, 0] for x in (cos, sin))
    kc, vc, on = (x.view(as_bits).numpy() for x in (k_cache, v_cache, out))
    arrays = (qn, kn, vn, cn, sn, pos.numpy(), kc, vc, on)
    block = rows.rope_block(arrays)
    if block is None:  # a head's values not contiguous
        return None
    cpu_replay.keep(arrays)  # (the block holds their addresses)
    with cpu_gemm.profiled("detaudit::cpu_rope"):
        cpu_calls.rope(block, bsz * t, bsz * t * (qn.shape[2] + kn.shape[2]) * head_dim, bf16)
    return out.transpose(1, 2)


def add_rms(x: Tensor, delta: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor] | None:
    """`cpu_rows.add_rms`: (RMSNorm(s) * weight, s) for s = x + delta (x where delta is None), bio's
    add_norm (x[M, K] contiguous) in one compiled call, its rows spread over threads where they are many
    (`cpu_calls.add_rms`): the bits of the add, `bio._rms_norm`'s compiled rows, the cast and the product
    with the weight, op by op, where those were four torch ops (each a parallel region on a many-core
    host) and the rows. None where it does not run (no numba, DETAUDIT_CPU_COMPILED=off, a dtype other
    than bf16 / fp32)."""
    dtype = x.dtype
    if dtype not in (torch.bfloat16, torch.float32) or x.dim() != 2:
        return None
    if x.device.type != "cpu" or weight.dtype != dtype or not x.is_contiguous():
        return None
    if delta is not None and (delta.dtype != dtype or delta.shape != x.shape):
        return None
    rows = cpu_calls.compiled("cpu_rows")
    if rows is None:
        return None
    s, y = torch.empty_like(x), torch.empty_like(x)
    bf16 = dtype == torch.bfloat16
    as_bits = torch.int16 if bf16 else dtype
    xn, wn, sn, yn = (t.view(as_bits).numpy() for t in (x, weight, s, y))
    dn = None if delta is None else delta.view(as_bits).numpy()
    with cpu_gemm.profiled("detaudit::cpu_add_rms"):
        cpu_calls.add_rms(xn, dn, wn, bf16, eps, sn, yn)
    return y, s


_ONES: dict[tuple[int, str], Tensor] = {}


def row_sum(x: Tensor) -> Tensor:
    """fp32 sum over the last dim. [..., K] -> [..., 1]. CPU: a fixed-shape product with ones; GPU: one
    Triton program per row (`triton_rows`).

    The ones have 8 columns, not 1: with N = 1 MKL takes a GEMV path whose order depends on M
    (measured on the CI CPU; tests/unit/test_bio.py guards it)."""
    if x.is_cuda and x.dim() == 2 and x.dtype == torch.float32:  # no reshapes
        return triton_rows.row_sum(x).view(-1, 1)
    k = x.shape[-1]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k).float()
    if x.is_cuda:  # one program per row, the whole row in a fixed order
        return triton_rows.row_sum(x2).reshape(*lead, 1)
    key = (k, str(x.device))
    if key not in _ONES:
        _ONES[key] = torch.ones(8, k, dtype=torch.float32, device=x.device)
    return matmul(x2, _ONES[key])[:, :1].reshape(*lead, 1)


def batched(a: Tensor, b_t: Tensor) -> Tensor:
    """fp32 a[G, M, K] @ b_t[G, N, K]^T (b_t may be a strided view), batch invariant in G and M."""
    if a.is_cuda:  # fp32 operands (IEEE, no TF32), as on CPU
        return triton_mm.mm(a.float(), b_t.float())
    return bmm_fixed(a.float(), b_t.float().transpose(1, 2))


def expert_matmul(x3: Tensor, w3: Tensor) -> Tensor:
    """fp32 x3[E, R, K] @ w3[E, N, K]^T per expert, batch invariant in R (a row's bits do not depend on
    the other rows): on GPU the Triton kernel over the expert batch (the model dtype's inputs, fp32
    accumulation), on CPU the fixed-shape fp32 block products."""
    if x3.is_cuda:
        return triton_mm.mm(x3, w3)
    return bmm_fixed(x3.float(), w3.float().transpose(1, 2))


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_pos: Tensor,
    scale: float,
    split: int,
    window: int | None = None,
    plan: dict | None = None,
) -> Tensor:
    """Causal attention over the cache in fixed-size KV chunks of `split` keys (never a fixed number of
    chunks), with an fp32 online softmax. A chunk a row cannot see is an exact no-op for that row, so the
    result does not depend on how long the batch's longest sequence is, and a query's output is the same
    whether it is computed in prefill (many queries) or decode (one). Being a no-op, such a row is not
    computed at all: rows are laid out (position, query head) so that the rows a chunk can reach form a
    suffix, and only that suffix runs (half the work of a prefill; the same bits). With a sliding
    `window`, key j is visible iff pos - window < j <= pos; a chunk wholly before a row's window is, like
    one past it, an exact no-op for that row (before any visible chunk the state is still empty).
    `plan`: a dict shared by the layers of one forward step (same `q_pos`), where the rows' positions in
    the kernel's layout are kept after the first layer computes them."""
    bsz, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    groups = hq // hkv
    g = bsz * hkv
    if triton_attn.supported(q):  # GPU: the same algorithm as one kernel (its own bits; see triton_attn)
        # the kernel reads each (request, KV head)'s query rows position-major in place and writes
        # [B, T, Hq, D] (returned as its [B, Hq, T, D] view: o_proj's input without a copy)
        pos32 = _memo(plan, "pos32", lambda: q_pos.to(torch.int32).contiguous())
        return triton_attn.attention_heads(q, k, v, pos32, scale, split, window)
    kernel = cpu_calls.compiled("cpu_attention") if q.device.type == "cpu" else None
    if kernel is not None:
        return _attention_compiled(kernel, q, k, v, q_pos, scale, window, plan)
    # the queries of one KV head together, position-major: [B*Hkv, T*groups, D]
    qg = q.reshape(bsz, hkv, groups, t, d).transpose(2, 3).reshape(g, t * groups, d)
    pos = _memo(
        plan, ("pos", hkv, groups), lambda: q_pos[:, None, :, None].expand(bsz, hkv, t, groups).reshape(g, -1, 1)
    )
    qs = qg.float() * scale
    rows = qs.shape[1]
    m = torch.full((g, rows, 1), float("-inf"), device=q.device)
    l = torch.zeros((g, rows, 1), device=q.device)
    acc = torch.zeros((g, rows, d), device=q.device)
    if t == 1:  # decode: every chunk's products in one call each, then the same recurrence (no host sync:
        # a CUDA graph can capture it)
        out = _decode_chunks(qs, pos, k, v, split, m, l, acc, window, plan)
        return out.view(bsz, hkv, t, groups, d).transpose(2, 3).reshape(bsz, hq, t, d).to(q.dtype)
    kf = k.reshape(g, length, d)
    vf = v.reshape(g, length, d)
    latest = q_pos.amax(0).tolist()  # per query index, the furthest position any request has there
    for start in range(0, length, split):
        first = next((i for i, p in enumerate(latest) if p >= start), None)
        if first is None:  # no query reaches this chunk
            continue
        r = slice(first * groups, rows)  # rows before it cannot see the chunk: exact no-ops, skipped
        kc = kf[:, start : start + split]
        width = kc.shape[1]
        if width < split:  # pad the last chunk: same shapes for every chunk
            kc = torch.nn.functional.pad(kc, (0, 0, 0, split - width))
        vc = _values_and_ones(vf[:, start : start + split], split)
        s = batched(qs[:, r], kc)  # [G, rows', split]
        keys = torch.arange(start, start + split, device=q.device).view(1, 1, -1)
        s = s.masked_fill(_hidden(keys, pos[:, r], window), float("-inf"))
        m_old = m[:, r]
        m_new = torch.maximum(m_old, s.amax(-1, keepdim=True))
        safe = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)
        alpha = torch.exp(m_old - safe)  # exp(-inf) = 0 on the first visible chunk; 1 on an unseen chunk
        p = torch.exp(s - safe)  # masked keys: exp(-inf) = 0
        pv = batched(p, vc.transpose(1, 2))  # [G, rows', D + 1]: P @ V and, in the last column, P's row sums
        l[:, r] = l[:, r] * alpha + pv[..., d:]
        acc[:, r] = acc[:, r] * alpha + pv[..., :d]
        m[:, r] = m_new
    out = acc / l
    return out.view(bsz, hkv, t, groups, d).transpose(2, 3).reshape(bsz, hq, t, d).to(q.dtype)


ATTENTION_SPLIT_FLOPS = 1e6  # below this one thread computes the compiled attention (a hand-off costs ~0.1 ms)
ATTENTION_FLOPS_PER_THREAD = 4e6  # past it, a thread per this much (`cpu_calls.threads_for`)...
ATTENTION_TEAM_FLOPS_PER_THREAD = 1e6  # ...or this much on the compiled team (`cpu_calls.share`)


def _attention_compiled(kernel, q, k, v, q_pos, scale: float, window: int | None, plan: dict | None) -> Tensor:
    """`kernel.attend` (the `cpu_attention` module) over q[B, Hq, T, D]'s rows in the attention's layout
    (KV head g's rows (t, j) for query head h * groups + j, position-major, [G, T * groups, D]), the KV
    heads split over the threads. Each thread scales its heads' queries into that layout from where the
    rotary left them (`cpu_rows.scaled_heads`: `qg.float() * scale`'s bits) and puts its rows of the fp32
    output, cast to q's dtype (`cpu_rows.heads_out`: torch's rounding), into [B, T, Hq, D], o_proj's input:
    returned as its [B, Hq, T, D] view. On a 16-core AMX host the transposed copies and the cast on either
    side of the kernel, and the queries scaled on this thread, were a prefill's largest costs after the
    products (reports/cpu-bf16)."""
    bsz, hq, t, d = q.shape
    hkv, length = k.shape[1], k.shape[2]
    groups = hq // hkv
    g, rows = bsz * hkv, t * groups
    dtype = q.dtype if q.dtype in (torch.bfloat16, torch.float32) else torch.float32
    qt = q.transpose(1, 2).to(dtype)  # [B, T, Hq, D]: a view where the rotary wrote [B, T, Hq, D]
    if qt.stride(-1) != 1:
        qt = qt.contiguous()
    o = torch.empty(bsz, t, hq, d, dtype=dtype)
    as_bits = torch.int16 if dtype == torch.bfloat16 else torch.float32
    heads = (qt.view(as_bits).numpy(), o.view(as_bits).numpy())
    block = cpu_calls.compiled("cpu_rows").heads_block(*heads, hkv, scale)
    cpu_replay.keep(heads)  # (the block holds their addresses)
    pos = _memo(
        plan,
        ("pos2", hkv, groups),
        lambda: q_pos[:, None, :, None].expand(bsz, hkv, t, groups).reshape(g, rows).contiguous().numpy(),
    )
    bf16 = k.dtype == torch.bfloat16
    if bf16:  # the cache's own bits (a view: the cache slice merges B and Hkv without a copy)
        kn, vn = (x.reshape(g, length, d).view(torch.int16).numpy() for x in (k, v))
    else:
        kn, vn = (x.reshape(g, length, d).float().numpy() for x in (k, v))
    qs, out = (np.empty((g, rows, d), dtype=np.float32) for _ in range(2))
    work = 4.0 * g * rows * d * length  # flops of the scores and the weighted values, at most
    with cpu_gemm.profiled("detaudit::cpu_attention"):
        per_thread = cpu_calls.share(ATTENTION_FLOPS_PER_THREAD, ATTENTION_TEAM_FLOPS_PER_THREAD)
        threads = cpu_calls.threads_for(g, work, ATTENTION_SPLIT_FLOPS, per_thread)
        _attend(kernel, block, qs, pos, kn, vn, bf16, window or 0, out, threads)
    o = o.transpose(1, 2)
    return o if o.dtype == q.dtype else o.to(q.dtype)


@cpu_replay.unit
def _attend(kernel, heads, qs, pos, kn, vn, bf16: bool, window: int, on, threads: int) -> None:
    """Over the KV heads (qs[G, R, D]) on `threads` threads, the team's, else the Python pool's (one
    recorded unit: which of the two runs is decided again at each replay): a slice's queries scaled into
    qs, `kernel.attend` into `on`, its rows put in the output (`heads`: a `cpu_rows.heads_block`)."""
    if threads > 1 and cpu_calls.attend_on_team(qs, pos, kn, vn, bf16, window, on, threads, heads):
        return
    rows = cpu_calls.compiled("cpu_rows")

    def part(lo: int, hi: int) -> None:
        rows.scaled_heads(heads, qs, lo, hi)
        kernel.attend(qs[lo:hi], pos[lo:hi], kn[lo:hi], vn[lo:hi], bf16, window, on[lo:hi])
        rows.heads_out(heads, on, lo, hi)

    cpu_calls.slices(qs.shape[0], part, threads)


def _memo(plan: dict | None, key, make):
    """make(), kept in the step's `plan` (shared by its layers) under `key` where there is one."""
    if plan is None:
        return make()
    hit = plan.get(key)
    if hit is None:
        hit = plan[key] = make()
    return hit


def _values_and_ones(vc: Tensor, split: int) -> Tensor:
    """fp32 [G, split, D + 1]: the chunk's values (zero rows past its end) and a column of ones, so one
    fixed-shape product [R, split] @ [split, D + 1] gives P @ V and P's row sums (`_decode_chunks` builds
    the same operand from the cache)."""
    g, width, d = vc.shape
    out = torch.empty(g, split, d + 1, dtype=torch.float32, device=vc.device)
    out[:, :width, :d] = vc
    out[:, width:, :d] = 0
    out[:, :, d] = 1
    return out


def _hidden(keys: Tensor, pos: Tensor, window: int | None) -> Tensor:
    """Keys a query at `pos` cannot see: later ones, and with a sliding window those at or before
    pos - window."""
    return keys > pos if window is None else (keys > pos) | (keys <= pos - window)


def _chunks_f32(x: Tensor, chunks: int, split: int, transpose: bool, ones: bool = False) -> Tensor:
    """The cache x[B, Hkv, L, D] as fp32 chunks of `split` keys, zero padded: [G * chunks, split, D], or
    [G * chunks, D, split] with `transpose` (G = B * Hkv), contiguous: the operands `batched` would make
    from the padded cache (reshape, pad, cast, and for keys the transposed copy of `block_products`),
    in one strided copy instead of four. With `ones`, [G * chunks, split, D + 1], a column of ones last
    (the operand of `_values_and_ones`)."""
    bsz, hkv, length, d = x.shape
    g, full = bsz * hkv, length // split
    shape = (g, chunks, d, split) if transpose else (g, chunks, split, d + ones)
    out = torch.empty(shape, dtype=torch.float32, device=x.device)
    keys = out.transpose(2, 3) if transpose else out[..., :d]  # [G, chunks, split, D] views of out
    if ones:
        out[..., d] = 1
    if full:
        keys[:, :full].copy_(x[:, :, : full * split].reshape(g, full, split, d))
    if full < chunks:  # the last, partial chunk and its zero padding
        rest = length - full * split
        keys[:, full, :rest].copy_(x[:, :, full * split :].reshape(g, rest, d))
        keys[:, full, rest:].zero_()
    return out.view(g * chunks, *out.shape[2:])


def _decode_chunks(
    qs: Tensor,
    pos: Tensor,
    k: Tensor,
    v: Tensor,
    split: int,
    m: Tensor,
    l: Tensor,
    acc: Tensor,
    window: int | None = None,
    plan: dict | None = None,
) -> Tensor:
    """`attention`'s chunk loop for a few query rows (decode), with every chunk's scores and P @ V
    products (with P's row sums) computed by one call each: the running max is a cumulative max over
    the chunks' maxima (max is exact in any order), and the recurrence over chunks then applies the
    same elementwise operations, chunk by chunk, as the loop. Same bits, far fewer calls. The products
    get the operands `batched` would build from the padded cache, made in one copy each
    (`_chunks_f32`); the mask is made once per step (`plan`)."""
    g, rows, d = qs.shape
    chunks = -(-k.shape[2] // split)
    q_all = qs[:, None].expand(g, chunks, rows, d).reshape(g * chunks, rows, d)
    s = cpu_gemm.block_products(blocks_of(q_all), _chunks_f32(k, chunks, split, transpose=True))
    s = s.view(g, chunks, -1, split)[:, :, :rows]

    def hidden() -> Tensor:
        keys = torch.arange(chunks * split, device=qs.device).view(1, chunks, 1, split)
        return _hidden(keys, pos[:, None], window)

    s = s.masked_fill(_memo(plan, ("hidden", g, rows, chunks, window), hidden), float("-inf"))
    m_all = torch.cummax(s.amax(-1, keepdim=True), dim=1).values  # [g, chunks, rows, 1]
    safe = torch.where(torch.isinf(m_all), torch.zeros_like(m_all), m_all)
    p = torch.exp(s - safe)
    vs = _chunks_f32(v, chunks, split, False, ones=True)
    pv = cpu_gemm.block_products(blocks_of(p.reshape(g * chunks, rows, split)), vs)
    pv = pv.view(g, chunks, -1, d + 1)[:, :, :rows]
    for c in range(chunks):
        alpha = torch.exp(m - safe[:, c])
        l = l * alpha + pv[:, c, :, d:]
        acc = acc * alpha + pv[:, c, :, :d]
        m = m_all[:, c]
    return acc / l
