"""What the sweep asks of a server engine: its `EngineOptions.extra` and the run identity."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from detaudit.server.client import ServerOptions, probe
from detaudit.server.urls import public_url


def engine_extra(
    server: dict, model_arg: str, model, tokenizer, texts: dict[str, str], log_dir: Path, max_background: int
) -> dict[str, Any]:
    """The server options of the sweep plus what the client needs from --model (tokenizer path, names
    to match the server's model id against, vocabulary size, chat prompt texts by prompt hash)."""
    extra = {k: v for k, v in server.items() if v is not None}
    extra.update(
        model_candidates=(model_arg, model.name, str(model.path)),
        model_path=str(model.path),
        vocab_size=len(tokenizer),
        prompt_texts=texts,
        log_dir=str(log_dir),
        max_background=max_background,
    )
    ServerOptions.from_extra(extra)  # bad options fail before anything starts
    return extra


def openai_identity(o) -> dict[str, Any]:
    """A running server's identity replaces the local checksum: its model id and URL."""
    info = probe(ServerOptions.from_extra(o.extra))
    return {"server_model": info.model, "server": public_url(info.base_url), "server_version": info.version}


def check_config(cfg) -> None:
    """Server sweeps: one URL per run for `openai` (its backend and TP are labels of that deployment),
    none for `vllm-server` (detaudit picks a free port on 127.0.0.1)."""
    from detaudit.errors import DetauditError

    base = cfg.server.get("base_url")
    if cfg.engine == "openai":
        if not base:
            raise DetauditError("--engine openai needs --base-url (e.g. http://127.0.0.1:8000/v1)")
        from detaudit.server.urls import check_base_url

        check_base_url(base)
        if len(cfg.backends) != 1 or len(cfg.tp) != 1:
            raise DetauditError(
                "--engine openai audits one deployment: give one --backends label (e.g. bf16) and one --tp"
            )
    elif base:
        raise DetauditError(f"--base-url applies to --engine openai (--engine {cfg.engine} starts its own server)")
