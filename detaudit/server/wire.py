"""Request bodies and response parsing for `/v1/completions` and `/v1/chat/completions`.

Generated tokens come back as ids when the server honours vLLM's `return_tokens_as_token_ids`
(`token_id:123`); otherwise token strings are mapped back to ids with `--model`'s tokenizer
(`TokenMap`), which `describe()` reports as approximate."""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from detaudit.config import DecodingParams, request_seed
from detaudit.errors import DetauditError
from detaudit.records import Generation

TOKEN_ID_PREFIX = "token_id:"


def sampling(decoding: DecodingParams, prompt_id: str, vllm_like: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"max_tokens": decoding.max_new_tokens, "seed": request_seed(decoding.seed, prompt_id)}
    if decoding.greedy:
        body.update(temperature=0.0, top_p=1.0)
    else:
        body.update(temperature=decoding.temperature, top_p=decoding.top_p)
        if vllm_like and decoding.top_k > 0:
            body["top_k"] = decoding.top_k
    if decoding.stop:
        body["stop"] = list(decoding.stop)
    return body


def completion_body(
    model: str,
    prompt: Sequence[int] | str,
    decoding: DecodingParams,
    prompt_id: str,
    vllm_like: bool,
    logprobs: bool = True,
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt if isinstance(prompt, str) else list(map(int, prompt)),
        **sampling(decoding, prompt_id, vllm_like),
    }
    if logprobs:
        body["logprobs"] = decoding.logprobs
        if vllm_like:
            body["return_tokens_as_token_ids"] = True
    return body


def chat_body(
    model: str, text: str, decoding: DecodingParams, prompt_id: str, vllm_like: bool, logprobs: bool = True
) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": text}], **sampling(decoding, prompt_id, vllm_like)}
    if logprobs:
        body.update(logprobs=True, top_logprobs=decoding.logprobs)
        if vllm_like:
            body["return_tokens_as_token_ids"] = True
    return body


class TokenMap:
    """Token string -> id: `token_id:N` directly, else through the tokenizer (counted)."""

    def __init__(self, tokenizer_fn: Callable[[], Any] | None) -> None:
        self._tok_fn, self._tok = tokenizer_fn, None
        self.mapped = 0  # tokens that needed the tokenizer
        self.unmapped = 0  # tokens no single id matched (recorded as -1)

    def __call__(self, token: str) -> int:
        if token.startswith(TOKEN_ID_PREFIX):
            try:
                return int(token[len(TOKEN_ID_PREFIX) :])
            except ValueError:
                pass
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


def _ranked(pairs: list[tuple[int, float]], k: int) -> tuple[list[int], list[float]]:
    pairs = sorted(pairs, key=lambda p: -p[1])[:k]
    return [p[0] for p in pairs], [float(p[1]) for p in pairs]


def _finish(reason: Any) -> str:
    return "stop" if reason == "stop" else "length"


def _no_logprobs(where: str) -> DetauditError:
    return DetauditError(
        f"server {where}: the answer has no logprobs (the audit needs per-token top-k "
        "log-probabilities; is logprobs supported / --max-logprobs high enough?)"
    )


def _generation(entries, k: int, where: str, finish: Any) -> Generation:
    """entries: per position (token id, its logprob, [(token id, logprob), ...] of the top-k)."""
    ids, token_lps, top_ids, top_lps = [], [], [], []
    for tok, lp, top in entries:
        if len(top) < min(k, 5):
            raise _no_logprobs(where)
        ids.append(tok)
        token_lps.append(float(lp) if lp is not None else math.nan)
        a, b = _ranked(top, k)
        top_ids.append(a)
        top_lps.append(b)
    return Generation(ids, token_lps, top_ids, top_lps, _finish(finish))


def _choice(d: Any, where: str) -> dict:
    try:
        return d["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise DetauditError(f"server {where}: answer has no choices") from None


def parse_completion(d: Any, k: int, tokens: TokenMap, where: str) -> Generation:
    choice = _choice(d, where)
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or lp.get("token_logprobs") is None or lp.get("top_logprobs") is None:
        raise _no_logprobs(where)
    toks, lps, tops = lp.get("tokens") or [], lp["token_logprobs"], lp["top_logprobs"]
    if not (len(toks) == len(lps) == len(tops)):
        raise DetauditError(f"server {where}: logprobs lists of different lengths")
    if any(not isinstance(top, dict) for top in tops):
        raise _no_logprobs(where)
    entries = ((tokens(t), l, [(tokens(s), v) for s, v in top.items()]) for t, l, top in zip(toks, lps, tops))
    return _generation(entries, k, where, choice.get("finish_reason"))


def parse_chat(d: Any, k: int, tokens: TokenMap, where: str) -> Generation:
    choice = _choice(d, where)
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if content is None:
        raise _no_logprobs(where)
    entries = (
        (tokens(e["token"]), e["logprob"], [(tokens(x["token"]), x["logprob"]) for x in e.get("top_logprobs") or []])
        for e in content
    )
    return _generation(entries, k, where, choice.get("finish_reason"))


def parse_prompt_logprobs(d: Any, prompt_len: int, continuation: Sequence[int]) -> list[float] | None:
    """vLLM's `prompt_logprobs` (per prompt position: None or {token id: {logprob, ...}})."""
    try:
        pl = d["choices"][0].get("prompt_logprobs") or d.get("prompt_logprobs")
        out = []
        for j, t in enumerate(continuation):
            entry = pl[prompt_len + j]
            v = entry[str(int(t))] if str(int(t)) in entry else entry[int(t)]
            out.append(float(v["logprob"] if isinstance(v, dict) else v))
        return out
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


def parse_echo_logprobs(d: Any, prompt_len: int, continuation: Sequence[int]) -> list[float] | None:
    """`echo` + `logprobs`: the echoed sequence's token_logprobs (prompt + continuation first)."""
    try:
        lps = d["choices"][0]["logprobs"]["token_logprobs"]
        vals = lps[prompt_len : prompt_len + len(continuation)]
        if len(vals) != len(continuation) or any(v is None for v in vals):
            return None
        return [float(v) for v in vals]
    except (KeyError, IndexError, TypeError):
        return None
