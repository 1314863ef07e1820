"""Self time per op from a torch.profiler chrome trace, as vLLM's workers write them (`--profile` of
`bench vllm`: vLLM runs the model in processes of its own, so the trace is the only view of its ops).

The same answer as the built-in engine's in-process profile (`builtin.profiling.self_times`): on CUDA
the device's own events (kernels, copies, memsets), which never nest, by device time; on CPU the ops
by self CPU time, an op's time less that of the ops it called on the same thread."""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
# aten ops, and the named ranges of code that is no aten op (`record_function`: detaudit's compiled CPU
# calls), as torch.profiler's key_averages counts them
CPU_EVENTS = ("cpu_op", "user_annotation")


def self_times(path: Path, cuda: bool) -> dict[str, tuple[int, float]]:
    """Per op name, (calls, self ms) of the trace at `path` (.json or .json.gz)."""
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    if cuda:
        spans = [(e["name"], float(e["dur"])) for e in events if e.get("cat") in DEVICE_EVENTS]
    else:
        spans = _cpu_self([e for e in events if e.get("cat") in CPU_EVENTS])
    out: dict[str, tuple[int, float]] = {}
    for name, us in spans:
        calls, ms = out.get(name, (0, 0.0))
        out[name] = (calls + 1, ms + us / 1e3)
    return out


def _cpu_self(events: list[dict]) -> list[tuple[str, float]]:
    """(name, self us) of each op: its duration less its direct children's, the children being the ops
    of the same thread that start and end within it."""
    out = []
    by_thread: dict[tuple, list[dict]] = {}
    for e in events:
        by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list] = []  # [end, name, self us]
        for e in evs:
            start, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= start:
                _, name, own = stack.pop()
                out.append((name, own))
            if stack:
                stack[-1][2] -= dur
            stack.append([start + dur, e["name"], dur])
        out += [(name, own) for _, name, own in stack]
    return out


def newest_rank0(directory: Path, before: set[Path]) -> Path | None:
    """The trace of TP rank 0 that appeared in `directory` since `before` (vLLM names a worker's traces
    after its ranks, `..._tp0_..._rank0...`; one worker: its only trace)."""
    new = sorted(p for p in directory.iterdir() if ".pt.trace.json" in p.name and p not in before)
    rank0 = [p for p in new if re.search(r"(?:^|_)(?:tp0|rank0)(?!\d)", p.name)]
    pick = rank0 or (new if len(new) == 1 else [])
    return max(pick, key=lambda p: p.stat().st_mtime) if pick else None
