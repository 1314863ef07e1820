"""The async HTTP layer of the server client: bounded retries with exponential backoff on 429 / 503 /
502 and dropped connections, a per-request timeout, and one-line errors (`DetauditError`) that name
the server by its credential-free URL and never carry the API key."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from detaudit.errors import DetauditError
from detaudit.server.urls import is_loopback, public_url

RETRY_STATUS = (429, 502, 503)


@dataclass(frozen=True)
class RetryPolicy:
    retries: int = 6  # attempts after the first
    base_s: float = 0.5  # first backoff; doubles per attempt (with jitter), capped at max_backoff_s
    max_backoff_s: float = 8.0
    total_s: float = 120.0  # no retry starts after this many seconds since the first attempt


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

    def scrub(self, text: str) -> str:
        text = str(text).replace(self.base_url, self.public)
        if self._secret:
            text = text.replace(self._secret, "***")
        return text.splitlines()[0][:300] if text else ""

    async def request(self, method: str, path: str, body: dict | None = None, *, ok_404: bool = False) -> Any:
        """JSON of a 2xx answer (None for a 404 when `ok_404`); retried on overload and dropped
        connections within the policy's bounds; everything else is a one-line DetauditError."""
        start = time.monotonic()
        attempt = 0
        where = f"{self.public}{path}"
        while True:
            reason = ""
            try:
                r = await self.client.request(method, path, json=body)
            except httpx.TimeoutException:
                raise DetauditError(
                    f"server {where}: no response within {self.timeout_s:g} s (server hung or "
                    "overloaded; raise --request-timeout)"
                ) from None
            except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as e:
                reason = f"{type(e).__name__}: {self.scrub(str(e)) or 'connection failed'}"
                r = None
            if r is not None:
                if r.status_code in RETRY_STATUS:
                    reason = f"HTTP {r.status_code}"
                elif r.status_code == 404 and ok_404:
                    return None
                elif r.status_code in (401, 403):
                    raise DetauditError(
                        f"server {where}: HTTP {r.status_code} (not authorized; set the API key in the "
                        "environment variable named by --api-key-env)"
                    )
                elif r.status_code >= 400:
                    raise DetauditError(f"server {where}: HTTP {r.status_code}: {self.scrub(_message(r))}")
                else:
                    try:
                        return r.json()
                    except ValueError:
                        raise DetauditError(f"server {where}: answer is not JSON") from None
            elapsed = time.monotonic() - start
            if attempt >= self.retry.retries or elapsed >= self.retry.total_s:
                if r is None:
                    raise DetauditError(
                        f"cannot reach server {where} ({reason}; {attempt + 1} attempt(s) in {elapsed:.0f} s)"
                    )
                raise DetauditError(f"server {where}: still {reason} after {attempt + 1} attempt(s) in {elapsed:.0f} s")
            delay = min(self.retry.max_backoff_s, self.retry.base_s * 2**attempt) * (0.5 + random.random() / 2)
            retry_after = r.headers.get("retry-after") if r is not None else None
            if retry_after and retry_after.replace(".", "", 1).isdigit():
                delay = min(self.retry.max_backoff_s, float(retry_after))
            delay = max(0.0, min(delay, self.retry.total_s - elapsed))
            attempt += 1
            self.retried += 1
            await asyncio.sleep(delay)


def _message(r: httpx.Response) -> str:
    try:
        d = r.json()
    except ValueError:
        return r.text[:200]
    if isinstance(d, dict):
        e = d.get("error", d)
        if isinstance(e, dict):
            return str(e.get("message") or e.get("detail") or e)[:200]
        return str(e)[:200]
    return str(d)[:200]


def get_json_sync(
    base_url: str, path: str, api_key: str | None, timeout_s: float, retry: RetryPolicy, ok_404: bool = False
) -> Any:
    async def go():
        async with Http(base_url, api_key, timeout_s, retry, 2) as h:
            return await h.request("GET", path, ok_404=ok_404)

    return asyncio.run(go())
