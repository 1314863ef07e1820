"""Where a CPU prefill's time goes, op by op and compiled call by call (a tuning aid for issue 55, not a test).

    python3 tools/prefill_profile.py MODEL [--backend bio+tbik] [--batch 32] [--prompt-tokens 40] [--top 20]

Builds the built-in engine on MODEL (a directory or a catalog name) on CPU, makes a batch of random
prompts' one-token calls to warm up, times three more (the prefill's seconds), then profiles one under
torch.profiler with Python stacks and prints the top entries by self CPU time: torch ops with their input
shapes, and the Python functions that call compiled code (numba's kernels are not torch ops, so `bench e2e
--profile`, which lists ops, leaves their time out; the worker team's `dispatch` holds every job it runs
on this thread). The OpenMP wait is the command line's (`detaudit.omp_wait`), set before torch loads."""

from __future__ import annotations

import argparse

from detaudit import omp_wait


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--backend", default="bio+tbik")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=40)
    ap.add_argument("--top", type=int, default=20)
    a = ap.parse_args()
    omp_wait.apply()  # (before torch loads: libgomp reads it once)
    from torch.profiler import ProfilerActivity, profile

    from detaudit.bench.e2e import random_prompts
    from detaudit.builtin import start
    from detaudit.builtin.arch import ModelConfig
    from detaudit.config import DecodingParams, EngineOptions, EngineSettings
    from detaudit.models import resolve_model

    model = resolve_model(a.model, auto_prepare=True)
    eng = start(EngineOptions(EngineSettings(device="cpu", cuda_graphs=False), model, a.backend, 1, "real"))
    prompts = random_prompts(a.batch, a.prompt_tokens, ModelConfig.of(model).vocab_size)
    ids = [str(i) for i in range(a.batch)]
    one = DecodingParams(greedy=True, max_new_tokens=1)
    for _ in range(2):
        eng.generate(prompts, ids, one, a.batch)
    seconds = []
    for _ in range(3):
        eng.generate(prompts, ids, one, a.batch)
        seconds.append(eng.last_timings["prefill_s"])
    tokens = a.batch * a.prompt_tokens
    print(
        f"{a.backend} batch {a.batch} x {a.prompt_tokens}: prefill s {[round(s, 4) for s in seconds]}, "
        f"{tokens / min(seconds):.0f} tokens/s (best)"
    )
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, with_stack=True) as prof:
        eng.generate(prompts, ids, one, a.batch)
    print(f"{'self ms':>9} {'calls':>6}  what (input shapes)")
    by_shape = prof.key_averages(group_by_input_shape=True)
    for e in sorted(by_shape, key=lambda e: -e.self_cpu_time_total)[: a.top]:
        shapes = f" {e.input_shapes}" if e.input_shapes and any(e.input_shapes) else ""
        print(f"{e.self_cpu_time_total / 1e3:9.1f} {e.count:6d}  {e.key[-100:]}{shapes}")


if __name__ == "__main__":
    main()
