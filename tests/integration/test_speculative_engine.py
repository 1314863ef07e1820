"""Speculative decoding in the built-in engine on the embedded model (CPU), asserted bitwise: under
bio+tbik a request's tokens, chosen-token and top-k log-probabilities and top-k ids with speculation
(n-gram or draft-model drafts, k = 1..4) are the plain TP-1 decode's, at TP 1/2/4 emulated and real
(gloo), batch 1 and 3, greedy and sampled, bf16 and fp32. The prompts (the `quote` suite) repeat their
input, so n-gram drafts are proposed and accepted; the draft model is the embedded model's first 4
layers (`models.truncate_layers`), whose drafts are mostly rejected: both walks are exercised."""

from __future__ import annotations

import pytest
from helpers import builtin_engine, generation_difference, local_engine

from detaudit.config import DecodingParams, Speculative
from detaudit.inputs.prepare import eos_ids, tokenizer_for
from detaudit.inputs.suites import load_suite, prompt_token_ids
from detaudit.models import resolve_model, truncate_layers

pytestmark = pytest.mark.slow  # the real embedded model and/or worker processes

NEW = 10
GREEDY = DecodingParams(greedy=True, max_new_tokens=NEW)
SAMPLED = DecodingParams(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=NEW, seed=42)


@pytest.fixture(scope="module")
def setup(smollm, tmp_path_factory):
    tok = tokenizer_for(smollm.path)
    suite = load_suite("quote")
    prompts = suite.prompts[:3]
    ids = [prompt_token_ids(tok, p) for p in prompts]
    draft_dir = tmp_path_factory.mktemp("draft") / "smollm2-l4"
    truncate_layers(smollm, 4, draft_dir)
    return dict(
        ids=ids,
        pids=[p.id for p in prompts],
        eos=tuple(eos_ids(smollm, tok)),
        draft=resolve_model(str(draft_dir)),
        plain={},  # (dtype, decoding, batch) -> plain TP-1 outputs
    )


def spec_of(setup, kind: str, k: int) -> Speculative:
    return Speculative(kind, k, "smollm2-l4", setup["draft"]) if kind == "draft" else Speculative(kind, k)


def plain(smollm, setup, dtype: str, decoding: DecodingParams, batch: int):
    key = (dtype, decoding, batch)
    if key not in setup["plain"]:
        eng = local_engine(smollm, "bio+tbik", 1, eos_ids=setup["eos"], dtype=dtype)
        setup["plain"][key] = eng.generate(setup["ids"], setup["pids"], decoding, batch)
    return setup["plain"][key]


CASES = [  # (dtype, decoding, TP (emulated), batch, draft kind, k): every k, TP, batch, dtype and walk
    ("bfloat16", GREEDY, 1, 3, "ngram", 4),
    ("bfloat16", SAMPLED, 1, 1, "draft", 1),
    ("bfloat16", SAMPLED, 2, 3, "ngram", 2),
    ("bfloat16", GREEDY, 4, 1, "ngram", 3),  # (a draft model at bf16: TP 1 above; at TP 4: fp32 below)
    ("float32", SAMPLED, 1, 3, "ngram", 3),
    ("float32", GREEDY, 2, 1, "ngram", 1),
    ("float32", SAMPLED, 4, 3, "draft", 4),
    ("float32", GREEDY, 4, 3, "draft", 2),
]


@pytest.mark.parametrize(
    "dtype, decoding, tp, batch, kind, k",
    CASES,
    ids=[f"{d[:4]}-{'greedy' if g.greedy else 'sampled'}-tp{tp}-bs{b}-{kind}{k}" for d, g, tp, b, kind, k in CASES],
)
def test_tbik_speculation_is_bitwise_plain_decoding(smollm, setup, dtype, decoding, tp, batch, kind, k):
    ref = plain(smollm, setup, dtype, decoding, batch)
    eng = local_engine(smollm, "bio+tbik", tp, emulated=tp > 1, eos_ids=setup["eos"], dtype=dtype)
    got = eng.generate(setup["ids"], setup["pids"], decoding, batch, speculative=spec_of(setup, kind, k))
    assert generation_difference(ref, got) is None
    assert sum(g.drafted for g in got) > 0  # drafts were verified (rows beyond the pending token ran)
    assert eng.last_timings["decode_steps"] > 0 and eng.last_timings["drafted"] == sum(g.drafted for g in got)


def test_greedy_ngram_drafts_are_accepted_on_the_quote_suite(smollm, setup):
    """The walk that emits several tokens a step runs: greedy n-gram drafts on answers that repeat their
    prompt are accepted (and the steps are fewer than the tokens)."""
    eng = local_engine(smollm, "bio+tbik", 1, eos_ids=setup["eos"])
    got = eng.generate(setup["ids"], setup["pids"], GREEDY, 3, speculative=Speculative("ngram", 4))
    assert generation_difference(plain(smollm, setup, "bfloat16", GREEDY, 3), got) is None
    assert sum(g.accepted for g in got) > 0
    assert eng.last_timings["decode_steps"] < max(len(g.token_ids) for g in got) - 1


@pytest.mark.parametrize("tp, kind, k, decoding", [(2, "ngram", 3, SAMPLED), (4, "draft", 2, GREEDY)])
def test_tbik_speculation_is_bitwise_at_real_tp(smollm, setup, tp, kind, k, decoding):
    """Real TP (one gloo worker per rank): n-gram drafts from the tokens every rank holds; a draft model
    run on rank 0, its drafts all-gathered: every rank verifies the same drafts and the output is the
    plain TP-1 output."""
    eng = builtin_engine(smollm, "bio+tbik", tp, "real", eos_ids=setup["eos"])
    try:
        got = eng.generate(setup["ids"], setup["pids"], decoding, 3, speculative=spec_of(setup, kind, k))
    finally:
        eng.close()
    assert generation_difference(plain(smollm, setup, "bfloat16", decoding, 3), got) is None
    assert sum(g.drafted for g in got) > 0
