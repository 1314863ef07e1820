"""`detaudit bench vllm`: vLLM's decode throughput with bf16 (vLLM's own kernels), bio and bio+tbik
(detaudit's plugin) on the same prompts, per TP size: the cost of determinism inside vLLM."""

from __future__ import annotations

import time

import pandas as pd

from detaudit.config import DecodingParams, EngineOptions, EngineSettings, ModelRef


def bench_vllm(
    model: ModelRef,
    prompts: list[list[int]],
    *,
    backends: tuple[str, ...],
    tps: tuple[int, ...],
    batch_size: int = 8,
    max_new_tokens: int = 32,
    dtype: str = "bfloat16",
    device: str = "cpu",
    repeats: int = 2,
    progress=None,
) -> pd.DataFrame:
    from detaudit.bench.engine import time_generate
    from detaudit.engines import open_engine

    prompts = prompts[:batch_size]
    ids = [str(i) for i in range(len(prompts))]
    decoding = DecodingParams(greedy=True, max_new_tokens=max_new_tokens)  # eos off: exactly max_new_tokens each
    rows = []
    for tp in tps:
        for backend in backends:
            t0 = time.perf_counter()
            settings = EngineSettings(name="vllm", dtype=dtype, device=device)
            eng = open_engine(EngineOptions(settings, model, backend, tp, max_batch_size=batch_size))
            open_s = time.perf_counter() - t0
            try:
                warm_s, best, gens, _ = time_generate(eng, prompts, ids, decoding, batch_size, repeats)
            finally:
                eng.close()
            start_s = open_s + warm_s  # host process start, vLLM build (on the first generate) and warm-up
            ntok = sum(len(g.token_ids) for g in gens)
            rows.append(
                {
                    "tp": tp,
                    "backend": backend,
                    "tokens": ntok,
                    "seconds": round(best, 3),
                    "tokens_per_s": ntok / best,
                    "engine_start_s": round(start_s, 1),
                }
            )
            if progress:
                progress()
    df = pd.DataFrame(rows)
    base = df[df.backend == "bf16"].set_index("tp")["tokens_per_s"] if "bf16" in backends else None
    if base is not None:
        df["vs_bf16"] = [r.tokens_per_s / base[r.tp] for r in df.itertuples()]
    df.attrs.update(batch_size=batch_size, max_new_tokens=max_new_tokens, dtype=dtype, device=device)
    return df
