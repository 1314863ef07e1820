"""detaudit's vLLM plugin (entry point group `vllm.general_plugins`; vLLM loads it in every process).

It does nothing unless detaudit asks for it through `DETAUDIT_VLLM_BACKEND` (set by `--engine vllm` and
`--engine vllm-server` for every backend). Then, before the model is built:

- `bf16` / `vllm-bi` (vLLM's own kernels; `vllm-bi` is vLLM's batch-invariant mode, VLLM_BATCH_INVARIANT=1):
  nothing is patched; the plugin checks that VLLM_BATCH_INVARIANT is what the backend says (0 / 1) and
  records which attention backend vLLM selects.
- `bio`: unquantized linear layers and the lm_head compute through detaudit's batch-invariant matmul (vLLM's
  CPU GEMM dispatch, which would pick oneDNN / SGL kernels and drop the bf16 weight, is skipped), RMSNorm
  (with its fused residual add) through detaudit's row-local RMSNorm, the sampler's log-softmax and its
  top-k / top-p filter through detaudit's (`backends.sampling`), rotary and SiLU-and-mul through the
  built-in engine's functions (`token_ops`), attention through the backend's fixed-split attention (CPU:
  `cpu_ops`; CUDA: the `CUSTOM` attention backend of `gpu_attn`). `RowParallelLinear` (vLLM's out-of-tree
  layer registration) computes an fp32 partial and combines the ranks with the backend's fixed-order
  all-reduce over vLLM's TP group (with vLLM's own CPU all-reduce, bio outputs differed between batch sizes
  at TP 4). VLLM_BATCH_INVARIANT=1 is refused here: it would swap vLLM's own kernels into these layers (that
  mode is the backend `vllm-bi`).
- `bio+tbik`: the same, and the row-parallel layer does the tree matmul + tree all-reduce instead.

Every process it runs in writes `DETAUDIT_VLLM_MARKER_DIR/<pid>.json`, updated the first time each
patched op runs (with the TP rank) and with what it observed (the attention backend vLLM chose,
VLLM_BATCH_INVARIANT), so a run can prove the plugin was active in every worker.
"""

from __future__ import annotations

import json
import os
import threading

from detaudit.vllm.host import BACKEND_ENV, MARKER_ENV


class Marker:
    def __init__(self, backend: str, mode: str) -> None:
        self.path = os.path.join(os.environ.get(MARKER_ENV, ""), f"{os.getpid()}.json")
        self.data: dict = {"pid": os.getpid(), "backend": backend, "mode": mode, "tp_rank": None, "ops": [], "seen": {}}
        self._lock = threading.Lock()
        self._write()

    def op(self, name: str, tp_rank: int | None = None) -> None:
        if name in self.data["ops"]:
            return
        with self._lock:
            self.data["ops"] = sorted({*self.data["ops"], name})
            if tp_rank is not None:
                self.data["tp_rank"] = tp_rank
            self._write()

    def note(self, key: str, value) -> None:
        """Record something observed in this process (the attention backend vLLM chose, ...)."""
        if self.data["seen"].get(key) == value:
            return
        with self._lock:
            self.data["seen"] = {**self.data["seen"], key: value}
            self._write()

    def _write(self) -> None:
        if not os.environ.get(MARKER_ENV):
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def register() -> None:
    backend_name = os.environ.get(BACKEND_ENV, "")
    if not backend_name:
        return  # not asked: vLLM runs untouched
    from detaudit.vllm import patches

    patches.install(backend_name, Marker)
