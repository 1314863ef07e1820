"""`detaudit bench engine`: the built-in engine's decode throughput against transformers' `generate`
on the same prompts, batch size, dtype and thread count.

Each row's tokens per second is over a whole call (prefill and decode); `prefill_s` and
`decode_tokens_per_s` split it. For the built-in engine both come from the best call's own timings
(prompts -> first tokens, then the decode loop: every token after each row's first); for transformers
the prefill is the best of `repeats` one-token `generate` calls and the decode the rest of the best
full call. `*_vs_bf16` are ratios to detaudit's bf16 backend in the same run (higher: faster)."""

from __future__ import annotations

import time

import pandas as pd
import torch

from detaudit import omp_wait
from detaudit.backends.kernels.cpu_bf16 import choice
from detaudit.backends.kernels.cpu_calls import dispatcher
from detaudit.backends.kernels.fixed import describe_cpu
from detaudit.config import DecodingParams, EngineOptions, EngineSettings, ModelRef


def time_generate(
    engine, prompts: list[list[int]], ids: list[str], decoding: DecodingParams, batch_size: int, repeats: int
) -> tuple[float, float, list, dict]:
    """(seconds of a warm-up call, best seconds of `repeats` timed generate calls, the best call's outputs
    and the engine's own timings of it: `last_timings`, {} where it keeps none). The warm-up decodes as
    the timed calls do, so what an engine builds for them (packed weights, kernels, a CPU engine's recorded
    decode step: `generate.REPLAY_AFTER_STEPS`) is built before the clock runs."""
    t = time.perf_counter()
    engine.generate(prompts, ids, decoding, batch_size)
    warm_s = time.perf_counter() - t
    best, gens, timings = float("inf"), [], {}
    for _ in range(repeats):
        t = time.perf_counter()
        out = engine.generate(prompts, ids, decoding, batch_size)
        took = time.perf_counter() - t
        if took < best:
            best, gens, timings = took, out, dict(getattr(engine, "last_timings", None) or {})
    return warm_s, best, gens, timings


def bench_engine(
    model: ModelRef,
    prompts: list[list[int]],
    batch_size: int = 8,
    max_new_tokens: int = 32,
    dtype: str = "bfloat16",
    backends: tuple[str, ...] = ("bf16",),
    repeats: int = 2,
) -> pd.DataFrame:
    from transformers import AutoModelForCausalLM

    from detaudit.builtin.local import LocalEngine

    distinct = min(len(prompts), batch_size)
    # a batch larger than the suite repeats its prompts (the work of a full batch, which the throughput
    # is about), said in the settings line
    prompts = [prompts[i % distinct] for i in range(batch_size)]
    ids = [str(i) for i in range(len(prompts))]
    # eos disabled on both sides so both generate exactly max_new_tokens per prompt
    decoding = DecodingParams(greedy=True, max_new_tokens=max_new_tokens)
    rows, replayed = [], {}
    for backend in backends:
        eng = LocalEngine(EngineOptions(EngineSettings(dtype=dtype), model, backend))
        _, best, gens, t = time_generate(eng, prompts, ids, decoding, batch_size, repeats)
        ntok = sum(len(g.token_ids) for g in gens)
        replayed[backend] = bool(t.get("cpu_replay"))
        rows.append(
            {
                "engine": f"detaudit ({backend})",
                "tokens": ntok,
                "seconds": best,
                "tokens_per_s": ntok / best,
                "prefill_s": t["prefill_s"],
                "decode_tokens_per_s": (ntok - len(gens)) / t["decode_s"],
            }
        )

    hf = AutoModelForCausalLM.from_pretrained(str(model.path), dtype=getattr(torch, dtype)).eval()
    width = max(len(p) for p in prompts)
    inp = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros_like(inp)
    for i, p in enumerate(prompts):  # left padding, as HF generate expects for decoder-only models
        inp[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    kw = dict(
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    with torch.inference_mode():
        hf.generate(inp, **{**kw, "max_new_tokens": 2, "min_new_tokens": 2})
        best = first = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            out = hf.generate(inp, **kw)
            best = min(best, time.perf_counter() - t)
            t = time.perf_counter()
            hf.generate(inp, **{**kw, "max_new_tokens": 1, "min_new_tokens": 1})  # the prefill alone
            first = min(first, time.perf_counter() - t)
    ntok = (out.shape[1] - width) * len(prompts)
    rows.append(
        {
            "engine": "transformers generate",
            "tokens": ntok,
            "seconds": best,
            "tokens_per_s": ntok / best,
            "prefill_s": first,
            "decode_tokens_per_s": (ntok - len(prompts)) / (best - first),
        }
    )
    df = pd.DataFrame(rows)
    df["vs_transformers"] = df["tokens_per_s"] / df["tokens_per_s"].iloc[-1]
    if "bf16" in backends:  # ratios to detaudit's bf16 in this run (prefill: its time over this one's)
        base = df[df.engine == "detaudit (bf16)"].iloc[0]
        df["vs_bf16"] = df["tokens_per_s"] / base["tokens_per_s"]
        df["prefill_vs_bf16"] = base["prefill_s"] / df["prefill_s"]
        df["decode_vs_bf16"] = df["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    df.attrs.update(batch_size=batch_size, max_new_tokens=max_new_tokens, dtype=dtype, threads=torch.get_num_threads())
    filled = f", repeated to fill the batch of {batch_size}" if distinct < batch_size else ""
    df.attrs["prompts"] = f"{distinct} distinct{filled}"
    df.attrs["omp_wait"] = omp_wait.describe()
    df.attrs["cpu_gemm"] = describe_cpu()["cpu_gemm"]  # bio / bio+tbik's CPU product path (bf16 inputs or fp32)
    if choice().bf16:  # how its calls were made (the same bits either way; the speed differs)
        df.attrs["cpu_dispatch"] = dispatcher()
    # decode steps replayed from a recording or made eagerly (`graphs.replayed_step`; the same bits)
    df.attrs["decode_steps"] = ", ".join(f"{b} {'replayed' if r else 'eager'}" for b, r in replayed.items())
    return df
