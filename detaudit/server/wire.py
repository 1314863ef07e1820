"""Request bodies and response parsing for `/v1/completions` and `/v1/chat/completions`.

Generated tokens come back as ids when the server honours vLLM's `return_tokens_as_token_ids`
(`token_id:123`) or SGLang's `return_token_ids` (`choices[0].token_ids`); otherwise token strings are
mapped back to ids with `--model`'s tokenizer (`TokenMap`), which `describe()` reports as approximate.

Every answer is untrusted: each field is checked for its type and range before anything of it is kept
(`Expect`). A malformed or impossible answer (a string where a log-probability belongs, a token id
outside the vocabulary, more tokens than `max_tokens`, none at all, a NaN / infinite / positive
log-probability or one float32 cannot hold, top-k probabilities summing past 1) raises `BadAnswer`: its
cell fails with one line naming the server and the field, and no record of it is written. So does an
answer whose numbers contradict each other (`Expect.consistent`): a token listed twice in a top-k, a
chosen token whose log-probability is not the one its own top-k entry gives, a chosen token missing from
a top-k that lists less likely ones, a greedy choice below the position's top-1. Those comparisons allow
for the rounding of a server that computes log-probabilities in fp16 / bf16 (`close`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from detaudit.config import DecodingParams, request_seed
from detaudit.errors import CellFailed, DetauditError
from detaudit.runs.records import LOGPROB_MAX, Generation

TOKEN_ID_PREFIX = "token_id:"
# Two log-probabilities a server reports for one token (its `logprob` and its top-k entry; a greedy
# choice and the top-1) are one number, rounded at most twice on the way: they agree within fp16 / bf16
# rounding (bf16 keeps 8 significant bits: a relative error of 2^-8 per rounding), plus LOGPROB_MAX near 0.
LOGPROB_RTOL = 2**-7
FLOAT32_MAX = 3.4028234663852886e38  # records store float32: a value past it would be stored as infinite
# top-k probabilities of distinct tokens sum to <= 1; the slack covers bf16 rounding of each entry
PROB_SUM_MAX = 1.01
MAX_TOKEN_CHARS = 256  # one token's text; longer is not a token
# `token_id:N` as vLLM writes it (range-checked against the vocabulary): no leading zero, so an id has one
# spelling (`token_id:03000` would be a second key for token 3000)
TOKEN_NUMBER = re.compile(r"-?(0|[1-9][0-9]{0,39})")


class BadAnswer(CellFailed, DetauditError):
    """A malformed or impossible server answer. Inside a cell it fails the cell (`CellFailed`);
    anywhere else (the probe before any cell) it is one line and exit 2 (`DetauditError`)."""


def sampling(decoding: DecodingParams, prompt_id: str, sends_top_k: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": decoding.max_new_tokens, "seed": request_seed(decoding.seed, prompt_id)}
    if sends_top_k:  # vLLM and SGLang apply a model's generation_config (Qwen2.5: 1.05) unless the request says
        body["repetition_penalty"] = 1.0
    if decoding.greedy:
        body.update(temperature=0.0, top_p=1.0)
    else:
        body.update(temperature=decoding.temperature, top_p=decoding.top_p)
        if sends_top_k and decoding.top_k > 0:
            body["top_k"] = decoding.top_k
    if decoding.stop:
        body["stop"] = list(decoding.stop)
    return body


def id_request(kind: str) -> dict[str, Any]:
    """The request field that makes a server answer with token ids instead of token text."""
    return {"vllm": {"return_tokens_as_token_ids": True}, "sglang": {"return_token_ids": True}}.get(kind, {})


def completion_body(
    model: str,
    prompt: Sequence[int] | str,
    decoding: DecodingParams,
    prompt_id: str,
    kind: str,
    logprobs: bool = True,
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(map(int, prompt)),
        **sampling(decoding, prompt_id, kind in ("vllm", "sglang")),
    }
    if logprobs:
        body.update(logprobs=decoding.logprobs, **id_request(kind))
    return body


def chat_body(
    model: str, text: str, decoding: DecodingParams, prompt_id: str, kind: str, logprobs: bool = True
) -> dict[str, Any]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        **sampling(decoding, prompt_id, kind in ("vllm", "sglang")),
    }
    if logprobs:
        body.update(logprobs=True, top_logprobs=decoding.logprobs)
        if kind == "vllm":
            body["return_tokens_as_token_ids"] = True
    return body


class TokenMap:
    """Token string -> id: `token_id:N` directly, else through the tokenizer (counted)."""

    def __init__(self, tokenizer_fn: Callable[[], Any] | None) -> None:
        self._tok_fn, self._tok = tokenizer_fn, None
        self.mapped = 0  # tokens that needed the tokenizer
        self.unmapped = 0  # tokens no single id matched (recorded as -1)

    def __call__(self, token: str) -> int:
        """The id of a token string; -1 when no single id matches; ValueError for `token_id:` that is
        not followed by a number."""
        if token.startswith(TOKEN_ID_PREFIX):
            number = token[len(TOKEN_ID_PREFIX) :]
            if not TOKEN_NUMBER.fullmatch(number):
                raise ValueError("is 'token_id:' without a token number (digits, no leading zero)")
            return int(number)  # its range is the caller's check
        if self._tok_fn is None:
            raise DetauditError("the server returned token strings, not ids, and no tokenizer is available")
        if self._tok is None:
            self._tok = self._tok_fn()
        self.mapped += 1
        ids = self._tok.encode(token, add_special_tokens=False)
        if len(ids) == 1:
            return int(ids[0])
        tid = self._tok.convert_tokens_to_ids(token)
        if isinstance(tid, int) and tid != self._tok.unk_token_id:
            return tid
        self.unmapped += 1
        return -1


def _show(v: Any) -> str:
    """A server value as an error shows it: numbers (short), else only the type (a string could hold
    anything, the API key included)."""
    if isinstance(v, bool) or v is None:
        return repr(v)
    if isinstance(v, int):  # JSON holds at most 4300 digits (Python's int parsing limit)
        return repr(v) if abs(v) < 10**15 else f"an integer of {len(str(abs(v)))} digits"
    if isinstance(v, float):
        return repr(v)
    return f"a {type(v).__name__}"


@dataclass(frozen=True)
class Expect:
    """What a valid answer to one audited request can hold; every check names the field."""

    where: str  # the server's public URL and path
    k: int = 5  # top-k log-probabilities requested
    max_tokens: int = 1
    vocab: int = 0  # token ids lie in [0, vocab) (0: not checked)
    greedy: bool = False  # the request decoded greedily: each chosen token is its position's top-1

    def bad(self, field: str, what: str) -> BadAnswer:
        return BadAnswer(f"server {self.where}: bad answer: {field} {what}")

    def mapping(self, v: Any, field: str) -> dict:
        if not isinstance(v, dict):
            raise self.bad(field, f"is {_show(v)}, not an object")
        return v

    def array(self, v: Any, field: str) -> list:
        if not isinstance(v, list):
            raise self.bad(field, f"is {_show(v)}, not a list")
        return v

    def logprob(self, v: Any, field: str) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.bad(field, f"is {_show(v)}, not a number")
        x = float(v) if not isinstance(v, int) or abs(v) < 10**300 else math.inf
        if not math.isfinite(x) or x > LOGPROB_MAX:
            raise self.bad(field, f"is {_show(v)} (a log-probability is a finite number <= 0)")
        if x < -FLOAT32_MAX:
            raise self.bad(field, f"is {_show(v)}, past float32's range (it would be recorded as -inf)")
        return x

    def token_id(self, v: Any, field: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.bad(field, f"is {_show(v)}, not a token id")
        if v < 0 or (self.vocab and v >= self.vocab):
            raise self.bad(field, f"is {_show(v)}, outside the vocabulary [0, {self.vocab})")
        return v

    def token(self, v: Any, field: str, tokens: TokenMap) -> int:
        """A token string -> its id (checked like any id; -1 when the tokenizer has no single id)."""
        if not isinstance(v, str) or len(v) > MAX_TOKEN_CHARS:
            raise self.bad(field, f"is {_show(v) if not isinstance(v, str) else 'a string too long'}, not a token")
        try:
            tid = tokens(v)
        except ValueError as e:
            raise self.bad(field, str(e)) from None
        return tid if tid == -1 and not v.startswith(TOKEN_ID_PREFIX) else self.token_id(tid, field)

    def count(self, n: int, field: str) -> None:
        if n < 1:
            raise self.bad(field, f"holds no token (max_tokens is {self.max_tokens}; a completion has at least one)")
        if n > self.max_tokens:
            raise self.bad(field, f"holds {n} tokens for max_tokens {self.max_tokens}")

    def consistent(self, field: str, chosen: int, lp: float, pairs: list[tuple[int, float]], exact: bool) -> None:
        """One position's numbers agree: the chosen token `chosen` at log-probability `lp` and the top-k
        `pairs`. With exact ids (`token_id:N`, or ids given): no token listed twice, the chosen token's
        own entry gives its log-probability, and a chosen token absent from the top-k is no more likely
        than the least likely entry. Greedy decoding chose a top-1. (Token texts mapped to ids are
        approximate: a tokenizer may give two texts one id, so only the greedy rule applies there.)"""
        if exact:
            own: dict[int, float] = {}
            for t, x in pairs:
                if t in own:
                    raise self.bad(field, f"lists token {t} twice")
                own[t] = x
            if chosen in own and not close(own[chosen], lp):
                raise self.bad(
                    field, f"gives the chosen token {chosen} log-probability {own[chosen]!r}, the answer {lp!r}"
                )
            low = min(own.values(), default=None)
            if chosen not in own and low is not None and lp > low and not close(lp, low):
                raise self.bad(
                    field,
                    f"omits the chosen token {chosen} (log-probability {lp!r}) but lists less likely ones "
                    f"(down to {low!r}): not the most likely tokens",
                )
        best = max((x for _, x in pairs), default=None)
        if self.greedy and best is not None and lp < best and not close(lp, best):
            raise self.bad(
                field,
                f"greedy decoding chose token {chosen} at log-probability {lp!r}, below the position's top-1 "
                f"{best!r}: not a greedy answer (a repetition penalty or logit bias on the server?)",
            )

    def top(self, pairs: list[tuple[int, float]], field: str, exact: bool) -> tuple[list[int], list[float]]:
        """One position's top-k: enough entries (servers that key them by text merge tokens of the same
        text, so fewer is allowed there), probabilities of at most 1 in total; ranked, cut to k."""
        if len(pairs) < (min(self.k, 5) if exact else 1):
            raise no_logprobs(self.where)
        total = math.fsum(math.exp(lp) for _, lp in pairs)
        if total > PROB_SUM_MAX:
            raise self.bad(field, f"probabilities sum to {total:.4g} (> 1)")
        pairs = sorted(pairs, key=lambda p: -p[1])[: self.k]
        return [p[0] for p in pairs], [p[1] for p in pairs]


def close(a: float, b: float) -> bool:
    """Two reports of one log-probability agree (fp16 / bf16 rounding: LOGPROB_RTOL, LOGPROB_MAX)."""
    return abs(a - b) <= LOGPROB_MAX + LOGPROB_RTOL * max(abs(a), abs(b))


def _finish(reason: Any) -> str:
    return "stop" if reason == "stop" else "length"


def no_logprobs(where: str) -> DetauditError:
    return DetauditError(
        f"server {where}: the answer has no logprobs (the audit needs per-token top-k "
        "log-probabilities; is logprobs supported / --max-logprobs high enough?)"
    )


def _choice(d: Any, ex: Expect) -> dict:
    choices = ex.array(ex.mapping(d, "answer").get("choices"), "choices")
    if not choices:
        raise ex.bad("choices", "is empty")
    return ex.mapping(choices[0], "choices[0]")


def parse_completion(d: Any, ex: Expect, tokens: TokenMap) -> Generation:
    """`choices[0].logprobs` (OpenAI completions format; vLLM's `token_id:N` strings or SGLang's
    `choices[0].token_ids` give exact ids)."""
    choice = _choice(d, ex)
    lp = choice.get("logprobs")
    if lp is None:
        raise no_logprobs(ex.where)
    f = "choices[0].logprobs"
    lp = ex.mapping(lp, f)
    if lp.get("token_logprobs") is None or lp.get("top_logprobs") is None:
        raise no_logprobs(ex.where)
    lps = ex.array(lp["token_logprobs"], f"{f}.token_logprobs")
    tops = ex.array(lp["top_logprobs"], f"{f}.top_logprobs")
    toks = ex.array(lp.get("tokens", []), f"{f}.tokens")
    ex.count(len(lps), f"{f}.token_logprobs")
    if not len(toks) == len(lps) == len(tops):
        raise ex.bad(
            f, f"lists differ in length (tokens {len(toks)}, token_logprobs {len(lps)}, top_logprobs {len(tops)})"
        )
    given = choice.get("token_ids")
    if given is not None:  # SGLang's return_token_ids: exact ids of the generated tokens
        given = ex.array(given, "choices[0].token_ids")
        if len(given) != len(lps):
            raise ex.bad("choices[0].token_ids", f"holds {len(given)} ids for {len(lps)} tokens")
        ids = [ex.token_id(t, f"choices[0].token_ids[{i}]") for i, t in enumerate(given)]
    else:
        ids = [ex.token(t, f"{f}.tokens[{i}]", tokens) for i, t in enumerate(toks)]
    exact_ids = given is not None or all(isinstance(t, str) and t.startswith(TOKEN_ID_PREFIX) for t in toks)
    token_lps, top_ids, top_lps = [], [], []
    for i, (v, top) in enumerate(zip(lps, tops)):
        token_lps.append(ex.logprob(v, f"{f}.token_logprobs[{i}]"))
        field = f"{f}.top_logprobs[{i}]"
        top = ex.mapping(top, field)
        pairs = [
            (ex.token(s, f"{field} key {j}", tokens), ex.logprob(x, f"{field} value {j}"))
            for j, (s, x) in enumerate(top.items())
        ]
        exact = all(s.startswith(TOKEN_ID_PREFIX) for s in top)
        a, b = ex.top(pairs, field, exact)
        ex.consistent(field, ids[i], token_lps[i], pairs, exact and exact_ids)
        top_ids.append(a)
        top_lps.append(b)
    return Generation(ids, token_lps, top_ids, top_lps, _finish(choice.get("finish_reason")))


def parse_chat(d: Any, ex: Expect, tokens: TokenMap) -> Generation:
    """`choices[0].logprobs.content` (OpenAI chat format)."""
    choice = _choice(d, ex)
    lp = choice.get("logprobs")
    content = ex.mapping(lp, "choices[0].logprobs").get("content") if lp is not None else None
    if content is None:
        raise no_logprobs(ex.where)
    f = "choices[0].logprobs.content"
    content = ex.array(content, f)
    ex.count(len(content), f)
    ids, token_lps, top_ids, top_lps = [], [], [], []
    for i, e in enumerate(content):
        e = ex.mapping(e, f"{f}[{i}]")
        ids.append(ex.token(e.get("token"), f"{f}[{i}].token", tokens))
        chosen_exact = str(e.get("token")).startswith(TOKEN_ID_PREFIX)
        token_lps.append(ex.logprob(e.get("logprob"), f"{f}[{i}].logprob"))
        field = f"{f}[{i}].top_logprobs"
        pairs = []
        for j, x in enumerate(ex.array(e.get("top_logprobs") or [], field)):
            x = ex.mapping(x, f"{field}[{j}]")
            pairs.append(
                (
                    ex.token(x.get("token"), f"{field}[{j}].token", tokens),
                    ex.logprob(x.get("logprob"), f"{field}[{j}].logprob"),
                )
            )
        exact = all(
            isinstance(x, dict) and str(x.get("token", "")).startswith(TOKEN_ID_PREFIX)
            for x in e.get("top_logprobs") or []
        )
        a, b = ex.top(pairs, field, exact)
        ex.consistent(field, ids[i], token_lps[i], pairs, exact and chosen_exact)
        top_ids.append(a)
        top_lps.append(b)
    return Generation(ids, token_lps, top_ids, top_lps, _finish(choice.get("finish_reason")))


def _scored(values: list[Any], ex: Expect, field: str) -> list[float] | None:
    """Teacher-forced log-probabilities: None where the server has none (teacher forcing unavailable);
    a value that is there but impossible is a bad answer."""
    if any(v is None for v in values):
        return None
    return [ex.logprob(v, f"{field}[{j}]") for j, v in enumerate(values)]


def parse_prompt_logprobs(d: Any, prompt_len: int, continuation: Sequence[int], ex: Expect) -> list[float] | None:
    """vLLM's `prompt_logprobs` (per prompt position: None or {token id: {logprob, ...}})."""
    try:
        choice = d["choices"][0]
        pl = choice.get("prompt_logprobs") or d.get("prompt_logprobs")
        values = []
        for j, t in enumerate(continuation):
            entry = pl[prompt_len + j]
            v = entry[str(int(t))] if str(int(t)) in entry else entry[int(t)]
            values.append(v["logprob"] if isinstance(v, dict) else v)
    except (KeyError, IndexError, TypeError, AttributeError):
        return None
    return _scored(values, ex, f"choices[0].prompt_logprobs[{prompt_len}:]")


def parse_echo_logprobs(d: Any, prompt_len: int, continuation: Sequence[int], ex: Expect) -> list[float] | None:
    """`echo` + `logprobs`: the echoed sequence's token_logprobs (prompt + continuation first)."""
    try:
        lps = d["choices"][0]["logprobs"]["token_logprobs"]
        values = lps[prompt_len : prompt_len + len(continuation)]
    except (KeyError, IndexError, TypeError):
        return None
    if not isinstance(values, list) or len(values) != len(continuation):
        return None
    return _scored(values, ex, f"choices[0].logprobs.token_logprobs[{prompt_len}:]")
