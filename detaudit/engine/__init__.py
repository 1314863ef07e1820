"""The built-in engine: Llama / Qwen3 decoders whose every reduction goes through a Backend.

`open_engine` returns an object with `generate(prompts, prompt_ids, decoding, batch_size, progress)`,
`score(prompts, continuations, batch_size)`, `describe()` and `close()`: in-process for TP 1 and
emulated TP, a pool of worker processes for real TP > 1.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def open_engine(
    model_path: Path,
    backend: str,
    tp: int,
    tp_mode: str = "real",
    *,
    dtype: str = "bfloat16",
    device: str = "cpu",
    eos_ids: Sequence[int] = (),
    hang_timeout: float = 300.0,
    engine: str = "builtin",
    max_batch_size: int = 0,
    cuda_graphs: bool = True,
):
    if engine == "vllm":
        from detaudit.engine.worker import DistEngine
        from detaudit.vllm.host import engine_env, marker_dir

        mdir = marker_dir()
        host = {"engine": "vllm", "env": engine_env(backend, tp, device, mdir), "log": f"{mdir}/vllm.log",
                "max_batch_size": max_batch_size}
        return DistEngine(model_path, backend, tp, dtype=dtype, device=device, eos_ids=eos_ids,
                          hang_timeout=hang_timeout, host=host)
    if tp == 1 or tp_mode == "emulated":
        from detaudit.engine.local import LocalEngine

        return LocalEngine(model_path, backend, tp, emulated=tp > 1, dtype=dtype, device=device, eos_ids=eos_ids,
                           cuda_graphs=cuda_graphs)
    from detaudit.engine.worker import DistEngine

    return DistEngine(model_path, backend, tp, dtype=dtype, device=device, eos_ids=eos_ids, hang_timeout=hang_timeout)
