"""`detaudit bench e2e`: the built-in engine end to end, bf16 vs bio vs bio+tbik on the same prompts.

For each (model, TP, backend) one engine is built and, per batch size, a batch of random prompts of
`prompt_tokens` ids (seeded: every backend sees the same ids) is generated greedily for `new_tokens`
tokens with EOS disabled, after a warm-up call (compilation, caches, graphs), `repeats` times (the rows
report the median call by decode ms per step, and the median of the calls' prefill rates: one eager prefill
a call is a single sample, at times 5-20% slow on the GPU machines' hosts; with more than one
call, `ms_per_step_min` / `_max` and `prefill_tok_s_min` / `_max` show the spread: eager decode is
host-bound and the GPU machines' virtualised hosts vary by up to 1.6x between runs). The engine times the prefill
(prompts -> first logits) and the decode loop (steps -> logits, sampling, bookkeeping), synchronizing
the device at each boundary; CUDA-graph capture is timed apart and left out of decode. `host_ms_per_step`
is the host's time to issue one decode step (eager: every launch of the forward; graphed: the input copies
and the replay), not synchronized: decode runs one step ahead of the host's bookkeeping, so where it is
below the device's step time the GPU, not the host, sets `ms_per_step` (a slower host moves it up to
about `host_ms_per_step`). `prefill_host_ms` is the same for the median prefill: the host's time to issue
its launches up to the first logits, not synchronized; where it comes close to the prefill's own time
(`prompt_tokens * batch / prefill_tok_s`) the GPU waited for the host, and the prefill moves with the host's
speed (reports/gpu/moe: a MoE prefill of 4,096 tokens at TP 2). Ratios are to
bf16 of the same model, TP, batch and graph mode in the same run. `cuda_graphs="both"` times every
configuration eagerly and graphed on the same device (`graphed_speedup`: eager over graphed ms per step).
On CPU, `cpu_replayed_calls` is how many of the timed calls decoded from a recorded step (`replayed_step`;
the warm-up decodes as they do, so the recording is made before them: all or none). With
`DETAUDIT_TP1_GROUP=1`, real TP 1 runs in a one-rank process group (NCCL on GPU), as TP > 1 does.

`profile` > 0: after an engine's timed calls (all batch sizes: a profiler may leave the process slower),
two more calls per batch size run under torch.profiler in the engine's process (under real TP rank 0's,
with its collectives), one with a single new token (prefill) and one with `new_tokens` (prefill +
decode); per phase the `profile` top ops by self device time (self CPU time on CPU) are appended to
`profile_rows`, decode being the second call's time per op less the first's.
"""

from __future__ import annotations

from typing import Callable, Sequence

import pandas as pd
import torch

from detaudit import omp_wait
from detaudit.config import DecodingParams, EngineOptions, EngineSettings, ModelRef


def _release(device: str) -> None:
    """Free one engine's device memory before the next is built (an 8B model is 16 GB)."""
    import gc

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def profile_phases(eng, prompts, ids, decoding: DecodingParams, top: int) -> list[dict]:
    """The `top` ops by self time of the prefill (a one-token call) and of the decode (the full call less
    the one-token call), each with its share of the phase's profiled self time."""
    bs = len(prompts)
    eng.generate(prompts, ids, DecodingParams(greedy=True, max_new_tokens=1), bs, profile=True)
    first = eng.last_profile or {}
    eng.generate(prompts, ids, decoding, bs, profile=True)
    full = eng.last_profile or {}
    decode = {}
    for k, (calls, ms) in full.items():
        calls0, ms0 = first.get(k, (0, 0.0))
        decode[k] = (calls - calls0, ms - ms0)
    phases = (("prefill", first), ("decode", decode))
    return [{"phase": phase, **r} for phase, times in phases for r in top_ops(times, top)]


def top_ops(times: dict[str, tuple[int, float]], top: int) -> list[dict]:
    """The `top` ops of {op: (calls, self ms)} by self time, each with its share of the total."""
    kept = {k: v for k, v in times.items() if v[1] > 0}
    total = sum(ms for _, ms in kept.values()) or 1.0
    ranked = sorted(kept.items(), key=lambda kv: -kv[1][1])[:top]
    return [
        {"rank": rank, "op": k[:100], "calls": calls, "self_ms": ms, "share": ms / total}
        for rank, (k, (calls, ms)) in enumerate(ranked, 1)
    ]


def random_prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=g).tolist()


def bench_e2e(
    models: Sequence[ModelRef],
    backends: Sequence[str],
    tps: Sequence[int],
    batch_sizes: Sequence[int],
    prompt_tokens: int = 512,
    new_tokens: int = 64,
    device: str = "cuda",
    tp_mode: str = "real",
    cuda_graphs: bool | str = True,
    progress: Callable[..., None] | None = None,
    repeats: int = 1,
    profile: int = 0,
    profile_rows: list[dict] | None = None,
) -> pd.DataFrame:
    """`cuda_graphs`: True, False, or "both": each (model, TP, backend) runs eagerly and from CUDA graphs
    on the same device, one row each, plus `graphed_speedup` (eager ms per step over graphed)."""
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    from detaudit.builtin import start
    from detaudit.builtin.arch import ModelConfig

    rows = []
    timed = DecodingParams(greedy=True, max_new_tokens=new_tokens)
    # the warm-up builds what the timed calls use: a few tokens make a GPU engine's CUDA graphs, a CPU
    # engine records its decode step only once a batch size has enough of them (`generate.REPLAY_AFTER_STEPS`):
    # there the warm-up decodes as the timed calls do, or the first timed call would be eager, the rest not
    warm = timed if device == "cpu" else DecodingParams(greedy=True, max_new_tokens=min(4, new_tokens))
    modes = (False, True) if cuda_graphs == "both" else (bool(cuda_graphs),)
    for model in models:
        name, vocab = model.name, ModelConfig.of(model).vocab_size
        for tp in tps:
            for backend, graphs in ((b, g) for b in backends for g in modes):
                settings = EngineSettings(device=device, cuda_graphs=graphs)
                eng = start(EngineOptions(settings, model, backend, tp, tp_mode))
                to_profile: list[tuple[dict, list, list]] = []  # (row key, prompts, ids) per batch size
                try:
                    for bs in batch_sizes:
                        prompts = random_prompts(bs, prompt_tokens, vocab)
                        ids = [str(i) for i in range(bs)]
                        eng.generate(prompts, ids, warm, bs)
                        runs = []
                        for _ in range(repeats):
                            eng.generate(prompts, ids, timed, bs)
                            runs.append(dict(eng.last_timings))
                        per_step = [1e3 * t["decode_s"] / max(1, t["decode_steps"]) for t in runs]
                        median = sorted(range(repeats), key=per_step.__getitem__)[(repeats - 1) // 2]  # the median call
                        t = runs[median]
                        prefill = [r["prompt_tokens"] / r["prefill_s"] for r in runs]
                        mid = sorted(range(repeats), key=prefill.__getitem__)[(repeats - 1) // 2]  # the median prefill
                        row = {
                            "model": name,
                            "tp": tp,
                            "backend": backend,
                            "batch": bs,
                            "prompt_tokens": prompt_tokens,
                            "new_tokens": new_tokens,
                            "prefill_tok_s": prefill[mid],
                            "prefill_host_ms": 1e3 * runs[mid]["prefill_issue_s"],
                            "decode_tok_s": bs * max(1, t["decode_steps"]) / t["decode_s"],
                            "ms_per_step": per_step[median],
                            "host_ms_per_step": 1e3 * t["issue_s"] / max(1, t["decode_steps"]),
                            "capture_s": t["capture_s"],
                            "cuda_graphs": bool(t.get("cuda_graphs")),
                            "workers": eng.describe().get("workers", 0),
                        }
                        if device == "cpu":
                            row["cpu_replayed_calls"] = sum(bool(r.get("cpu_replay")) for r in runs)
                        if repeats > 1:
                            row.update(
                                repeats=repeats,
                                ms_per_step_min=min(per_step),
                                ms_per_step_max=max(per_step),
                                prefill_tok_s_min=min(prefill),
                                prefill_tok_s_max=max(prefill),
                            )
                        rows.append(row)
                        if profile and profile_rows is not None:
                            keys = ("model", "tp", "backend", "batch", "cuda_graphs")
                            to_profile.append(({k: row[k] for k in keys}, prompts, ids))
                        if progress:
                            graphs = (" graphs" if row["cuda_graphs"] else " eager") if len(modes) > 1 else ""
                            progress(f"{name} TP {tp} {backend} batch {bs}{graphs}")
                    # after every timed row of this engine: the profiler may leave a process slower
                    for key, prompts, ids in to_profile:
                        profile_rows += [{**key, **r} for r in profile_phases(eng, prompts, ids, timed, profile)]
                finally:
                    eng.close()
                    del eng
                    _release(device)
    df = pd.DataFrame(rows)
    if len(modes) == 2 and not df.empty:
        key = ["model", "tp", "backend", "batch"]
        g = df[df.cuda_graphs][key + ["ms_per_step"]].rename(columns={"ms_per_step": "_g"})
        df = df.merge(g, on=key, how="left")
        df["graphed_speedup"] = df.ms_per_step / df._g
        df = df.drop(columns=["_g"])
    if "bf16" in backends and not df.empty:
        key = ["model", "tp", "batch", "cuda_graphs"]
        base = df[df.backend == "bf16"][key + ["prefill_tok_s", "decode_tok_s"]]
        df = df.merge(base.rename(columns={"prefill_tok_s": "_p", "decode_tok_s": "_d"}), on=key, how="left")
        df["prefill_vs_bf16"] = df.prefill_tok_s / df._p
        df["decode_vs_bf16"] = df.decode_tok_s / df._d
        df = df.drop(columns=["_p", "_d"])
    df.attrs = {"device": device, "tp_mode": tp_mode, "cuda_graphs": cuda_graphs}
    if device == "cpu":  # bio / bio+tbik's CPU product path and kernels (the table's title names them)
        from detaudit.backends import describe_machine

        df.attrs.update(describe_machine(), threads=torch.get_num_threads(), omp_wait=omp_wait.describe())
    return df
