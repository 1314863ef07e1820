"""Base URLs: checked, and written anywhere (manifest, errors) only without credentials or query; and
`redact`, the one cleaning of every server-provided string before it is shown or recorded."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

from detaudit.errors import DetauditError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def check_base_url(url: str) -> str:
    """The base URL as requests use it (trailing slash removed); bad input is one line."""
    try:
        parts = urlsplit(url or "")
    except ValueError:
        raise DetauditError("--base-url is not a URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise DetauditError(f"--base-url {public_url(url)!r}: expected http(s)://HOST[:PORT]/v1")
    if parts.username or parts.password or parts.query or parts.fragment:
        raise DetauditError(
            f"--base-url {public_url(url)!r}: no credentials, query or fragment in the URL (it is "
            "recorded; put the API key in an environment variable named by --api-key-env)"
        )
    return url.rstrip("/")


def public_url(url: str) -> str:
    """scheme://host[:port]/path, without user info, query or fragment."""
    try:
        p = urlsplit(url or "")
        host = p.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = host + (f":{p.port}" if p.port else "")
    except ValueError:
        return "<unparsable URL>"
    return urlunsplit((p.scheme, netloc, p.path.rstrip("/"), "", ""))


def is_loopback(url: str) -> bool:
    try:
        return (urlsplit(url).hostname or "") in LOOPBACK
    except ValueError:
        return False


def server_root(base_url: str) -> str:
    """The server's root (for /version, /health): the base URL without a trailing /v1."""
    u = base_url.rstrip("/")
    return u[: -len("/v1")] if u.endswith("/v1") else u


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")


def redact(text: object, secret: str | None, limit: int = 300, base_url: str | None = None) -> str:
    """A server-provided string as detaudit shows or records it: the API key replaced by `***` (a server
    may echo the Authorization header anywhere: /version, model ids, error messages), the base URL by
    its public form, control characters and line breaks folded to one space, at most `limit` characters.
    The key is removed before the cut, so no prefix of it survives."""
    s = str(text)
    if base_url:
        s = s.replace(base_url, public_url(base_url))
    if secret:
        s = s.replace(secret, "***")
    s = _CONTROL.sub(" ", s).strip()
    return s if len(s) <= limit else s[: max(0, limit - 3)] + "..."
