"""The server client's pure parts: redaction of server strings, answer checks, load patterns."""

from __future__ import annotations

import math

import pytest

from detaudit.errors import CellFailed, DetauditError
from detaudit.server import wire
from detaudit.server.load import LONG_TOKENS, background_pool, prefix_cuts
from detaudit.server.urls import redact

KEY = "sk-unit-0123456789"
WHERE = "http://127.0.0.1:1/v1/completions"


def test_redact_removes_the_key_before_cutting():
    assert redact(f"vllm 0.1 Bearer {KEY}", KEY) == "vllm 0.1 Bearer ***"
    # the cut comes after the key is gone: no prefix of it survives a short limit
    assert redact(f"{'x' * 10}{KEY}", KEY, limit=14) == "xxxxxxxxxx***"
    assert redact("a\nb\x00c\x1b[31m", None) == "a b c [31m"
    assert redact("http://u:p@h:1/v1/x", None, base_url="http://u:p@h:1/v1") == "http://h:1/v1/x"
    assert len(redact("y" * 10_000, None, limit=80)) == 80


def _answer(tokens, lps, tops, **choice):
    return {"choices": [{"logprobs": {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops}, **choice}]}


def _top(t, k=5):
    return {f"token_id:{t + j}": math.log(0.5) * (j + 1) for j in range(k)}


def test_a_valid_answer_parses():
    ex = wire.Expect(WHERE, k=5, max_tokens=4, vocab=1000)
    g = wire.parse_completion(
        _answer(["token_id:7", "token_id:9"], [math.log(0.5)] * 2, [_top(7), _top(9)]), ex, wire.TokenMap(None)
    )
    assert g.token_ids == [7, 9] and g.topk_ids[0] == [7, 8, 9, 10, 11] and g.finish_reason == "length"


@pytest.mark.parametrize(
    "answer, field",
    [
        (_answer(["token_id:7"], [math.nan], [_top(7)]), "token_logprobs[0] is nan"),
        (_answer(["token_id:7"], [0.5], [_top(7)]), "token_logprobs[0] is 0.5"),
        (_answer(["token_id:7"], ["-1"], [_top(7)]), "token_logprobs[0] is a str"),
        (_answer(["token_id:7"], [True], [_top(7)]), "token_logprobs[0] is True"),
        (_answer(["token_id:1000"], [-1.0], [_top(7)]), "tokens[0] is 1000, outside the vocabulary [0, 1000)"),
        (_answer(["token_id:-1"], [-1.0], [_top(7)]), "tokens[0] is -1, outside"),
        (_answer([7], [-1.0], [_top(7)]), "tokens[0] is 7, not a token"),
        (_answer(["token_id:7"] * 5, [-1.0] * 5, [_top(7)] * 5), "holds 5 tokens for max_tokens 4"),
        (_answer([], [], []), "holds no token"),
        (_answer(["token_id:7"], [-1.0], [{f"token_id:{j}": 0.0 for j in range(5)}]), "probabilities sum to 5"),
        (_answer(["token_id:7"], [-1.0], [_top(7)], token_ids=[10**30]), "choices[0].token_ids[0] is an integer"),
        ({"choices": [{"logprobs": []}]}, "choices[0].logprobs is a list, not an object"),
        ([], "answer is a list, not an object"),
    ],
)
def test_bad_answers_name_the_field(answer, field):
    ex = wire.Expect(WHERE, k=5, max_tokens=4, vocab=1000)
    with pytest.raises(wire.BadAnswer) as e:
        wire.parse_completion(answer, ex, wire.TokenMap(None))
    msg = str(e.value)
    assert msg.startswith(f"server {WHERE}: bad answer: ") and field in msg, msg
    assert isinstance(e.value, CellFailed) and isinstance(e.value, DetauditError)  # fails its cell; elsewhere exit 2


def test_a_string_value_is_never_shown():
    """A server string could hold anything (the API key): errors name its type, never its text."""
    ex = wire.Expect(WHERE, k=5, max_tokens=4, vocab=1000)
    with pytest.raises(wire.BadAnswer) as e:
        wire.parse_completion(_answer(["token_id:7"], [f"Bearer {KEY}"], [_top(7)]), ex, wire.TokenMap(None))
    assert KEY not in str(e.value)


def test_teacher_forcing_values_are_checked():
    ex = wire.Expect(WHERE)
    ok = {"choices": [{"prompt_logprobs": [None, {"5": {"logprob": -1.5}}, {"6": {"logprob": -0.25}}]}]}
    assert wire.parse_prompt_logprobs(ok, 1, [5, 6], ex) == [-1.5, -0.25]
    assert wire.parse_prompt_logprobs({"choices": [{}]}, 1, [5, 6], ex) is None  # none: unavailable, not bad
    bad = {"choices": [{"prompt_logprobs": [None, {"5": {"logprob": math.inf}}, {"6": {"logprob": -0.25}}]}]}
    with pytest.raises(wire.BadAnswer, match="prompt_logprobs"):
        wire.parse_prompt_logprobs(bad, 1, [5, 6], ex)


def test_request_extras_per_server_kind():
    from detaudit.config import DecodingParams

    d = DecodingParams(temperature=0.6, top_k=20)
    vllm = wire.completion_body("m", [1, 2], d, "p", "vllm")
    sglang = wire.completion_body("m", [1, 2], d, "p", "sglang")
    generic = wire.completion_body("m", [1, 2], d, "p", "generic")
    assert vllm["return_tokens_as_token_ids"] is True and "return_token_ids" not in vllm and vllm["top_k"] == 20
    assert sglang["return_token_ids"] is True and "return_tokens_as_token_ids" not in sglang and sglang["top_k"] == 20
    assert not {"return_token_ids", "return_tokens_as_token_ids", "top_k"} & set(generic)
    assert vllm["seed"] == sglang["seed"] == generic["seed"]


PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14], [21, 22, 23, 24, 25, 26]]


def test_mixed_pattern_puts_long_prompts_beside_short_ones():
    pool = background_pool("mixed", PROMPTS, 1000, n=4)
    assert pool[0::2] == PROMPTS and all(len(p) == LONG_TOKENS for p in pool[1::2])
    # the long prompt is the suite's prompts end to end
    assert pool[1][:18] == PROMPTS[0] + PROMPTS[1] + PROMPTS[2]


def test_prefix_pattern_cuts_one_long_text_per_prompt():
    cuts = prefix_cuts(PROMPTS[0], list(range(100, 140)))
    assert [len(c) for c in cuts] == [2, 4, 6, 28, 48]
    text = PROMPTS[0] + list(range(100, 140))
    assert all(c == text[: len(c)] for c in cuts)  # all prefixes of one text: shorter and longer than the prompt
    pool = background_pool("prefix", PROMPTS, 1000, n=4)
    assert pool == background_pool("prefix", PROMPTS, 1000, n=4)  # a seeded order
    assert len(pool) == 3 * 5 and max(len(p) for p in pool) == LONG_TOKENS
    for p in PROMPTS:  # every prompt has cuts shorter than it and texts that extend it
        assert any(len(c) < len(p) and p[: len(c)] == c for c in pool)
        assert any(len(c) > len(p) and c[: len(p)] == p for c in pool)
    assert pool != [c for p in PROMPTS for c in prefix_cuts(p, [])]  # not in prompt order


def test_suite_and_random_patterns():
    assert background_pool("suite", PROMPTS, 1000, n=2) == PROMPTS[1:] + PROMPTS[:1]
    rnd = background_pool("random", PROMPTS, 1000, n=10)
    assert len(rnd) == 10 and all(100 <= t < 1000 for p in rnd for t in p)
    with pytest.raises(DetauditError, match="unknown load pattern"):
        background_pool("bursty", PROMPTS, 1000, n=2)
