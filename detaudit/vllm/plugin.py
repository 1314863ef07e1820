"""detaudit's vLLM plugin (entry point group `vllm.general_plugins`; vLLM loads it in every process).

It does nothing unless detaudit asks for it through `DETAUDIT_VLLM_BACKEND` (set by `--engine vllm`
for the `bio` and `bio+tbik` backends). Then, before the model is built:

- `bio`: unquantized linear layers and the lm_head compute through detaudit's batch-invariant matmul
  (vLLM's CPU GEMM dispatch, which would pick oneDNN / SGL kernels and drop the bf16 weight, is
  skipped), RMSNorm (with its fused residual add) through detaudit's row-local RMSNorm, and the
  sampler's log-softmax through detaudit's. On a GPU where vLLM's own `VLLM_BATCH_INVARIANT=1` is on,
  vLLM's kernels are used instead and the marker says so. (On CPU vLLM's own mode has no kernels.)
  `RowParallelLinear` (vLLM's out-of-tree layer registration) computes an fp32 partial and combines
  the ranks with an all-gather and a rank-order sum over vLLM's TP group (with vLLM's own CPU
  all-reduce, bio outputs differed between batch sizes at TP 4).
- `bio+tbik`: the same layer does the tree matmul + tree all-reduce instead.

Every process it patches writes `DETAUDIT_VLLM_MARKER_DIR/<pid>.json`, updated the first time each
patched op runs (with the TP rank), so a run can prove the plugin was active in every worker.
"""

from __future__ import annotations

import json
import os
import threading

from detaudit.vllm.host import BACKEND_ENV, MARKER_ENV


class Marker:
    def __init__(self, backend: str, mode: str) -> None:
        self.path = os.path.join(os.environ.get(MARKER_ENV, ""), f"{os.getpid()}.json")
        self.data: dict = {"pid": os.getpid(), "backend": backend, "mode": mode, "tp_rank": None, "ops": []}
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

    def _write(self) -> None:
        if not os.environ.get(MARKER_ENV):
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f)
        os.replace(tmp, self.path)


def register() -> None:
    backend_name = os.environ.get(BACKEND_ENV, "")
    if backend_name in ("", "bf16"):
        return  # not asked: vLLM runs untouched
    from detaudit.vllm import patches

    patches.install(backend_name, Marker)
