"""What the sweep asks of a server engine through its registry entry: the checks of its options and
the run identity."""

from __future__ import annotations

from typing import Any

from detaudit.config import EngineOptions, SweepConfig
from detaudit.errors import DetauditError
from detaudit.server.client import ServerOptions, probe
from detaudit.server.urls import check_base_url, public_url, read_api_key


def openai_identity(o: EngineOptions) -> dict[str, Any]:
    """A running server's identity replaces the local checksum: its model id and URL."""
    info = probe(ServerOptions.of(o))
    return {"server_model": info.shown_model, "server": public_url(info.base_url), "server_version": info.version}


def check_openai(cfg: SweepConfig) -> None:
    """`--engine openai` audits one running deployment, at one URL: its backend and TP are labels."""
    base = cfg.engine.server.base_url if cfg.engine.server else None
    if not base:
        raise DetauditError("--engine openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
    check_base_url(base)
    read_api_key(cfg.engine.server.api_key_env)  # a key no HTTP header can carry: refused before any work
    if len(cfg.backends) != 1 or len(cfg.tp) != 1:
        raise DetauditError("--engine openai audits one deployment: give one --backends label (e.g. bf16) and one --tp")


def check_started_server(cfg: SweepConfig) -> None:
    """`--engine vllm-server` starts its own server on a free port of 127.0.0.1: no URL to give."""
    if cfg.engine.server and cfg.engine.server.base_url:
        raise DetauditError(f"--base-url applies to --engine openai (--engine {cfg.engine.name} starts its own server)")
    if cfg.engine.server and cfg.engine.server.api_key_env:
        raise DetauditError(
            f"--api-key-env applies to --engine openai (--engine {cfg.engine.name} starts its own server, "
            "without a key)"
        )
