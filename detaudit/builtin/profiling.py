"""Where an engine call's time goes: torch.profiler's self time per op, for `bench e2e --profile`. Each
engine profiles its own generate calls (a real-TP rank in its worker process, where its kernels and
collectives run), so the controller gets rank 0's view whatever the TP mode."""

from __future__ import annotations

from typing import Any, Callable

import torch


def self_times(call: Callable[[], Any], cuda: bool) -> tuple[Any, dict[str, tuple[int, float]]]:
    """call()'s result and, per op name, (calls, self ms) under torch.profiler: on CUDA the device's own
    events (kernels, copies) by device time (a CPU-side op's self device time is its kernels' time again,
    which would count twice), on CPU the ops by self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        result = call()
        if cuda:
            torch.cuda.synchronize()
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    events = [e for e in prof.key_averages() if getattr(e, attr) > 0]
    if cuda:
        events = [e for e in events if str(getattr(e, "device_type", "")).endswith("CUDA")]
    return result, {e.key: (e.count, getattr(e, attr) / 1e3) for e in events}
