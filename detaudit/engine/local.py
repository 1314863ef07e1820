"""The in-process engine: TP 1, emulated TP, or one rank of real TP."""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Sequence

import torch

from detaudit.backends import get_backend
from detaudit.backends.base import Group
from detaudit.config import DecodingParams
from detaudit.engine.generate import Generator
from detaudit.engine.layers import TPContext
from detaudit.engine.model import Decoder
from detaudit.records import Generation, ProgressFn

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def cpu_core_ids() -> list[int]:
    """The cores this process may run on, sorted."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def cpu_cores() -> int:
    return len(cpu_core_ids())


def chunks(n: int, size: int) -> list[range]:
    return [range(i, min(i + size, n)) for i in range(0, n, size)]


class LocalEngine:
    def __init__(
        self,
        model_path: Path,
        backend: str,
        tp: int = 1,
        *,
        emulated: bool = False,
        rank: int = 0,
        group: Group | None = None,
        dtype: str = "bfloat16",
        device: str = "cpu",
        eos_ids: Sequence[int] = (),
        threads: int | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        self.threads = threads or cpu_cores()
        if not device.startswith("cuda"):
            torch.set_num_threads(self.threads)
        self.backend = get_backend(backend)
        self.tp, self.emulated, self.rank = tp, emulated, rank
        self.device = torch.device(device)
        self.ctx = TPContext(self.backend, tp, rank, emulated, group, DTYPES[dtype])
        with self.backend.activate():
            self.model = Decoder(Path(model_path), self.ctx, self.device)
        # decode from CUDA graphs on a GPU: TP 1, emulated TP, and every rank of real TP (the all-reduce,
        # NCCL's all-gather for bio / bio+tbik, is captured into each rank's graph)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self.generator = Generator(self.model, eos_ids, cuda_graphs=self.cuda_graphs)
        self.last_timings: dict = {}  # summed over the chunks of the last generate call

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_ids: Sequence[str],
        decoding: DecodingParams,
        batch_size: int,
        progress: ProgressFn | None = None,
    ) -> list[Generation]:
        out: list[Generation] = []
        totals: dict = {}
        with self.backend.activate():
            for r in chunks(len(prompts), batch_size):
                out += self.generator.generate([prompts[i] for i in r], [prompt_ids[i] for i in r], decoding, progress)
                for key, value in self.generator.timings.items():
                    totals[key] = value if isinstance(value, bool) else totals.get(key, 0) + value
        self.last_timings = totals
        return out

    def score(
        self, prompts: Sequence[Sequence[int]], continuations: Sequence[Sequence[int]], batch_size: int
    ) -> list[list[float]]:
        out: list[list[float]] = []
        with self.backend.activate():
            for r in chunks(len(prompts), batch_size):
                out += self.generator.score([prompts[i] for i in r], [continuations[i] for i in r])
        return out

    def describe(self) -> dict:
        return {
            "engine": "builtin",
            "tp": self.tp,
            "tp_mode": "emulated" if self.emulated else "real",
            "threads_per_rank": self.threads if self.device.type == "cpu" else None,
            "cuda_graphs": self.cuda_graphs,
            "device": str(self.device),
            "backend": self.backend.describe(),
        }

    def close(self) -> None:
        if self.device.type == "cuda":
            gc.unfreeze()  # (generate froze what was alive for its decode loop: `generate.settle_gc`)
