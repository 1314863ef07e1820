"""`--engine vllm-server`: one vLLM OpenAI server per (backend, TP) group, audited through
`OpenAIEngine`, stopped on close (and on every failure path: see `launch.py`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from detaudit.config import EngineOptions
from detaudit.errors import DetauditError
from detaudit.server.client import OpenAIEngine, ServerOptions, probe
from detaudit.server.launch import VllmServer


class VllmServerEngine:
    engine_name = "vllm-server"

    def __init__(self, eo: EngineOptions) -> None:
        s = eo.settings
        self.server = VllmServer(
            eo.model.path,
            eo.backend,
            eo.tp,
            dtype=s.dtype,
            device=s.device,
            max_num_seqs=max(eo.max_batch_size, 1) + eo.max_background,
            log_dir=eo.log_dir or Path("."),
            cuda_graphs=s.cuda_graphs,
        )
        self.checked = False
        try:
            o = ServerOptions.of(
                eo, base_url=self.server.base_url, api_key_env=None, server_model=str(eo.model.path), server_kind="vllm"
            )
            self.client = OpenAIEngine(o, probe(o))
            self.client.engine_name = self.engine_name
        except BaseException:
            self.server.stop()
            raise

    def _check(self, e: DetauditError) -> DetauditError:
        """The error with the server's log named; its class kept (a bad answer still fails only its cell)."""
        if not self.server.alive():
            return type(e)(f"{e} (the vLLM server died: {self.server.last_log_line()}; log: {self.server.log_path})")
        return type(e)(f"{e} (vLLM log: {self.server.log_path})")

    def generate(self, *args, **kwargs):
        try:
            out = self.client.generate(*args, **kwargs)
        except DetauditError as e:
            raise self._check(e) from None
        if not self.checked:  # once answers came: the plugin ran in the server's processes
            from detaudit.vllm.host import plugin_missing, read_markers

            why = plugin_missing(self.server.backend, read_markers(self.server.markers), ran=True)
            if why:
                raise DetauditError(f"{self.server.name}: {why}")
            self.checked = True
        return out

    def score(self, *args, **kwargs):
        try:
            return self.client.score(*args, **kwargs)
        except DetauditError as e:
            raise self._check(e) from None

    def describe(self) -> dict[str, Any]:
        from detaudit.vllm.host import attention_backends, backend_description, plugin_label, read_markers

        d = self.client.describe()
        b = self.server.backend
        markers = read_markers(self.server.markers)
        d.update(
            server_command=self.server.command_line(),
            server_env=self.server.env_added,
            server_startup_s=round(self.server.startup_s, 1),
            server_log=str(self.server.log_path),
            server_mode=self.server.mode,
            backend=backend_description(b, str(d.get("server", {}).get("version", ""))),
            plugin=plugin_label(b),
            attention_backend=attention_backends(markers),
            plugin_markers=markers,
        )
        d["server"]["base_url"] = "detaudit-started (127.0.0.1, free port)"
        return d

    def close(self) -> None:
        self.server.stop()
