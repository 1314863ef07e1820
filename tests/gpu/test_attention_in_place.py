"""bio's attention kernel reading the model's q[B, Hq, T, D] in place and writing o_proj's [B, T, Hq, D]
(`triton_attn.attention_heads`) against the kernel before it, which read a position-major copy of the
query rows and whose output the engine transposed and copied twice (`tests/unit/attn_reference.py`, main
at 4541b76): bitwise at real shapes, prefill and decode. (Under the Triton interpreter:
`tests/unit/triton_checks.py`.)"""

from __future__ import annotations

import pytest
import torch
from helpers import require

from detaudit.backends import get_backend

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
triton = require("triton", "triton")


# (batch, query heads, KV heads, query positions, cached keys): Qwen3-8B at TP 1 and at TP 4, a
# Qwen3-30B-A3B rank at TP 8 (one replicated KV head for 4 query heads), decode steps
SHAPES = [(4, 32, 8, 512, 512), (8, 8, 2, 300, 700), (4, 4, 1, 512, 512), (32, 32, 8, 1, 900), (64, 4, 1, 1, 530)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bsz,hq,hkv,t,length", SHAPES)
def test_in_place_attention_gives_the_copied_layouts_bits(bsz, hq, hkv, t, length, dtype):
    from unit import attn_reference

    from detaudit.backends.kernels import fixed

    g = torch.Generator(device="cuda").manual_seed(bsz + t)
    d, size = 128, -(-length // 256) * 256  # the cache holds more slots than attention reads
    k_cache = torch.randn(bsz, hkv, size, d, device="cuda", generator=g).to(dtype)
    v_cache = torch.randn(bsz, hkv, size, d, device="cuda", generator=g).to(dtype)
    k, v = k_cache[:, :, :length], v_cache[:, :, :length]
    q = torch.randn(bsz, hq, t, d, device="cuda", generator=g).to(dtype)
    # each request's own positions: request b's last one (length - t) * b / bsz before the cache's end
    back = torch.arange(bsz, device="cuda")[:, None] * (length - t) // bsz
    pos = torch.arange(length - t, length, device="cuda").expand(bsz, t) - back
    for window in (None, 128):
        got = get_backend("bio").attention(q, k, v, pos, d**-0.5, window)
        want = attn_reference.heads(q, k, v, pos, d**-0.5, 64, window)  # bio's SPLIT: 64 keys a chunk
        flat = got.transpose(1, 2).reshape(bsz * t, hq * d)  # what the decoder hands o_proj
        assert flat.data_ptr() == got.data_ptr(), "o_proj's input is a view of the kernel's output"
        assert torch.equal(flat.view(bsz, t, hq, d), want), (bsz, hq, hkv, t, window)
    # q as a view of [B, T, Hq, D] (another layout of the same values): the same bits
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)
    assert torch.equal(fixed.attention(qt, k, v, pos, d**-0.5, 64), fixed.attention(q, k, v, pos, d**-0.5, 64))
