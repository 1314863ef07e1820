"""Where a replayed CPU decode step's time goes, call by call (a tuning aid for issue 55, not a test).

    python3 tools/replay_split.py MODEL_DIR [--batch 32] [--tokens 32] [--backend bio+tbik] [--torch-threads K]
        [--spins N] [--team-share FLOPS] [--team-threads N] [--no-eager]

Builds the built-in engine on MODEL_DIR, decodes a batch of repeated prompts once to warm up (the
recording is made there), then times every recorded call of the next call's replayed steps, grouped by
what it is (a compiled unit or call by its function's name, a PyTorch op by its name, `cast` for a cast's
copy), and prints milliseconds per step, with the whole step's and the eager step's for comparison.
`--torch-threads K` runs the replay's PyTorch ops on K intra-op threads (torch.set_num_threads around each
replay), to see what the switches between torch's OpenMP team and detaudit's cost; `--spins`,
`--team-share` and `--team-threads` set the team's polls, flops a thread and most threads. The OpenMP wait is
the command line's (`detaudit.omp_wait`), set before torch loads."""

from __future__ import annotations

import argparse
import collections
import os
import time

from detaudit import omp_wait


def label(step) -> str:
    cells = {}
    for name, cell in zip(step.__code__.co_freevars, step.__closure__ or ()):
        try:
            cells[name] = cell.cell_contents
        except ValueError:
            pass
    fn = cells.get("fn") or cells.get("op") or cells.get("func")
    if fn is not None:
        return getattr(fn, "__name__", str(fn))
    if "dst" in cells:
        return "cast"
    return step.__qualname__


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--backend", default="bio+tbik")
    ap.add_argument("--torch-threads", type=int, default=0)
    ap.add_argument("--spins", type=int, default=0, help="the team's polls before a worker sleeps (cpu_team.SPINS)")
    ap.add_argument("--team-share", type=float, default=0, help="flops a team thread takes (cpu_bf16.TEAM_PER_THREAD)")
    ap.add_argument("--team-threads", type=int, default=0, help="the team's most threads (else torch's count)")
    ap.add_argument("--no-eager", action="store_true", help="skip the eager engine's step")
    a = ap.parse_args()
    omp_wait.apply()  # (before torch loads: libgomp reads it once)
    import torch

    from detaudit.backends.kernels import cpu_replay
    from detaudit.builtin import generate
    from detaudit.builtin.local import LocalEngine
    from detaudit.config import DecodingParams, EngineOptions, EngineSettings
    from detaudit.models import resolve_model

    generate.REPLAY_AFTER_STEPS = 1  # (the warm-up call records)
    if a.spins:
        from detaudit.backends.kernels import cpu_team

        cpu_team.SPINS = a.spins
    if a.team_threads:
        import math

        from detaudit.backends.kernels import cpu_calls

        def threads_for(n, flops, least, per_thread):
            return 1 if flops < least else max(1, min(a.team_threads, n, math.ceil(flops / per_thread)))

        cpu_calls.threads_for = threads_for
    if a.team_share:
        from detaudit.backends.kernels import cpu_bf16

        cpu_bf16.TEAM_PER_THREAD = {k: a.team_share for k in cpu_bf16.TEAM_PER_THREAD}
    eng = LocalEngine(EngineOptions(EngineSettings(dtype="bfloat16"), resolve_model(a.model), a.backend))
    prompts = [[1 + (i * 7 + j) % 500 for j in range(40)] for i in range(a.batch)]
    ids = [str(i) for i in range(a.batch)]
    decoding = DecodingParams(greedy=True, max_new_tokens=a.tokens)
    totals: dict[str, float] = collections.defaultdict(float)
    replays = [0]
    run = cpu_replay.Replay.run

    def timed(self):
        if not hasattr(self, "labels"):
            self.labels = [label(s) for s in self.steps]
        keep = torch.get_num_threads()
        if a.torch_threads:
            torch.set_num_threads(a.torch_threads)
        clock = time.perf_counter
        for name, step in zip(self.labels, self.steps):
            t = clock()
            step()
            totals[name] += clock() - t
        if a.torch_threads:
            torch.set_num_threads(keep)
        replays[0] += 1
        return self.out

    eng.generate(prompts, ids, decoding, a.batch)  # warm-up: the recording is made here
    eager_step = float("nan")
    if not a.no_eager:
        os.environ[cpu_replay.ENV] = "off"
        eager = LocalEngine(EngineOptions(EngineSettings(dtype="bfloat16"), resolve_model(a.model), a.backend))
        eager.generate(prompts, ids, decoding, a.batch)
        eager.generate(prompts, ids, decoding, a.batch)
        eager_step = eager.last_timings["decode_s"] / eager.last_timings["decode_steps"]
    eng.generate(prompts, ids, decoding, a.batch)
    whole = eng.last_timings["decode_s"] / eng.last_timings["decode_steps"]
    cpu_replay.Replay.run = timed
    eng.generate(prompts, ids, decoding, a.batch)
    cpu_replay.Replay.run = run
    n = replays[0]
    print(
        f"batch {a.batch}, {torch.get_num_threads()} torch threads, {omp_wait.describe()}, {a.backend}, spins "
        f"{a.spins or 'default'}, team share {a.team_share or 'default'}, team threads {a.team_threads or 'torch'}"
    )
    print(f"replay's torch threads {a.torch_threads or 'as torch'}: eager step {1e3 * eager_step:.2f} ms, replayed")
    print(f"{1e3 * whole:.2f} ms (untimed), timed {1e3 * sum(totals.values()) / n:.2f} ms")
    counts = collections.Counter(label(s) for s in eng.generator._graphs[a.batch][1].replay.steps)
    for name, secs in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {name:24s} {counts[name]:4d} calls  {1e3 * secs / n:8.3f} ms/step")


if __name__ == "__main__":
    main()
