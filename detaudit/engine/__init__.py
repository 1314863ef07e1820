"""The built-in engine: decoders whose every reduction goes through a Backend.

`open_engine` returns an object with `generate(prompts, prompt_ids, decoding, batch_size, progress)`,
`score(prompts, continuations, batch_size)`, `describe()` and `close()` (the `detaudit.engines.Engine`
protocol): in-process for TP 1 and emulated TP, a pool of worker processes for real TP > 1.
This package never imports `detaudit.vllm` or `detaudit.server`.
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
    cuda_graphs: bool = True,
):
    if (tp == 1 and not tp1_group()) or tp_mode == "emulated":
        from detaudit.engine.local import LocalEngine

        return LocalEngine(
            model_path,
            backend,
            tp,
            emulated=tp > 1,
            dtype=dtype,
            device=device,
            eos_ids=eos_ids,
            cuda_graphs=cuda_graphs,
        )
    from detaudit.engine.worker import DistEngine

    return DistEngine(
        model_path,
        backend,
        tp,
        dtype=dtype,
        device=device,
        eos_ids=eos_ids,
        hang_timeout=hang_timeout,
        cuda_graphs=cuda_graphs,
    )


TP1_GROUP_ENV = "DETAUDIT_TP1_GROUP"


def tp1_group() -> bool:
    """`DETAUDIT_TP1_GROUP=1`: real TP 1 runs as TP > 1 does, one worker process in a process group of
    size 1 (NCCL on GPU, gloo on CPU) whose all-reduce runs (and is captured into the CUDA graph), instead
    of in process without a group. Same bits; used by tests and benchmarks of the real-TP path on one GPU."""
    import os

    return os.environ.get(TP1_GROUP_ENV, "") not in ("", "0")
