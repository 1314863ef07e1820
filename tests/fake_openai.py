"""A fake OpenAI-compatible server for the server engines' tests (importable as `fake_openai`).

A mock, and the only one these tests use: the behaviours it plays (HTTP errors, hangs, trickled, huge
or malformed bodies, impossible answers, an API key echoed back, SGLang's answer format) cannot be
provoked on demand from a real server, and SGLang does not run on these CPUs. It is a raw ASGI app
served by uvicorn on 127.0.0.1 in a thread; `Fake.mode` picks the behaviour of the next requests.

Answers in vLLM's format carry `token_id:N` tokens; in SGLang's (`owner = "sglang"`) the tokens and the
top-k keys are token texts (duplicates merged, the first kept, as SGLang's `to_openai_style_logprobs`
does), `choices[0].token_ids` holds the generated ids when the request asks `return_token_ids`, and
`echo` + `logprobs` returns the prompt's log-probabilities first (the first one null).

`load-variant` plays a server whose numerics depend on its load: a generation request answered while
another request arrived (audited or background) gets its third token changed and its log-probabilities
shifted by 0.01; alone, it gets the same answer every time. Which requests overlap in time is the
scheduler's choice, so the fake makes it certain instead: the first `alone` generation requests (a sweep's
sequential baseline cell) are answered at once, each later one is held until another request arrives and
is then answered as loaded. No clock decides which answer a request gets.
"""

from __future__ import annotations

import asyncio
import functools
import json
import math
import socket
import threading
import time
from typing import Any, Callable

import uvicorn

MODEL_ID = "smollm2-135m"
# teacher-forced (prompt_logprobs) values a mode puts in every position
TF_VALUES: dict[str, Any] = {"tf-nan": math.nan, "tf-float32-overflow": -1e308, "tf-positive": 0.5, "tf-string": "x"}
TOP = [math.log(0.5) * (j + 1) for j in range(20)]  # top-k probabilities 1/2, 1/4, ...: they sum to < 1


def _set(path: str, value: Any) -> Callable[[dict], None]:
    """A mutation setting one field of the answer (dotted path, list indices as numbers)."""

    def apply(d: dict) -> None:
        *head, last = path.split(".")
        for k in head:
            d = d[int(k)] if isinstance(d, list) else d[k]
        d[int(last) if isinstance(d, list) else last] = value

    return apply


def _first_top(value: Any) -> Callable[[dict], None]:
    def apply(d: dict) -> None:
        top = d["choices"][0]["logprobs"]["top_logprobs"][0]
        top[next(iter(top))] = value

    return apply


def _all_top(value: float) -> Callable[[dict], None]:
    def apply(d: dict) -> None:
        for top in d["choices"][0]["logprobs"]["top_logprobs"]:
            for k in top:
                top[k] = value

    return apply


def _drop_last_token(d: dict) -> None:
    d["choices"][0]["logprobs"]["tokens"].pop()


def _replace(value: Any) -> Callable[[dict], Any]:
    return lambda d: value


def _lp(d: dict) -> dict:
    return d["choices"][0]["logprobs"]


def _greedy_not_top_1(d: dict) -> None:
    """Position 0 chose its second most likely token, at that token's own log-probability: consistent,
    but not what greedy decoding picks."""
    lp = _lp(d)
    second = list(lp["top_logprobs"][0])[1]
    lp["tokens"][0], lp["token_logprobs"][0] = second, lp["top_logprobs"][0][second]


def _own_entry_contradicts(d: dict) -> None:
    """The chosen token at -0.1, while its own top-k entry says -3.0."""
    lp = _lp(d)
    lp["token_logprobs"][0] = -0.1
    lp["top_logprobs"][0][lp["tokens"][0]] = -3.0


def _chosen_absent(d: dict) -> None:
    """The chosen token at p 0.9, absent from a top-k whose best entry is p 0.05."""
    lp = _lp(d)
    lp["token_logprobs"][0] = math.log(0.9)
    n = len(lp["top_logprobs"][0])
    lp["top_logprobs"][0] = {f"token_id:{900 + j}": math.log(0.05) - j for j in range(n)}


def _duplicate_spelling(d: dict) -> None:
    """Token 3000 twice in a top-k: `token_id:3000` and `token_id:03000`."""
    top = _lp(d)["top_logprobs"][0]
    for key in list(top)[-2:]:
        del top[key]
    top.update({"token_id:3000": math.log(0.01), "token_id:03000": math.log(0.01)})


def _float32_overflow(d: dict) -> None:
    """-1e308: a finite float64, -inf once recorded as float32."""
    _lp(d)["token_logprobs"][1] = -1e308


def _near_certain(d: dict) -> None:
    """A near-certain token whose log-probability, computed in low precision, lands just above 0."""
    lp = _lp(d)
    chosen = lp["tokens"][0]
    lp["token_logprobs"][0] = 5e-4
    lp["top_logprobs"][0] = {k: (5e-4 if k == chosen else -20.0 - j) for j, k in enumerate(lp["top_logprobs"][0])}


def _certain(d: dict) -> None:
    """A certain token: log-probability -0.0 (the sign bit set), every other entry far below."""
    lp = _lp(d)
    chosen = lp["tokens"][3]
    lp["token_logprobs"][3] = -0.0
    lp["top_logprobs"][3] = {k: (-0.0 if k == chosen else -20.0 - j) for j, k in enumerate(lp["top_logprobs"][3])}


def _bf16_rounded(d: dict) -> None:
    """The chosen token's top-k entry rounded to bf16 (-0.69140625), its own log-probability not."""
    lp = _lp(d)
    lp["top_logprobs"][0][lp["tokens"][0]] = -0.69140625


def _greedy_tie(d: dict) -> None:
    """Two tokens tie for the top; greedy chose the one listed second."""
    lp = _lp(d)
    top = lp["top_logprobs"][0]
    first, second = list(top)[:2]
    top[first] = top[second] = math.log(0.3)
    lp["tokens"][0], lp["token_logprobs"][0] = second, math.log(0.3)


def _chosen_below_top_k(d: dict) -> None:
    """A sampled token less likely than every top-k entry, absent from it (a server that does not add it)."""
    lp = _lp(d)
    lp["tokens"][0], lp["token_logprobs"][0] = "token_id:299", -30.0


def _chosen_added_as_k_plus_1(d: dict) -> None:
    """vLLM's way: a sampled token outside the top-k is added to it as one more entry."""
    lp = _lp(d)
    lp["tokens"][0], lp["token_logprobs"][0] = "token_id:299", -30.0
    lp["top_logprobs"][0]["token_id:299"] = -30.0


def _top_unsorted(d: dict) -> None:
    top = _lp(d)["top_logprobs"][0]
    items = list(top.items())
    top.clear()
    top.update(reversed(items))


def _top_extra_entries(d: dict) -> None:
    """More entries than asked (they are ranked and cut to k)."""
    top = _lp(d)["top_logprobs"][0]
    first = int(next(iter(top)).split(":")[1])
    top.update({f"token_id:{first + 100 + j}": -10.0 - j for j in range(5)})


def _top_three(d: dict) -> None:
    top = _lp(d)["top_logprobs"][0]
    for key in list(top)[3:]:
        del top[key]


def _content(d: dict) -> list:
    return d["choices"][0]["logprobs"]["content"]


def _chat_greedy_not_top_1(d: dict) -> None:
    e = _content(d)[0]
    e["token"], e["logprob"] = e["top_logprobs"][1]["token"], e["top_logprobs"][1]["logprob"]


def _chat_own_entry_contradicts(d: dict) -> None:
    e = _content(d)[0]
    e["logprob"] = -0.1
    e["top_logprobs"][0]["logprob"] = -3.0


def _chat_chosen_absent(d: dict) -> None:
    e = _content(d)[0]
    e["logprob"] = math.log(0.9)
    e["top_logprobs"] = [
        {"token": f"token_id:{900 + j}", "logprob": math.log(0.05) - j} for j in range(len(e["top_logprobs"]))
    ]


def _chat_duplicate(d: dict) -> None:
    e = _content(d)[0]
    e["top_logprobs"][-1] = dict(e["top_logprobs"][-2])
    e["top_logprobs"][-1]["logprob"] = e["top_logprobs"][-2]["logprob"] = math.log(0.001)


# answer mutations of a /v1/completions answer in vLLM's format (max_tokens 4)
MUTATIONS: dict[str, Callable[[dict], Any]] = {
    "string-logprob": _set("choices.0.logprobs.token_logprobs.0", "-0.1"),
    "integer-token": _set("choices.0.logprobs.tokens.0", 123),
    "negative-id": _set("choices.0.logprobs.tokens.0", "token_id:-5"),
    "out-of-vocab-id": _set("choices.0.logprobs.tokens.1", "token_id:4000000"),
    "huge-integer-id": _set("choices.0.logprobs.tokens.0", "token_id:" + "9" * 30),
    "huge-integer-logprob": _set("choices.0.logprobs.token_logprobs.0", -(10**400)),
    "nan-logprob": _set("choices.0.logprobs.token_logprobs.1", math.nan),
    "inf-logprob": _set("choices.0.logprobs.token_logprobs.1", -math.inf),
    "positive-logprob": _set("choices.0.logprobs.token_logprobs.2", 0.5),
    "nan-top-logprob": _first_top(math.nan),
    "top-probabilities-over-1": _all_top(0.0),
    "top-not-an-object": _set("choices.0.logprobs.top_logprobs.0", ["x"]),
    "lists-of-different-lengths": _drop_last_token,
    "no-choices": _set("choices", []),
    "choices-a-string": _set("choices", "x"),
    "answer-a-list": _replace([1, 2, 3]),
    "logprobs-a-string": _set("choices.0.logprobs", "abc"),
    # answers whose numbers cannot all be true
    "greedy-not-top-1": _greedy_not_top_1,
    "own-entry-contradicts": _own_entry_contradicts,
    "chosen-absent-from-top-k": _chosen_absent,
    "duplicate-id-spellings": _duplicate_spelling,
    "float32-overflow": _float32_overflow,
    "top-float32-overflow": _first_top(-1e308),
    "boolean-logprob": _set("choices.0.logprobs.token_logprobs.0", True),
    "token-id-plus-sign": _set("choices.0.logprobs.tokens.0", "token_id:+305"),
    "token-id-float": _set("choices.0.logprobs.tokens.0", "token_id:305.0"),
    "token-id-arabic-digits": _set("choices.0.logprobs.tokens.0", "token_id:\u0663\u0660\u0665"),
    "token-id-leading-zero": _set("choices.0.logprobs.tokens.0", "token_id:0305"),
    "token-string-too-long": _set("choices.0.logprobs.tokens.0", "token_id:" + "1" * 300),
    "top-entry-null": _set("choices.0.logprobs.top_logprobs.0", None),
    "top-empty": _set("choices.0.logprobs.top_logprobs.0", {}),
    "top-three-entries": _top_three,
    "choices-null": _set("choices", None),
    "token-logprobs-a-mapping": _set("choices.0.logprobs.token_logprobs", {"0": -1.0}),
    # answers that look odd but are possible (accepted)
    "negative-zero-logprob": _certain,
    "near-certain-token-above-0": _near_certain,
    "bf16-rounded-top-entry": _bf16_rounded,
    "greedy-tie": _greedy_tie,
    "sampled-token-below-top-k": _chosen_below_top_k,
    "greedy-token-below-top-k": _chosen_below_top_k,
    "sampled-token-added-as-k-plus-1": _chosen_added_as_k_plus_1,
    "top-unsorted": _top_unsorted,
    "top-more-entries-than-asked": _top_extra_entries,
    "finish-reason-a-number": _set("choices.0.finish_reason", 5),
    "extra-fields": _set("choices.0.x_vendor", {"debug": [1, 2, 3]}),
    # chat answers (--api chat)
    "chat-greedy-not-top-1": _chat_greedy_not_top_1,
    "chat-own-entry-contradicts": _chat_own_entry_contradicts,
    "chat-chosen-absent-from-top-k": _chat_chosen_absent,
    "chat-duplicate-top-entry": _chat_duplicate,
    "chat-float32-overflow": _set("choices.0.logprobs.content.1.logprob", -1e308),
    "chat-nan-logprob": _set("choices.0.logprobs.content.0.logprob", math.nan),
    "chat-empty-content": _set("choices.0.logprobs.content", []),
    "chat-content-a-string": _set("choices.0.logprobs.content", "x"),
    "chat-top-entry-a-string": _set("choices.0.logprobs.content.0.top_logprobs.0", "x"),
    "chat-no-logprobs": _set("choices.0.logprobs", None),
}


class Fake:
    """Plays one behaviour (`mode`); records what it received."""

    def __init__(self) -> None:
        self.tokenizer = None  # set for SGLang's format (token texts)
        self.url = ""
        self.reset()

    def reset(self) -> None:
        self.mode = "ok"
        self.model_id = MODEL_ID
        self.owner = "vllm"
        self.tokens_out: int | None = None  # this many tokens whatever max_tokens says (None: max_tokens)
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.failures_left = 0
        self.dropped = 0
        self.alone = 0  # "load-variant": generation requests answered at once, as without load
        self.generations = 0  # generation requests received ("load-variant")
        self.held: list[asyncio.Event] = []  # "load-variant": one per held request, set when another arrives
        self.key = ""  # the API key of the last request (its Authorization header, less "Bearer ")

    # ------------------------------------------------------------------ answers

    def _text(self, t: int) -> str:
        return self.tokenizer.decode([t])

    def completion(self, body: dict) -> dict:
        prompt = body["prompt"]
        seed = sum(prompt) if isinstance(prompt, list) else len(prompt)
        k = int(body.get("logprobs") or 0)
        n = self.tokens_out if self.tokens_out is not None else int(body.get("max_tokens", 1))
        ids = [(seed + 7 * i) % 400 + 300 for i in range(n)]
        if self.mode == "echo-key-in-tokens" and k:  # generated tokens that spell the API key out
            ids = self.tokenizer.encode(self.key, add_special_tokens=False)[:n]
            n = len(ids)
        sglang = self.owner == "sglang"
        name = self._text if sglang else (lambda t: f"token_id:{t}")
        tops = []
        for t in ids:
            top: dict[str, float] = {}
            for j in range(k):
                top.setdefault(name(t + j), TOP[j])
            tops.append(top)
        lp = {
            "tokens": [name(t) for t in ids],
            "token_logprobs": [TOP[0]] * n,
            "top_logprobs": tops,
            "text_offset": [-1 if sglang else i for i in range(n)],
        }
        choice: dict[str, Any] = {"index": 0, "text": "x" * n, "finish_reason": "length", "logprobs": lp if k else None}
        if sglang and body.get("echo") and k and isinstance(prompt, list):
            lp["tokens"] = [name(t) for t in prompt] + lp["tokens"]
            lp["token_logprobs"] = [None] + [-1.0 - 0.001 * p for p in range(1, len(prompt))] + lp["token_logprobs"]
            lp["top_logprobs"] = [None] * len(prompt) + lp["top_logprobs"]
        if sglang and body.get("return_token_ids"):
            choice["token_ids"] = ids
        if self.mode == "nologprobs":
            choice["logprobs"] = None
        if body.get("prompt_logprobs") is not None and self.mode != "tf-missing":
            value = TF_VALUES.get(self.mode)
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": value if self.mode in TF_VALUES else -1.0 - 0.001 * p, "rank": 1}}
                for p, t in enumerate(prompt[1:], 1)
            ]
        return {"id": "cmpl", "object": "text_completion", "model": self.model_id, "choices": [choice]}

    def chat(self, body: dict) -> dict:
        n = self.tokens_out if self.tokens_out is not None else int(body.get("max_tokens", 1))
        k = int(body.get("top_logprobs") or 0)
        ids = [(len(body["messages"][0]["content"]) + 7 * i) % 400 + 300 for i in range(n)]
        content = [
            {
                "token": f"token_id:{t}",
                "logprob": TOP[0],
                "top_logprobs": [{"token": f"token_id:{t + j}", "logprob": TOP[j]} for j in range(k)],
            }
            for t in ids
        ]
        if self.mode == "chat-string-logprob":
            content[0]["logprob"] = "-0.1"
        choice = {"index": 0, "message": {"role": "assistant", "content": "x"}, "finish_reason": "length"}
        choice["logprobs"] = {"content": content} if body.get("logprobs") else None
        return {"id": "chat", "object": "chat.completion", "model": self.model_id, "choices": [choice]}

    # ------------------------------------------------------------------ transport

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        headers = {k.decode(): v.decode() for k, v in scope["headers"]}
        self.headers.append(headers)
        auth = headers.get("authorization", "")
        key = self.key = auth.removeprefix("Bearer ")
        mode = self.mode
        status, out, extra = 404, {"error": {"message": "not found"}}, []
        if path == "/v1/models":
            if mode == "trickle-models":
                return await self._trickle(send)
            ids = {
                # an id holding the key that still names --model (its last path part), and the key alone
                "echo-key-in-models": [f"{auth}/{MODEL_ID}", auth],
                # the key's characters joined by zero-width spaces
                "echo-key-zero-width-in-models": [self.model_id, "\u200b".join(key)],
                "models-huge-id": ["m" * 100_000],
            }.get(mode, [self.model_id])
            data: Any = [{"id": i, "owned_by": self.owner} for i in ids]
            data = {"models-not-a-list": "x", "models-empty": []}.get(mode, data)
            status, out = 200, {"object": "list", "data": data}
        elif path == "/version" and self.owner != "sglang":
            version = {
                "echo-key-in-version": f"fake-0.1 {auth}",
                "echo-key-prefix-in-version": f"fake-0.1 {key[:26]}",  # a prefix: the whole key never appears
                # the key cut by control characters every 5 characters: no piece of 8 in the raw text
                "echo-key-split-in-version": "fake-0.1 " + "\x00".join(key[i : i + 5] for i in range(0, len(key), 5)),
                "echo-key-after-64k-control-characters": "\x01" * (2**16 - 7) + key,
                "version-a-number": 5,
                "version-huge": "v" * 200_000,
            }.get(mode, "fake-0.1")
            status, out = 200, {"version": version}
        elif path in ("/v1/completions", "/v1/chat/completions"):
            req = json.loads(body)
            self.requests.append(req)
            audited = bool(req.get("logprobs")) or req.get("prompt_logprobs") is not None or req.get("echo")
            if mode == "load-variant":
                return await self._load_variant(send, req, audited)
            if mode == "hang":
                await asyncio.sleep(30)
            if mode == "trickle":
                return await self._trickle(send)
            if mode in ("huge", "huge-declared") and audited:
                return await self._huge(send, declared=mode == "huge-declared")
            if mode == "drop-once" and self.dropped == 0:
                self.dropped += 1
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]})
                await send({"type": "http.response.body", "body": b'{"choi', "more_body": True})
                raise ConnectionError("the fake drops this connection mid-answer")
            if mode == "gzip-bomb" and audited:
                return await self._gzip_bomb(send)
            if mode == "redirect-302":
                extra = [(b"location", b"http://127.0.0.1:1/elsewhere")]
                return await self._raw(send, 302, b"", extra)
            raw = {
                "answer-null": b"null",
                "empty-body": b"",
                "not-json": b"<html>502 bad gateway</html>",
                "deeply-nested-json": b"[" * 100_000 + b"]" * 100_000,
                "integer-of-5000-digits": b'{"choices": [{"logprobs": {"token_logprobs": [' + b"1" * 5000 + b"]}}]}",
            }.get(mode)
            if raw is not None and audited:
                return await self._raw(send, 200, raw)
            if self.failures_left > 0:
                self.failures_left -= 1
                status, out = 429, {"error": {"message": "too many requests"}}
            elif mode == "http-503-always":
                status, out, extra = 503, {"error": {"message": "overloaded"}}, [(b"retry-after", b"0")]
            elif mode == "http-500-echoing-the-key":
                status, out = 500, {"error": {"message": f"internal error (request header Authorization: {auth})"}}
            elif mode == "echo-key-spaced-in-error":  # the key with a space between every two characters
                status, out = 500, {"error": {"message": "bad key " + " ".join(key)}}
            elif mode == "echo-key-prefix-in-error":
                status, out = 500, {"error": {"message": f"bad key {key[:26]}..."}}
            elif mode == "http-404":
                status, out = 404, {"error": {"message": "no such route"}}
            elif mode == "http-400":
                status, out = 400, {"object": "error", "message": "max_tokens is too large", "code": 400}
            elif mode == "http-401":
                status, out = 401, {"error": {"message": "invalid key"}}
            else:
                status = 200
                out = self.chat(req) if path.endswith("chat/completions") else self.completion(req)
                if mode in MUTATIONS and audited and "prompt_logprobs" not in req:
                    out = MUTATIONS[mode](out) or out
        data = json.dumps(out).encode()
        await self._raw(send, status, data, extra)

    async def _load_variant(self, send, req: dict, audited: bool) -> None:
        overlapped = bool(self.held)  # requests held now overlap this one, and it overlaps them
        for other in self.held:
            other.set()
        out = self.completion(req)
        lp = out["choices"][0]["logprobs"]
        if audited and "prompt_logprobs" not in req and lp is not None and len(lp["tokens"]) > 2:
            self.generations += 1
            if self.generations > self.alone:
                mine = asyncio.Event()
                if overlapped:
                    mine.set()
                self.held.append(mine)
                try:
                    await mine.wait()  # until another request arrives: answered under load
                finally:
                    self.held.remove(mine)
                was, now = lp["tokens"][2], f"token_id:{int(lp['tokens'][2].split(':')[1]) + 1}"
                lp["tokens"][2] = now  # the second most likely token moved to the top: the answer stays consistent
                top = lp["top_logprobs"][2]
                if now in top:
                    top[was], top[now] = top[now], top[was]
                lp["token_logprobs"] = [x - 0.01 for x in lp["token_logprobs"]]
                lp["top_logprobs"] = [{k: v - 0.01 for k, v in top.items()} for top in lp["top_logprobs"]]
        await self._raw(send, 200, json.dumps(out).encode())

    async def _raw(self, send, status: int, data: bytes, extra=()) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()), *extra]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def _trickle(self, send) -> None:
        """An answer one byte at a time, 0.3 s apart: every read returns quickly, the whole never ends."""
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": b"{", "more_body": True})
        for _ in range(200):
            await asyncio.sleep(0.3)
            await send({"type": "http.response.body", "body": b" ", "more_body": True})
        await send({"type": "http.response.body", "body": b"}"})

    async def _gzip_bomb(self, send) -> None:
        """40 MiB of JSON whitespace compressed to a few dozen KiB (Content-Encoding: gzip)."""
        data = _gzip_bomb()
        headers = [(b"content-type", b"application/json"), (b"content-encoding", b"gzip")]
        headers.append((b"content-length", str(len(data)).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": data})

    async def _huge(self, send, declared: bool) -> None:
        """40 MiB of valid JSON (whitespace, then {}): refused for its size, by its header or as read."""
        mib, n = b" " * 2**20, 40
        headers = [(b"content-type", b"application/json")]
        if declared:
            headers.append((b"content-length", str(n * 2**20 + 2).encode()))
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(n):
            await send({"type": "http.response.body", "body": mib, "more_body": True})
        await send({"type": "http.response.body", "body": b"{}"})


@functools.lru_cache(maxsize=1)
def _gzip_bomb() -> bytes:
    import gzip

    return gzip.compress(b" " * (40 * 2**20) + b"{}", compresslevel=9)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Served:
    """`Fake` served on 127.0.0.1 in a thread (a context manager)."""

    def __init__(self, app: Fake) -> None:
        self.app = app
        port = free_port()
        self.server = uvicorn.Server(
            uvicorn.Config(
                app, host="127.0.0.1", port=port, log_level="critical", lifespan="on", timeout_graceful_shutdown=1
            )
        )
        app.url = f"http://127.0.0.1:{port}/v1"

    def __enter__(self) -> Fake:
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.05)
        return self.app

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
