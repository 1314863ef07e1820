"""The async HTTP layer of the server client: bounded retries with exponential backoff on 429 / 503 /
502 and dropped connections, a deadline per request, a cap on an answer's size, and one-line errors
(`DetauditError`) that name the server by its credential-free URL and never carry the API key.

`--request-timeout` is a deadline for the whole request (connect, send, every byte of the answer), not
a per-read timeout: a server that trickles its answer a byte at a time is cut off at the deadline like
one that never answers."""

from __future__ import annotations

import asyncio
import json
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from detaudit.errors import DetauditError
from detaudit.server.urls import is_loopback, public_url, redact
from detaudit.server.wire import BadAnswer

RETRY_STATUS = (429, 502, 503)
# The largest answer read: top-20 log-probabilities of 4096 tokens take about 3 MB in vLLM's format.
MAX_ANSWER_BYTES = 32 * 2**20


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 6  # attempts after the first
    base_s: float = 0.5  # first backoff; doubles per attempt (with jitter), capped at max_backoff_s
    max_backoff_s: float = 8.0
    total_s: float = 120.0  # no retry starts after this many seconds since the first attempt


@dataclass
class _Reply:
    status: int
    headers: httpx.Headers
    body: bytes


class Http:
    """One async client per generate/score call (its own event loop)."""

    def __init__(
        self, base_url: str, api_key: str | None, timeout_s: float, retry: RetryPolicy, connections: int
    ) -> None:
        self.base_url, self.timeout_s, self.retry = base_url, timeout_s, retry
        self.public = public_url(base_url)
        self._secret = api_key or ""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            base_url=base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 10.0)),
            limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
            trust_env=not is_loopback(base_url),  # no proxy between detaudit and a local server
        )
        self.retried = 0

    async def __aenter__(self) -> "Http":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()

    def scrub(self, text: object, limit: int = 300) -> str:
        return redact(text, self._secret, limit, self.base_url)

    async def _once(self, method: str, path: str, body: dict | None, where: str) -> _Reply:
        """One attempt, the whole answer read (at most MAX_ANSWER_BYTES) within the deadline."""
        async with self.client.stream(method, path, json=body) as r:
            if r.status_code in RETRY_STATUS:
                return _Reply(r.status_code, r.headers, b"")
            size = r.headers.get("content-length", "")
            if size.isdigit() and int(size) > MAX_ANSWER_BYTES:
                raise _too_large(where)
            chunks, n = [], 0
            async for chunk in r.aiter_bytes():  # decoded: a compressed answer is bounded as read
                n += len(chunk)
                if n > MAX_ANSWER_BYTES:
                    raise _too_large(where)
                chunks.append(chunk)
            return _Reply(r.status_code, r.headers, b"".join(chunks))

    async def request(self, method: str, path: str, body: dict | None = None, *, ok_404: bool = False) -> Any:
        """JSON of a 2xx answer (None for a 404 when `ok_404`); retried on overload and dropped
        connections within the policy's bounds; everything else is a one-line DetauditError (an answer
        that is not JSON, or too large, is a `BadAnswer`)."""
        start = time.monotonic()
        attempt = 0
        where = f"{self.public}{path}"
        while True:
            reason = ""
            try:
                r = await asyncio.wait_for(self._once(method, path, body, where), self.timeout_s)
            except (asyncio.TimeoutError, httpx.TimeoutException):
                raise DetauditError(
                    f"server {where}: no complete answer within {self.timeout_s:g} s (--request-timeout is the "
                    "deadline of one whole request; the server hung, trickled or was overloaded)"
                ) from None
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                reason = f"{type(e).__name__}: {self.scrub(e) or 'connection failed'}"
                r = None
            except httpx.HTTPError as e:  # decoding errors, invalid headers, ...
                raise DetauditError(f"server {where}: {type(e).__name__}: {self.scrub(e)}") from None
            if r is not None:
                if r.status in RETRY_STATUS:
                    reason = f"HTTP {r.status}"
                elif r.status == 404 and ok_404:
                    return None
                elif r.status in (401, 403):
                    raise DetauditError(
                        f"server {where}: HTTP {r.status} (not authorized; set the API key in the "
                        "environment variable named by --api-key-env)"
                    )
                elif r.status >= 400:
                    raise DetauditError(f"server {where}: HTTP {r.status}: {self.scrub(_message(r.body), 200)}")
                elif 300 <= r.status < 400:  # not followed: the key would go wherever the server points
                    raise DetauditError(
                        f"server {where}: HTTP {r.status} (a redirect; detaudit does not follow it: give the "
                        "server's own address as --base-url)"
                    )
                else:
                    return _json(r.body, where)
            elapsed = time.monotonic() - start
            if attempt >= self.retry.retries or elapsed >= self.retry.total_s:
                if r is None:
                    raise DetauditError(
                        f"cannot reach server {where} ({reason}; {attempt + 1} attempt(s) in {elapsed:.0f} s)"
                    )
                raise DetauditError(f"server {where}: still {reason} after {attempt + 1} attempt(s) in {elapsed:.0f} s")
            delay = min(self.retry.max_backoff_s, self.retry.base_s * 2**attempt) * (0.5 + random.random() / 2)
            retry_after = r.headers.get("retry-after", "")[:16] if r is not None else ""
            if retry_after and retry_after.replace(".", "", 1).isdigit():
                delay = min(self.retry.max_backoff_s, float(retry_after))
            delay = max(0.0, min(delay, self.retry.total_s - elapsed))
            attempt += 1
            self.retried += 1
            await asyncio.sleep(delay)


def _too_large(where: str) -> BadAnswer:
    return BadAnswer(f"server {where}: bad answer: larger than {MAX_ANSWER_BYTES >> 20} MiB")


def _json(body: bytes, where: str) -> Any:
    """The answer's JSON. Too deep a nesting (RecursionError) or an integer of thousands of digits
    (ValueError) is a bad answer like any other text that is not JSON."""
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise BadAnswer(f"server {where}: bad answer: not JSON (or nested too deeply)") from None


def _message(body: bytes) -> str:
    try:
        d = json.loads(body)
    except (ValueError, RecursionError):
        return body[:400].decode("utf-8", "replace")
    if isinstance(d, dict):
        e = d.get("error", d)
        if isinstance(e, dict):
            e = e.get("message") or e.get("detail") or e
        d = e
    text = d if isinstance(d, str) else json.dumps(d)[:400] if _shallow(d) else type(d).__name__
    return text[:400]


def _shallow(d: Any, depth: int = 0) -> bool:
    """Whether `d` nests at most a few levels (json.dumps of a deep structure recurses)."""
    if depth > 8:
        return False
    if isinstance(d, dict):
        return all(_shallow(v, depth + 1) for v in list(d.values())[:50])
    if isinstance(d, list):
        return all(_shallow(v, depth + 1) for v in d[:50])
    return True


def get_json_sync(
    base_url: str, path: str, api_key: str | None, timeout_s: float, retry: RetryPolicy, ok_404: bool = False
) -> Any:
    async def go():
        async with Http(base_url, api_key, timeout_s, retry, 2) as h:
            return await h.request("GET", path, ok_404=ok_404)

    return asyncio.run(go())
