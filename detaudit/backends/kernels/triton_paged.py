"""bio attention over a paged KV cache (vLLM's layout), with the bits of `triton_attn` over a contiguous one.

vLLM keeps keys and values in pages: `cache[page, slot, KV head, D]`, a request's key j in page
`block_table[b, j // PAGE]`, slot `j % PAGE`. Its scheduler packs a step's requests as ragged runs of
query tokens (`query_start_loc`, the runs' starts; a request's queries are the last of its `seq_lens`
positions). This kernel reads all of that in place, on the device, where the plugin once gathered each
request's keys into a contiguous copy and read the step's lengths on the host: no copies, no host sync,
so a whole decode step can be one CUDA graph.

Same bits as `triton_attn.attention_heads` over the gathered layout (k / v[B, Hkv, L, D], zero past
each request's length, what the built-in engine's cache holds): a program owns BLOCK_R rows of one
(request, KV head), position-major, walks the same chunks of SPLIT keys up to its furthest position, and
each chunk's tile is the same values (key j < seq_len from its page, zero beyond) fed to the same
`triton_attn.visit`. Only the addresses differ. A row of a request with fewer queries than the step's
longest run is not live (not read, not written): a padding request of a CUDA graph (no queries) writes
nothing.
"""

from __future__ import annotations

import torch
from torch import Tensor

from detaudit.backends.kernels import launch, triton_attn

try:
    import triton
    import triton.language as tl

    from detaudit.backends.kernels.triton_attn import fresh, store_rows, visit
except ImportError:  # pragma: no cover - depends on the install
    triton = None


if triton is not None:

    @triton.jit
    def _paged_rows(
        q_ptr,
        out_ptr,
        first,
        n_q,
        seq,
        start,
        h,
        sqt,
        sqh,
        sot,
        soh,
        GROUPS: tl.constexpr,
        D: tl.constexpr,
        BLOCK_R: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """Rows first .. first + BLOCK_R of (request, KV head h): their queries, positions, liveness and
        output rows. Row r is query t = r // GROUPS of query head h * GROUPS + r % GROUPS (position-major),
        the request's token start + t, at position seq - n_q + t (the queries are its last n_q positions)."""
        rows = first + tl.arange(0, BLOCK_R)
        live = rows < n_q * GROUPS
        t = rows // GROUPS
        head = h * GROUPS + rows % GROUPS
        d = tl.arange(0, D)
        token = (start + t).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * sqt + head[:, None] * sqh + d[None, :], mask=live[:, None], other=0.0)
        if UPCAST:  # the CPU interpreter cannot multiply bf16 (numpy has none)
            q = q.to(tl.float32)
        pos = tl.where(live, seq - n_q + t, 0)
        return q, pos, live, out_ptr + token * sot + head * soh

    @triton.jit
    def _paged_kernel(
        q_ptr,
        kc_ptr,
        vc_ptr,
        table_ptr,
        starts_ptr,
        seq_ptr,
        out_ptr,
        HKV,
        scale,
        WINDOW,
        sqt,
        sqh,
        skp,
        sks,
        skh,
        svp,
        svs,
        svh,
        stb,
        sot,
        soh,
        GROUPS: tl.constexpr,
        D: tl.constexpr,
        SPLIT: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_R: tl.constexpr,
        SUB: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """A program owns SUB blocks of BLOCK_R rows (`triton_attn._attn_kernel`: each chunk's page rows
        loaded once for all of them, each block updated by `visit` alone: a row's bits do not depend on SUB)."""
        g = tl.program_id(0)  # (request b, KV head h) = b * HKV + h
        b = g // HKV
        h = g % HKV
        start = tl.load(starts_ptr + b)
        n_q = tl.load(starts_ptr + b + 1) - start  # this request's query tokens in the step
        seq = tl.load(seq_ptr + b)  # its positions so far, the queries' included
        first = tl.program_id(1) * (BLOCK_R * SUB)
        if first >= n_q * GROUPS:  # no live row here (a shorter run than the step's longest)
            return
        q0, pos0, live0, dst0 = _paged_rows(
            q_ptr, out_ptr, first, n_q, seq, start, h, sqt, sqh, sot, soh, GROUPS, D, BLOCK_R, UPCAST
        )
        m0, l0, acc0 = fresh(BLOCK_R, D)
        top = tl.max(pos0, 0)
        if SUB > 1:
            q1, pos1, live1, dst1 = _paged_rows(
                q_ptr, out_ptr, first + BLOCK_R, n_q, seq, start, h, sqt, sqh, sot, soh, GROUPS, D, BLOCK_R, UPCAST
            )
            m1, l1, acc1 = fresh(BLOCK_R, D)
            top = tl.maximum(top, tl.max(pos1, 0))
        if SUB > 2:
            q2, pos2, live2, dst2 = _paged_rows(
                q_ptr, out_ptr, first + 2 * BLOCK_R, n_q, seq, start, h, sqt, sqh, sot, soh, GROUPS, D, BLOCK_R, UPCAST
            )
            q3, pos3, live3, dst3 = _paged_rows(
                q_ptr, out_ptr, first + 3 * BLOCK_R, n_q, seq, start, h, sqt, sqh, sot, soh, GROUPS, D, BLOCK_R, UPCAST
            )
            m2, l2, acc2 = fresh(BLOCK_R, D)
            m3, l3, acc3 = fresh(BLOCK_R, D)
            top = tl.maximum(top, tl.maximum(tl.max(pos2, 0), tl.max(pos3, 0)))
        d = tl.arange(0, D)
        chunks = top // SPLIT + 1  # the chunks this program's rows can reach
        for c in range(0, chunks):
            keys = c * SPLIT + tl.arange(0, SPLIT)
            inside = keys < seq
            page = tl.load(table_ptr + b * stb + keys // PAGE, mask=inside, other=0).to(tl.int64)
            slot = keys % PAGE
            k_rows = kc_ptr + page * skp + slot * sks + h * skh
            v_rows = vc_ptr + page * svp + slot * svs + h * svh
            k = tl.load(k_rows[:, None] + d[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_rows[:, None] + d[None, :], mask=inside[:, None], other=0.0)
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


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_table: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    max_query_len: int,
    scale: float,
    split: int,
    out: Tensor,
    block_r: int | None = None,
    sub: int = 1,
) -> Tensor:
    """query / out [tokens, Hq, D] (D contiguous); key_cache / value_cache [pages, PAGE, Hkv, D] (any
    strides, D contiguous: views of vLLM's [pages, 2, PAGE, Hkv, D]); block_table [requests, pages per
    request] (int32); query_start_loc [requests + 1] and seq_lens [requests] (int32, on the device);
    `max_query_len`: the longest run of query tokens (a host integer: it sizes the grid). Writes the
    live query rows of `out` and returns it. No host sync: the lengths are read by the kernel. `block_r`:
    query rows per block and `sub` blocks per program, as `triton_attn`'s (`block_r` None: the backends'
    choice, `triton_attn.rows_per_block` of the longest run's rows)."""
    hq, d = query.shape[1], query.shape[2]
    hkv, page = key_cache.shape[2], key_cache.shape[1]
    groups = hq // hkv
    if block_r is None:
        block_r = triton_attn.rows_per_block(max_query_len * groups, query.dtype, d, split)
    triton_attn.check_layout(block_r, sub)
    requests = query_start_loc.shape[0] - 1
    if requests <= 0 or max_query_len <= 0:
        return out
    for name, x in (("query", query), ("key_cache", key_cache), ("value_cache", value_cache), ("out", out)):
        if x.stride(-1) != 1:
            raise ValueError(f"paged_attention: {name}'s last dimension must be contiguous")
    if block_table.stride(-1) != 1:
        block_table = block_table.contiguous()
    tensors = (query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out)
    grid = (requests * hkv, triton.cdiv(max_query_len * groups, block_r * sub))
    args = (
        *tensors,
        hkv,
        float(scale),
        triton_attn.NO_WINDOW,
        query.stride(0),
        query.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        out.stride(0),
        out.stride(1),
    )
    key = None
    if query.is_cuda:  # a kept launch per plan key (see `launch`): every integer argument and alignment
        key = (grid, args[len(tensors) :], query.dtype, page, d, groups, split, block_r, sub, query.device.index)
        key += tuple(x.dtype for x in tensors) + tuple(x.data_ptr() % 16 == 0 for x in tensors)
        plan = _PLANS.get(key)
        if plan is not None:
            plan(query.device.index, *tensors)
            return out
    first = launch.Launch.first(
        _paged_kernel,
        grid,
        args,
        dict(
            GROUPS=groups,
            D=d,
            SPLIT=split,
            PAGE=page,
            BLOCK_R=block_r,
            SUB=sub,
            PRECISION="ieee" if query.dtype == torch.float32 or not query.is_cuda else "tf32",
            UPCAST=not query.is_cuda,
            num_warps=triton_attn.warps(block_r),
            num_stages=2,
        ),
        slots=tuple(range(len(tensors))),
    )
    if first is not None and key is not None:
        launch.cache_put(_PLANS, key, first)
    return out


_PLANS: dict[tuple, launch.Launch] = {}
