"""`OpenAIEngine`: the Engine of `--engine openai` (and the client side of `--engine vllm-server`).

Each audited prompt is one request; a cell's batch size is how many are in flight at once (an
asyncio semaphore), with optional background load (`load.py`) running for the whole time. Requests
carry the suite's sampling settings, `max_tokens`, a per-request seed and `logprobs` / `top_logprobs`
(k = --logprobs). Teacher forcing uses vLLM's `prompt_logprobs`, else `echo` + `logprobs`, else none.

Every string the server provides (model ids, version) is recorded only through `urls.redact` (the API
key removed, the length bounded); every answer is checked field by field (`wire.Expect`).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from detaudit.config import DecodingParams, EngineOptions, ServerConfig
from detaudit.errors import DetauditError
from detaudit.runs.records import Generation, ProgressFn
from detaudit.server import wire
from detaudit.server.http import Http, RetryPolicy, get_json_sync
from detaudit.server.load import LoadStats, background_pool, run_background
from detaudit.server.urls import check_base_url, public_url, read_api_key, redact, server_root


@dataclass
class ServerOptions:
    """What the client of one server needs: the user's `ServerConfig`, where the server is, and what it
    knows of --model (to match the served model id; its tokenizer for text prompts and token strings)."""

    base_url: str
    api: str = "completions"
    api_key_env: str | None = None
    prompt_format: str = "ids"
    server_model: str | None = None  # the id to request; default: the one matching --model
    model_candidates: tuple[str, ...] = ()  # --model as given, its name, path and directory name
    model_path: str = ""  # tokenizer (token-string mapping, text prompts, random background prompts)
    vocab_size: int = 0  # --model's vocabulary (config.json): returned token ids must lie below it
    request_timeout: float = 300.0
    retries: int = 6
    retry_total_s: float = 120.0
    background_prompts: str = "suite"
    server_kind: str = "auto"

    @classmethod
    def of(cls, o: EngineOptions, **override: Any) -> "ServerOptions":
        s = o.settings.server or ServerConfig()
        fields = dict(
            base_url=s.base_url or "",
            api=s.api,
            api_key_env=s.api_key_env,
            prompt_format=s.prompt_format,
            server_model=s.server_model,
            model_candidates=(o.model.spec, o.model.name, str(o.model.path)),
            model_path=str(o.model.path),
            vocab_size=_vocab(o.model.config),
            request_timeout=s.request_timeout,
            background_prompts=s.background_prompts,
            server_kind=s.server_kind,
        )
        return cls(**{**fields, **override})

    def api_key(self) -> str | None:
        return read_api_key(self.api_key_env)

    def retry(self) -> RetryPolicy:
        return RetryPolicy(retries=self.retries, total_s=self.retry_total_s)


def _vocab(config: dict) -> int:
    v = config.get("vocab_size") if isinstance(config, dict) else None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else 0


@dataclass
class ServerInfo:
    base_url: str
    model: str  # the id requested (--model's or --server-model's text, as the server spells it)
    models: list[str]  # what the server lists (redacted)
    version: str | None  # redacted
    kind: str
    shown_model: str = ""  # `model` as recorded (redacted)


def probe(o: ServerOptions) -> ServerInfo:
    """The server's model ids (`/v1/models`, which must serve --model) and version (`/version`). The id
    requested is --model's or --server-model's (the user's text); what the server lists is recorded
    only redacted."""
    base = check_base_url(o.base_url)
    key = o.api_key()
    quick = RetryPolicy(
        retries=min(o.retries, 3), total_s=min(o.retry_total_s, 10.0)
    )  # a server that is not up fails fast
    d = get_json_sync(base, "/models", key, min(o.request_timeout, 30.0), quick)
    data = d.get("data") if isinstance(d, dict) else None
    if not isinstance(data, list):
        raise DetauditError(f"server {public_url(base)}/models: not an OpenAI model list")
    entries = [m for m in data if isinstance(m, dict) and isinstance(m.get("id"), str)]
    ids = [m["id"] for m in entries]
    if not ids:
        raise DetauditError(f"server {public_url(base)} serves no model")
    model = _match(ids, o, key)
    version = None
    v = get_json_sync(
        server_root(base), "/version", key, min(o.request_timeout, 30.0), RetryPolicy(retries=1), ok_404=True
    )
    if isinstance(v, dict) and isinstance(v.get("version"), str):
        version = redact(v["version"], key, 80, base)
    kind = o.server_kind
    if kind == "auto":
        owners = {str(m.get("owned_by", ""))[:40].lower() for m in entries}
        kind = "vllm" if "vllm" in owners else "sglang" if "sglang" in owners else "generic"
    shown = [redact(i, key, 120, base) for i in ids[:10]]
    return ServerInfo(base, model, shown, version, kind, redact(model, key, 120, base))


def _match(ids: list[str], o: ServerOptions, key: str | None) -> str:
    shown = ", ".join(redact(i, key, 60) for i in ids[:5]) + (", ..." if len(ids) > 5 else "")
    if o.server_model:
        if o.server_model not in ids:
            raise DetauditError(
                f"--server-model {o.server_model[:60]!r} is not served by {public_url(o.base_url)} (it serves {shown})"
            )
        return o.server_model
    cands = [c for c in o.model_candidates if c]
    names = {Path(c.rstrip("/")).name.lower() for c in cands} | {c.lower() for c in cands}
    for i in ids:
        if i in cands or i.lower() in names or Path(i.rstrip("/")).name.lower() in names:
            return i
    want = cands[0] if cands else "?"
    raise DetauditError(
        f"model mismatch: {public_url(o.base_url)} serves {shown}, not --model {want[:60]!r} "
        "(pass --server-model ID to audit that id with --model's tokenizer)"
    )


class OpenAIEngine:
    """The Engine over an OpenAI-compatible server."""

    engine_name = "openai"

    @classmethod
    def open(cls, o: EngineOptions) -> "OpenAIEngine":
        return cls(ServerOptions.of(o))

    def __init__(self, o: ServerOptions, info: ServerInfo | None = None, extra_describe: dict | None = None) -> None:
        self.o = o
        self.key = o.api_key()
        self.info = info or probe(o)
        self.kind = self.info.kind
        self.tokens = wire.TokenMap(self._tokenizer if o.model_path else None)
        self._tok = None
        vllm = self.kind == "vllm"
        self.tf_mode: str | None = "prompt_logprobs" if vllm else "echo"
        self.tf_note = (
            "vLLM prompt_logprobs (one request per prompt + continuation)"
            if vllm
            else "echo + logprobs (tried on the first scored prompt)"
        )
        self.load: dict[str, Any] = {}
        self.retried = 0
        self.ids_given = 0  # answers whose generated tokens came as ids (SGLang's return_token_ids)
        self.extra_describe = extra_describe or {}
        self._texts: dict[tuple[int, ...], str] = {}  # prompt token ids -> user message (--api chat)

    def _vocab_size(self) -> int:
        """Token ids a valid answer can hold: below --model's vocabulary size (config.json, else its
        tokenizer's length; 0 checks nothing when neither is known)."""
        if self.o.vocab_size:
            return self.o.vocab_size
        return len(self._tokenizer()) if self.o.model_path else 0

    def _tokenizer(self):
        if self._tok is None:
            from detaudit.models import tokenizer_for

            self._tok = tokenizer_for(Path(self.o.model_path))
        return self._tok

    def _where(self, path: str) -> str:
        return f"{public_url(self.info.base_url)}{path}"

    # ------------------------------------------------------------------ requests

    def _prompt(self, ids: Sequence[int]):
        """An audited prompt as the request carries it."""
        if self.o.api == "chat":
            text = self._texts.get(tuple(ids))
            if text is None:
                raise DetauditError("--api chat: no user message known for a prompt (chat needs suite prompts)")
            return text
        if self.o.prompt_format == "text":
            return self._tokenizer().decode(list(ids), skip_special_tokens=False)
        return list(map(int, ids))

    def _load_prompt(self, ids: Sequence[int]):
        """A background prompt (token ids of the load pattern) as the request carries it."""
        if self.o.api == "chat":  # a background prompt may be no suite prompt: its text decoded instead
            return self._texts.get(tuple(ids)) or self._tokenizer().decode(list(ids), skip_special_tokens=True) or "x"
        return self._prompt(ids)

    def _body(self, prompt, decoding: DecodingParams, prompt_id: str, logprobs: bool = True) -> tuple[str, dict]:
        if self.o.api == "chat":
            return "/chat/completions", wire.chat_body(
                self.info.model, prompt, decoding, prompt_id, self.kind, logprobs
            )
        return "/completions", wire.completion_body(self.info.model, prompt, decoding, prompt_id, self.kind, logprobs)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_ids: Sequence[str],
        decoding: DecodingParams,
        batch_size: int,
        progress: ProgressFn | None = None,
        *,
        background: int = 0,
        texts: Sequence[str] | None = None,
    ) -> list[Generation]:
        self._texts = {tuple(map(int, p)): t for p, t in zip(prompts, texts or ())}
        return asyncio.run(self._generate(prompts, prompt_ids, decoding, batch_size, progress, background))

    async def _generate(self, prompts, prompt_ids, decoding, batch_size, progress, n_bg: int) -> list[Generation]:
        stats = LoadStats()
        pattern = self.o.background_prompts
        self.load = {"concurrency": batch_size, "background": n_bg, "background_prompts": pattern if n_bg else None}
        chat = self.o.api == "chat"
        ex = wire.Expect(
            self._where("/chat/completions" if chat else "/completions"),
            decoding.logprobs,
            decoding.max_new_tokens,
            self._vocab_size(),
            greedy=decoding.greedy,
        )
        parse = wire.parse_chat if chat else wire.parse_completion
        async with Http(
            self.info.base_url, self.key, self.o.request_timeout, self.o.retry(), batch_size + n_bg + 2
        ) as http:
            sem = asyncio.Semaphore(batch_size)
            out: list[Generation | None] = [None] * len(prompts)

            async def one(i: int) -> None:
                async with sem:
                    path, body = self._body(self._prompt(prompts[i]), decoding, prompt_ids[i])
                    d = await http.request("POST", path, body)
                out[i] = g = parse(d, ex, self.tokens)
                if not chat and isinstance(d["choices"][0].get("token_ids"), list):
                    self.ids_given += 1
                if progress:
                    progress(len(g.token_ids))

            async def send_background(prompt, j: int) -> None:
                path, body = self._body(prompt, decoding, f"background-{j}", logprobs=False)
                await http.request("POST", path, body)

            stop = asyncio.Event()
            bg = None
            if n_bg:
                ids = background_pool(pattern, prompts, self._vocab_size() or 32000, n_bg)
                pool = [self._load_prompt(p) for p in ids]
                bg = asyncio.create_task(run_background(n_bg, pool, send_background, stop, stats))
                await asyncio.sleep(0)  # the background's first requests go out first
            tasks = [asyncio.create_task(one(i)) for i in range(len(prompts))]
            try:
                await asyncio.gather(*tasks)
            finally:
                for t in tasks:
                    t.cancel()
                stop.set()
                if bg is not None:
                    await asyncio.gather(bg, return_exceptions=True)
                self.retried += http.retried
        if n_bg:
            self.load.update(
                background_sent=stats.sent,
                background_requests=stats.requests,
                background_failed=stats.failed,
                background_errors=stats.errors,
            )
        return [g for g in out if g is not None]

    def score(self, prompts, continuations, batch_size: int) -> list[list[float]] | None:
        if self.tf_mode is None:
            return None
        return asyncio.run(self._score(prompts, continuations, batch_size))

    async def _score(self, prompts, continuations, batch_size) -> list[list[float]] | None:
        ex = wire.Expect(self._where("/completions"))
        async with Http(self.info.base_url, self.key, self.o.request_timeout, self.o.retry(), batch_size + 2) as http:

            async def one(i: int) -> list[float] | None:
                seq = list(map(int, prompts[i])) + list(map(int, continuations[i]))
                body = {"model": self.info.model, "prompt": seq, "max_tokens": 1, "temperature": 0.0}
                if self.tf_mode == "prompt_logprobs":
                    body["prompt_logprobs"] = 0
                    d = await http.request("POST", "/completions", body)
                    return wire.parse_prompt_logprobs(d, len(prompts[i]), continuations[i], ex)
                body.update(echo=True, logprobs=1)
                d = await http.request("POST", "/completions", body)
                return wire.parse_echo_logprobs(d, len(prompts[i]), continuations[i], ex)

            if not prompts:
                return []
            if self.tf_mode == "echo":  # probe once: a server without echo logprobs scores nothing
                try:
                    first = await one(0)
                except wire.BadAnswer:
                    raise
                except DetauditError as e:
                    first, why = None, str(e)
                else:
                    why = "the answer has no echoed prompt log-probabilities"
                if first is None:
                    self.tf_mode, self.tf_note = None, f"unavailable: echo + logprobs failed ({why[:160]})"
                    return None
            sem = asyncio.Semaphore(batch_size)

            async def bounded(i: int):
                async with sem:
                    return await one(i)

            res = await asyncio.gather(*(bounded(i) for i in range(len(prompts))))
        if any(r is None for r in res):
            self.tf_mode, self.tf_note = (
                None,
                "unavailable: the server's prompt log-probabilities did not cover the continuation",
            )
            return None
        return list(res)  # type: ignore[arg-type]

    def _token_ids_note(self) -> str:
        if self.tokens.mapped:
            exact = "generated tokens returned as ids (SGLang return_token_ids); " if self.ids_given else ""
            return (
                f"{exact}mapped from the server's token strings with --model's tokenizer (approximate: "
                f"{self.tokens.mapped} mapped, {self.tokens.unmapped} without a single id, recorded as -1)"
            )
        if self.kind == "vllm":
            return "returned by the server (vLLM return_tokens_as_token_ids)"
        return "returned as ids"

    def describe(self) -> dict[str, Any]:
        return {
            "engine": self.engine_name,
            "server": {
                "base_url": public_url(self.info.base_url),
                "model": self.info.shown_model or redact(self.info.model, self.key, 120),
                "models": self.info.models[:10],
                "version": self.info.version,
                "kind": self.info.kind,
            },
            "api": self.o.api,
            "prompt_format": "chat messages (server-side template)"
            if self.o.api == "chat"
            else (
                "token ids (detaudit's chat template)"
                if self.o.prompt_format == "ids"
                else "text (detaudit's chat template, decoded; the server re-tokenizes it)"
            ),
            "token_ids": self._token_ids_note(),
            "teacher_forcing": self.tf_note if self.tf_mode else (self.tf_note or "unavailable"),
            "load": dict(self.load),
            "request_timeout_s": self.o.request_timeout,
            "retries_used": self.retried,
            "api_key": f"from ${self.o.api_key_env}" if self.o.api_key_env else "none",
            **self.extra_describe,
        }

    def close(self) -> None:
        pass
