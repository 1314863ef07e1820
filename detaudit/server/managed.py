"""`--engine vllm-server`: one vLLM OpenAI server per (backend, TP) group, audited through
`OpenAIEngine`, stopped on close (and on every failure path: see `launch.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from detaudit.errors import DetauditError
from detaudit.server.client import OpenAIEngine, ServerOptions, probe
from detaudit.server.launch import VllmServer


class VllmServerEngine:
    engine_name = "vllm-server"

    def __init__(self, eo) -> None:
        o = ServerOptions.from_extra(eo.extra)
        log_dir = Path(eo.extra.get("log_dir") or ".")
        seqs = max(eo.max_batch_size, 1) + int(eo.extra.get("max_background", 0))
        self.server = VllmServer(
            eo.model_path,
            eo.backend,
            eo.tp,
            dtype=eo.dtype,
            device=eo.device,
            max_num_seqs=seqs,
            log_dir=log_dir,
            startup_timeout=float(eo.extra.get("startup_timeout", 600.0)),
        )
        try:
            o.base_url, o.api_key_env, o.server_model, o.server_kind = (
                self.server.base_url,
                None,
                str(eo.model_path),
                "vllm",
            )
            self.client = OpenAIEngine(o, probe(o))
            self.client.engine_name = self.engine_name
        except BaseException:
            self.server.stop()
            raise

    def _check(self, e: DetauditError) -> DetauditError:
        if not self.server.alive():
            return DetauditError(
                f"{e} (the vLLM server died: {self.server.last_log_line()}; log: {self.server.log_path})"
            )
        return DetauditError(f"{e} (vLLM log: {self.server.log_path})")

    def generate(self, *args, **kwargs):
        try:
            return self.client.generate(*args, **kwargs)
        except DetauditError as e:
            raise self._check(e) from None

    def score(self, *args, **kwargs):
        try:
            return self.client.score(*args, **kwargs)
        except DetauditError as e:
            raise self._check(e) from None

    def describe(self) -> dict[str, Any]:
        from detaudit.backends import get_backend
        from detaudit.vllm.host import read_markers

        d = self.client.describe()
        b = self.server.backend
        d.update(
            server_command=self.server.command_line(),
            server_env=self.server.env_added,
            server_startup_s=round(self.server.startup_s, 1),
            server_log=str(self.server.log_path),
            backend=({"backend": "bf16", "kernels": "vLLM's own"} if b == "bf16" else get_backend(b).describe()),
            plugin="off (native vLLM kernels)" if b == "bf16" else f"detaudit plugin: {b}",
            plugin_markers=read_markers(self.server.markers),
        )
        d["server"]["base_url"] = "detaudit-started (127.0.0.1, free port)"
        return d

    def close(self) -> None:
        self.server.stop()
