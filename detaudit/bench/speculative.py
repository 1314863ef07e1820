"""`detaudit bench e2e --speculative ngram:4[,draft:MODEL:4]`: the built-in engine's decode throughput with
and without speculative decoding, and whether the bits stayed.

For each (model, TP, backend) one engine is built; per batch size the first `batch` prompts of a suite
(default `quote`: answers that repeat their prompt, where n-gram drafts are accepted; cycled under new
request ids when the batch is larger than the suite) are generated greedily for `new_tokens` tokens with
end of sequence disabled (every call emits the same number of tokens), after a warm-up call per setting,
`repeats` times; each row is the median call by decode time. A speculative setting's warm-up is the timed
call itself: a verify step's CUDA graph is captured on the first step of its row count, and greedy drafts
are deterministic, so the warm-up meets every row count the timed calls meet and no capture is timed.
Per row:

- `decode_tok_s`: tokens generated after the prefill's first one, over the decode loop's time (drafting,
  verify steps, sampling and bookkeeping included); `tok_s`: every token over prefill + decode.
- `speedup`: `decode_tok_s` over the plain (`off`) row's of the same model, TP, backend and batch.
- `acceptance`: draft tokens accepted / proposed; `tokens_per_step`: tokens emitted per verify step.
- `same_bits`: every request's tokens, chosen-token and top-k log-probabilities and top-k ids equal the
  plain call's, floats compared by bit pattern (expected for bio / bio+tbik; bf16 may differ).
"""

from __future__ import annotations

import struct
from typing import Callable, Sequence

import pandas as pd

from detaudit.bench.e2e import _release
from detaudit.config import DecodingParams, EngineOptions, EngineSettings, ModelRef, Speculative
from detaudit.runs.records import Generation


def _bits(g: Generation) -> tuple:
    """A generation's recorded numbers with floats as their float32 bit patterns."""
    f32 = lambda xs: struct.pack(f"{len(xs)}f", *xs)  # noqa: E731
    return (
        tuple(g.token_ids),
        f32(g.token_logprobs),
        tuple(map(tuple, g.topk_ids)),
        tuple(f32(row) for row in g.topk_logprobs),
    )


def suite_batch(prompts: Sequence[Sequence[int]], ids: Sequence[str], batch: int) -> tuple[list, list]:
    """The first `batch` prompts, cycled (as new requests: `id#r`) where the suite has fewer."""
    n = len(prompts)
    return [list(prompts[i % n]) for i in range(batch)], [f"{ids[i % n]}#{i // n}" for i in range(batch)]


def bench_speculative(
    models: Sequence[ModelRef],
    backends: Sequence[str],
    tps: Sequence[int],
    batch_sizes: Sequence[int],
    settings: Sequence[Speculative],
    prompts: dict[str, tuple[list[list[int]], list[str]]],
    new_tokens: int = 64,
    device: str = "cuda",
    tp_mode: str = "real",
    cuda_graphs: bool = True,
    repeats: int = 1,
    progress: Callable[[], None] | None = None,
) -> pd.DataFrame:
    """`prompts`: model name -> (token ids, request ids) of the suite, tokenized for that model."""
    from detaudit.builtin import start

    decoding = DecodingParams(greedy=True, max_new_tokens=new_tokens)
    warm = DecodingParams(greedy=True, max_new_tokens=min(8, new_tokens))
    plain = Speculative()
    rows = []
    for model in models:
        suite_ids, suite_names = prompts[model.name]
        for tp in tps:
            for backend in backends:
                eng = start(
                    EngineOptions(EngineSettings(device=device, cuda_graphs=cuda_graphs), model, backend, tp, tp_mode)
                )
                try:
                    for bs in batch_sizes:
                        batch, ids = suite_batch(suite_ids, suite_names, bs)
                        reference = None
                        for spec in (plain, *settings):
                            eng.generate(batch, ids, decoding if spec.on else warm, bs, speculative=spec)
                            calls = []
                            for _ in range(repeats):
                                out = eng.generate(batch, ids, decoding, bs, speculative=spec)
                                calls.append((dict(eng.last_timings), out))
                            t, out = sorted(calls, key=lambda c: c[0]["decode_s"])[(repeats - 1) // 2]
                            if reference is None:
                                reference = [_bits(g) for g in out]
                            tokens = sum(len(g.token_ids) for g in out)
                            drafted = t.get("drafted", 0)
                            rows.append(
                                {
                                    "model": model.name,
                                    "tp": tp,
                                    "backend": backend,
                                    "batch": bs,
                                    "speculative": str(spec),
                                    "new_tokens": new_tokens,
                                    "prompt_tokens": t["prompt_tokens"] / bs,
                                    "tok_s": tokens / (t["prefill_s"] + t["decode_s"]),
                                    "decode_tok_s": (tokens - bs) / t["decode_s"],
                                    "tokens_per_step": (tokens - bs) / max(1, t["decode_steps"]) / bs,
                                    "acceptance": t.get("accepted", 0) / drafted if drafted else float("nan"),
                                    "same_bits": [_bits(g) for g in out] == reference,
                                    "cuda_graphs": bool(t.get("cuda_graphs")),
                                    "repeats": repeats,
                                }
                            )
                            if progress:
                                progress()
                finally:
                    eng.close()
                    del eng
                    _release(device)
    df = pd.DataFrame(rows)
    if not df.empty:
        key = ["model", "tp", "backend", "batch"]
        base = df[df.speculative == "off"][key + ["decode_tok_s"]].rename(columns={"decode_tok_s": "_d"})
        df = df.merge(base, on=key, how="left")
        df["speedup"] = df.decode_tok_s / df._d
        df = df.drop(columns=["_d"])
    df.attrs = {"device": device, "tp_mode": tp_mode, "cuda_graphs": cuda_graphs, "decoding": "greedy, no EOS"}
    return df
