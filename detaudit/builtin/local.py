"""The in-process engine: TP 1, emulated TP, or one rank of real TP."""

from __future__ import annotations

import gc
import os
from typing import Sequence

import torch

from detaudit.backends import get_backend
from detaudit.backends.base import ProcessGroup, TPContext
from detaudit.builtin import profiling
from detaudit.builtin.generate import Generator
from detaudit.builtin.model import Decoder
from detaudit.config import DecodingParams, EngineOptions, Speculative
from detaudit.runs.records import Generation, ProgressFn


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


class _Detokenizer:
    """Token ids -> text with the model's tokenizer, loaded on first use (only a suite with stop strings
    needs it): every rank decodes the same tokens the same way, so real-TP ranks stop rows together."""

    def __init__(self, path) -> None:
        self.path = path
        self.tokenizer = None

    def __call__(self, ids: list[int]) -> str:
        if self.tokenizer is None:
            from detaudit.models import tokenizer_for

            self.tokenizer = tokenizer_for(self.path)
        return self.tokenizer.decode(ids, skip_special_tokens=False)


class LocalEngine:
    """The built-in engine in this process: TP 1, emulated TP (every rank's shards here), or one rank of
    real TP (`group`: its process group; `device`: its GPU)."""

    def __init__(
        self,
        options: EngineOptions,
        *,
        rank: int = 0,
        group: ProcessGroup | None = None,
        device: str | None = None,
        threads: int | None = None,
    ) -> None:
        s = options.settings
        self.threads = threads or cpu_cores()
        if not s.cuda:
            torch.set_num_threads(self.threads)
        self.backend = get_backend(options.backend)
        self.tp, self.emulated, self.rank = options.tp, options.emulated, rank
        self.device = torch.device(device or s.device)
        self.ctx = TPContext(self.backend, options.tp, rank, self.emulated, group, getattr(torch, s.dtype))
        with self.backend.activate():
            self.model = Decoder(options.model, self.ctx, self.device)
        # decode from CUDA graphs on a GPU: TP 1, emulated TP, and every rank of real TP (the all-reduce is
        # captured into each rank's graph)
        self.cuda_graphs = s.cuda_graphs and self.device.type == "cuda"
        # (a TP-1 rank in a process group, DETAUDIT_TP1_GROUP, all-reduces, and Triton's row kernels on CPU
        # tensors run in its interpreter, which a recording does not see: eager)
        replayable = group is None and self.model.ops.REPLAYABLE
        self.cpu_replay = replayable and self.backend.replays_decode(self.device, options.tp, self.model.routes)
        self.generator = Generator(
            self.model,
            options.eos_ids,
            cuda_graphs=self.cuda_graphs,
            decode=_Detokenizer(options.model.path),
            cpu_replay=self.cpu_replay,
        )
        self.last_timings: dict = {}  # summed over the chunks of the last generate call
        self.last_score_routing: list | None = None
        self.last_profile: dict | None = None  # of the last generate call made with profile=True

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        prompt_ids: Sequence[str],
        decoding: DecodingParams,
        batch_size: int,
        progress: ProgressFn | None = None,
        profile: bool = False,
        speculative: Speculative | None = None,
        **load,
    ) -> list[Generation]:
        """`load` (a server engine's background load and prompt texts) means nothing here. `profile`: the
        call runs under torch.profiler and `last_profile` holds its self time per op (`profiling`).
        `speculative`: decode with drafts verified by the target (`generate.Generator._speculate`)."""
        if profile:
            generations, self.last_profile = profiling.self_times(
                lambda: self.generate(prompts, prompt_ids, decoding, batch_size, progress, speculative=speculative),
                self.device.type == "cuda",
            )
            return generations
        out: list[Generation] = []
        totals: dict = {}
        with self.backend.activate():
            for r in chunks(len(prompts), batch_size):
                out += self.generator.generate(
                    [prompts[i] for i in r], [prompt_ids[i] for i in r], decoding, progress, speculative
                )
                for key, value in self.generator.timings.items():
                    totals[key] = value if isinstance(value, bool) else totals.get(key, 0) + value
        self.last_timings = totals
        return out

    def score(
        self,
        prompts: Sequence[Sequence[int]],
        continuations: Sequence[Sequence[int]],
        batch_size: int,
        forced_routing: Sequence | None = None,
    ) -> list[list[float]]:
        """Teacher-forced log-probabilities; an MoE model's routing of the same positions is kept in
        `last_score_routing` (per sequence: (experts, gates, margins) per position, as Generation's).
        `forced_routing`: routing replay (per sequence, per position, the expert ids to use)."""
        out: list[list[float]] = []
        routes: list = []
        with self.backend.activate():
            for r in chunks(len(prompts), batch_size):
                forced = [forced_routing[i] for i in r] if forced_routing is not None else None
                lps, rts = self.generator.score([prompts[i] for i in r], [continuations[i] for i in r], forced)
                out += lps
                routes += rts or []
        self.last_score_routing = routes if self.model.routes else None
        return out

    def describe(self) -> dict:
        return {
            "engine": "builtin",
            "ops": type(self.model.ops).__name__,
            "tp": self.tp,
            "tp_mode": "emulated" if self.emulated else "real",
            "threads_per_rank": self.threads if self.device.type == "cpu" else None,
            "cuda_graphs": self.cuda_graphs,
            "cpu_replay": self.cpu_replay,
            "routing": self.model.routes,
            "device": str(self.device),
            "backend": self.backend.describe(),
        }

    def close(self) -> None:
        """Free the model now: on a GPU the next group's engine needs its memory (a reference cycle
        would keep the weights until the next collection)."""
        if self.device.type == "cuda":
            gc.unfreeze()  # (generate froze what was alive for its decode loop: `generate.settle_gc`)
        self.generator = self.model = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
