"""`detaudit bench vllm`: vLLM's throughput with each backend in one run, side by side, per TP size:
`bf16` (vLLM's own kernels), `vllm-bi` (vLLM's own batch-invariant mode, CUDA), `bio` and `bio+tbik`
(detaudit's plugin), on two workloads that stress different kernels:

- `prefill`: a batch of long random prompts, one new token each (the time is the prefill's): prompt
  tokens per second;
- `decode`: a batch of short random prompts, many new tokens each (eos ignored: exactly that many):
  generated tokens per second.

One engine per (TP, backend) serves both workloads (engine start-up is reported apart, never timed);
each workload's time is the best of `repeats` calls after a warm-up call. `vs_bf16` is the ratio to
bf16's tokens/s at the same TP size and workload in the same run. With `cuda_graphs` (on CUDA) every
backend decodes from CUDA graphs: vLLM's compiled ones for bf16 / vllm-bi, whole-step graphs without
compilation for the plugin's (`vllm.host.engine_mode`); each row records its `cudagraph_mode`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from pathlib import Path
from typing import Sequence

import pandas as pd

from detaudit import omp_wait
from detaudit.config import DecodingParams, EngineOptions, EngineSettings, ModelRef

WORKLOADS = ("prefill", "decode")
DECODE_PROMPT_TOKENS = 32  # the decode workload's prompts: short, so the generated tokens dominate


def workload_prompts(workload: str, batch: int, prompt_tokens: int, vocab: int) -> list[list[int]]:
    from detaudit.bench.e2e import random_prompts

    length = prompt_tokens if workload == "prefill" else DECODE_PROMPT_TOKENS
    return random_prompts(batch, length, vocab, seed=1 if workload == "prefill" else 2)


def bench_vllm(
    model: ModelRef,
    *,
    backends: Sequence[str],
    tps: Sequence[int],
    vocab: int,
    batch_size: int = 16,
    prompt_tokens: int = 1024,
    new_tokens: int = 128,
    workloads: Sequence[str] = WORKLOADS,
    dtype: str = "bfloat16",
    device: str = "cpu",
    cuda_graphs: bool = False,
    repeats: int = 2,
    progress=None,
    profile: int = 0,
    profile_rows: list[dict] | None = None,
) -> pd.DataFrame:
    import tempfile

    from detaudit.bench.e2e import top_ops
    from detaudit.engines import open_engine

    ids = [str(i) for i in range(batch_size)]
    plans = {
        w: (
            workload_prompts(w, batch_size, prompt_tokens, vocab),
            DecodingParams(greedy=True, max_new_tokens=1 if w == "prefill" else new_tokens),
        )
        for w in workloads
    }
    warm = DecodingParams(greedy=True, max_new_tokens=2)
    rows = []
    for tp in tps:
        for backend in backends:
            t0 = time.perf_counter()
            settings = EngineSettings(name="vllm", dtype=dtype, device=device, cuda_graphs=cuda_graphs)
            options = EngineOptions(settings, model, backend, tp, max_batch_size=batch_size)
            with contextlib.ExitStack() as stack:
                if profile:  # vLLM's workers write their traces here; removed with the engine
                    traces = stack.enter_context(tempfile.TemporaryDirectory(prefix="detaudit-vllm-trace-"))
                    options = dataclasses.replace(options, trace_dir=Path(traces))
                eng = open_engine(options)
                stack.callback(eng.close)
                first = next(iter(plans.values()))[0]
                eng.generate(first, ids, warm, batch_size)  # vLLM builds its engine on the first call
                start_s = time.perf_counter() - t0
                described = eng.describe()
                for w, (prompts, decoding) in plans.items():
                    eng.generate(prompts, ids, warm, batch_size)  # this workload's shapes once, untimed
                    best, gens = float("inf"), []
                    for _ in range(repeats):
                        t = time.perf_counter()
                        gens = eng.generate(prompts, ids, decoding, batch_size)
                        best = min(best, time.perf_counter() - t)
                    generated = sum(len(g.token_ids) for g in gens)
                    tokens = sum(len(p) for p in prompts) if w == "prefill" else generated
                    rows.append(
                        {
                            "tp": tp,
                            "workload": w,
                            "backend": backend,
                            "batch": batch_size,
                            "prompt_tokens": len(prompts[0]),
                            "new_tokens": decoding.max_new_tokens,
                            "tokens": tokens,
                            "seconds": round(best, 4),
                            "tokens_per_s": tokens / best,
                            "engine_start_s": round(start_s, 1),
                            "attention": described.get("attention_backend", ""),
                            "eager": (described.get("knobs") or {}).get("enforce_eager"),
                            "cudagraph_mode": (described.get("knobs") or {}).get("cudagraph_mode", ""),
                        }
                    )
                    if profile and profile_rows is not None:
                        eng.generate(prompts, ids, decoding, batch_size, profile=True)
                        key = {"tp": tp, "backend": backend, "phase": w}
                        profile_rows += [{**key, **r} for r in top_ops(eng.last_profile or {}, profile)]
            if progress:
                progress(f"TP {tp} {backend}")
    df = pd.DataFrame(rows)
    if "bf16" in backends and len(df):
        base = df[df.backend == "bf16"].set_index(["tp", "workload"])["tokens_per_s"]
        df["vs_bf16"] = [r.tokens_per_s / base[(r.tp, r.workload)] for r in df.itertuples()]
    df = df.sort_values(["workload", "tp"], kind="stable").reset_index(drop=True) if len(df) else df
    df.attrs.update(
        batch_size=batch_size,
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        dtype=dtype,
        device=device,
        cuda_graphs=cuda_graphs,
        repeats=repeats,
    )
    if device == "cpu":  # vLLM's CPU processes inherit the command line's OpenMP wait (`omp_wait`)
        df.attrs["omp_wait"] = omp_wait.describe()
    return df
