"""KV heads replicated where TP exceeds them (`ModelConfig.kv_replicas`, as vLLM and SGLang do): a tiny
Qwen3 with 2 KV heads over real TP 1 / 2 / 4 / 8 (gloo worker processes), so TP 4 and 8 hold each KV head
on 2 and 4 ranks. bio+tbik gives TP 1's bits at every size, fp32 and bf16; bio stays batch invariant.
(Against transformers, emulated TP 8 under every backend: `test_arch_parity.py`.)"""

from __future__ import annotations

import pytest
from helpers import builtin_engine, generation_difference, local_engine

from detaudit.config import DecodingParams

pytestmark = pytest.mark.slow  # worker processes

PROMPTS = [[5 + i for i in range(n)] for n in (3, 9, 17)]
IDS = ["a", "b", "c"]
DECODINGS = (DecodingParams(greedy=True, max_new_tokens=4), DecodingParams(max_new_tokens=4, seed=3))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tbik_bitwise_over_tp_with_replicated_kv_heads(tiny_qwen3_kv2, dtype):
    """Every recorded number (fp32 log-probs included) of every prompt, greedy and sampled, at real TP 2, 4
    and 8 equals TP 1's in this process."""
    one = local_engine(tiny_qwen3_kv2, "bio+tbik", 1, dtype=dtype)
    want = [one.generate(PROMPTS, IDS, d, 3) for d in DECODINGS]
    assert generation_difference(want[0], want[1]) is not None  # sampled is not greedy: both paths compared
    for tp in (2, 4, 8):
        eng = builtin_engine(tiny_qwen3_kv2, "bio+tbik", tp, "real", dtype=dtype)
        try:
            assert eng.describe()["workers"] == tp
            got = [eng.generate(PROMPTS, IDS, d, 3) for d in DECODINGS]
        finally:
            eng.close()
        for d, a, b in zip(DECODINGS, got, want):
            assert generation_difference(a, b) is None, (tp, d)


def test_bio_batch_invariant_with_replicated_kv_heads(tiny_qwen3_kv2):
    """bio at real TP 8 in bf16 (each KV head on 4 ranks): a prompt alone gives the bits it gets in a batch
    of 3 prompts of other lengths."""
    greedy = DECODINGS[0]
    eng = builtin_engine(tiny_qwen3_kv2, "bio", 8, "real", dtype="bfloat16")
    try:
        batch = eng.generate(PROMPTS, IDS, greedy, 3)
        alone = [eng.generate([p], [i], greedy, 1)[0] for p, i in zip(PROMPTS, IDS)]
    finally:
        eng.close()
    assert generation_difference(alone, batch) is None
