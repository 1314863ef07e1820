"""Base URLs: checked, and written anywhere (manifest, errors) only without credentials or query; the
API key: read and checked (`read_api_key`); and `redact`, the one cleaning of every server-provided string
before it is shown or recorded."""

from __future__ import annotations

import os
import re
import unicodedata
from urllib.parse import urlsplit, urlunsplit

from detaudit.errors import DetauditError

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


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
    try:
        port = parts.port
    except ValueError:  # past 65535 (or not a number): the socket layer would raise OverflowError
        port = 0
    if port == 0 and parts.netloc.rsplit("]", 1)[-1].count(":"):
        raise DetauditError(f"--base-url {_shown_url(url)}: the port must be a number from 1 to 65535")
    if _CONTROL.search(url) or " " in url:
        raise DetauditError(f"--base-url {_shown_url(url)}: a URL holds no spaces or control characters")
    return url.rstrip("/")


def _shown_url(url: str) -> str:
    """The URL as an error shows it: no user info (a password), control characters replaced."""
    return repr(_CONTROL.sub("?", re.sub(r"//[^/@]*@", "//", url))[:80])


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
        return (urlsplit(url).hostname or "") in LOOPBACK_HOSTS
    except ValueError:
        return False


def server_root(base_url: str) -> str:
    """The server's root (for /version, /health): the base URL without a trailing /v1."""
    u = base_url.rstrip("/")
    return u[: -len("/v1")] if u.endswith("/v1") else u


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]+")
MAX_KEY_CHARS = 4096
SECRET_PART = 8  # the shortest piece of the key `redact` removes wherever it appears
REDACT_SCAN = 1 << 16  # characters of a server string read (what is kept is cut far shorter)


def read_api_key(env_name: str | None) -> str | None:
    """The API key in the environment variable `env_name` (None without one). It goes into an HTTP
    header, so only printable ASCII without spaces is taken: a trailing newline (a key read from a file)
    or a non-ASCII character is refused here, by the variable's name, never shown (the HTTP library's
    own error would print the header, key included)."""
    if not env_name:
        return None
    key = os.environ.get(env_name)
    if not key:
        raise DetauditError(f"--api-key-env {env_name}: that environment variable is not set")
    if len(key) > MAX_KEY_CHARS:
        raise DetauditError(f"--api-key-env {env_name}: the key is longer than {MAX_KEY_CHARS} characters")
    if not all("!" <= ch <= "~" for ch in key):
        what = (
            "whitespace at its start or end (a trailing newline from a file or `echo`?)"
            if key != key.strip()
            else "a space or control character"
            if key.isascii()
            else "a non-ASCII character"
        )
        raise DetauditError(
            f"--api-key-env {env_name}: the key holds {what}; an API key is printable ASCII without spaces "
            "(the key is not shown)"
        )
    return key


def _hidden(ch: str) -> bool:
    """Characters a server could put between the key's characters without a reader noticing: control
    and format characters (zero-width, bidi), spaces and line breaks."""
    return unicodedata.category(ch) in ("Cc", "Cf", "Zs", "Zl", "Zp")


def redact_secret(text: str, secret: str | None) -> str:
    """`text` with every piece of `secret` of SECRET_PART characters or more replaced by `***`, wherever
    it appears: pieces are matched in the text's visible characters (control, format and space
    characters skipped), so a key split by a control character, cut to a prefix, or echoed in part is
    removed too. The secret's own characters are printable ASCII (`read_api_key`)."""
    if not secret or not text:
        return text
    n = min(SECRET_PART, len(secret))
    pieces = {secret[i : i + n] for i in range(len(secret) - n + 1)}
    where = [i for i, ch in enumerate(text) if not _hidden(ch)]  # visible characters' positions in text
    visible = "".join(text[i] for i in where)
    masked = [False] * len(text)
    for j in range(len(visible) - n + 1):
        if visible[j : j + n] in pieces:
            for i in range(where[j], where[j + n - 1] + 1):  # the hidden characters between them too
                masked[i] = True
    if not any(masked):
        return text
    out, i = [], 0
    while i < len(text):
        if masked[i]:
            while i < len(text) and masked[i]:
                i += 1
            out.append("***")
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


def redact(text: object, secret: str | None, limit: int = 300, base_url: str | None = None) -> str:
    """A server-provided string as detaudit shows or records it: every piece of the API key of 8
    characters or more replaced by `***` (a server may echo the Authorization header, or part of it,
    anywhere: /version, model ids, error messages), the base URL by its public form, control characters
    and line breaks folded to one space, format characters (zero-width, bidi) removed, at most `limit`
    characters. The key is removed before the cut, so no prefix of it survives."""
    s = str(text)
    long = len(s) > REDACT_SCAN
    s = s[:REDACT_SCAN]
    if base_url:
        s = s.replace(base_url, public_url(base_url))
    s = redact_secret(s, secret)
    s = "".join(ch for ch in s if unicodedata.category(ch) != "Cf")
    s = _CONTROL.sub(" ", s).strip()
    if long:  # the scan's end may have cut a piece of the key short: its last characters go too
        s = s[: -SECRET_PART - 1]
    return s if len(s) <= limit and not long else s[: max(0, limit - 3)] + "..."
