"""Speculative decoding on a tiny random Llama (fast: the embedded model's versions are in
test_speculative_engine.py): bio+tbik at fp32 bits with and without speculation (sampled over the whole
vocabulary with n-gram drafts; greedy with a draft model that is the target itself, whose drafts are then
all accepted: the draft computes the target's bits at TP 1 while the target runs emulated TP 2)."""

from __future__ import annotations

import random

from helpers import generation_difference, local_engine

from detaudit.config import DecodingParams, Speculative
from detaudit.models import resolve_model

NEW = 16


def _prompts():
    rng = random.Random(0)
    base = [rng.randrange(300) for _ in range(9)]
    return [base * 3, [rng.randrange(300) for _ in range(14)]], ["a", "b"]


def test_tiny_tbik_speculation_bitwise_and_a_self_draft_accepts_everything(tiny_llama):
    ids, pids = _prompts()
    target = resolve_model(str(tiny_llama))
    eng = local_engine(target, "bio+tbik", 2, emulated=True, dtype="float32")
    for decoding, spec in (
        (DecodingParams(greedy=True, max_new_tokens=NEW), Speculative("draft", 4, "self", target)),
        (DecodingParams(temperature=0.8, top_p=0.9, top_k=0, max_new_tokens=NEW, seed=3), Speculative("ngram", 3)),
    ):
        ref = eng.generate(ids, pids, decoding, 2)
        got = eng.generate(ids, pids, decoding, 2, speculative=spec)
        assert generation_difference(ref, got) is None, (spec, decoding)
        drafted, accepted = sum(g.drafted for g in got), sum(g.accepted for g in got)
        assert drafted > 0
        if spec.kind == "draft":  # greedy: the target's own greedy tokens, every one accepted
            assert accepted == drafted
            assert eng.last_timings["decode_steps"] < NEW - 1
