"""How many pytest-xdist processes `make test` runs, and the CPU line the suite's summary prints.

One process per physical core this process may use, at most `MOST`: two logical CPUs of one core share
its execution units, so two test processes there only slow each other's multi-process tests (vLLM, Ray,
real TP), and a CPU quota (cgroup `cpu.max`) below the visible CPUs counts as that many cores. On this
project's 2-core EPYC two processes took CI from 2,100-2,400 s to 1,800; the project's CI machine ran
2,505 s in two (two tests failing) against 2,268 in one a commit before, its multi-process tests 1.5-2.2x
slower than on the EPYC in two, its single-process compile as fast. `python
tests/cpu_cores.py` prints the count (the Makefile's default; standard library only, no venv needed);
`topology()` also feeds the summary line (tests/conftest.py) that says which machine a CI log came from."""

from __future__ import annotations

import math
import os
from pathlib import Path

MOST = 2  # the real-model and vLLM tests hold GiBs each; two is what CI has measured


def _logical() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:
        return list(range(os.cpu_count() or 1))


def _physical(cpus: list[int]) -> int:
    cores = set()
    for c in cpus:
        try:
            cores.add(Path(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list").read_text().strip())
        except OSError:
            cores.add(str(c))
    return len(cores)


def _quota() -> float | None:
    """CPUs' worth of the cgroup v2 quota, or None where there is none."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def topology() -> tuple[int, int, float | None]:
    """Logical CPUs this process may use, the physical cores among them, and the cgroup quota (or None)."""
    cpus = _logical()
    return len(cpus), _physical(cpus), _quota()


def workers() -> int:
    _, n, quota = topology()
    if quota is not None:
        n = min(n, max(1, math.floor(quota)))
    return max(1, min(MOST, n))


if __name__ == "__main__":
    print(workers())
