"""How long torch's OpenMP threads spin after a parallel region: the command line's default, and what
this process runs with.

The invariant backends' CPU products and attention run on detaudit's own threads (`cpu_gemm.run_jobs`),
between torch ops that run on torch's OpenMP team. After each parallel region libgomp's team threads
spin, waiting for the next one: GOMP_SPINCOUNT iterations, 300,000 by default (libgomp's "about 3 ms";
OMP_WAIT_POLICY=PASSIVE: 0). They spin on the very cores detaudit's threads need next, and those threads
then run at a fraction of a core. `detaudit bench engine` measured it (reports/cpu-bf16): with
10,000 spins bio+tbik's prefill took a third less time on a 2-core Xeon and a third to a fifth of the
time at 16 threads on an AMX Xeon, while detaudit's bf16 (torch's own ops only) stayed within its
run-to-run spread. So the command line sets GOMP_SPINCOUNT to `SPINS` before torch is loaded, where the
user set neither variable (libgomp reads them once, when torch loads it; the processes it starts
inherit them). How long a thread waits changes no result's bits, only its speed.

Library use is left alone: a program that imports torch itself decides its own OpenMP settings. Only
GNU OpenMP (libgomp, which torch's Linux wheels bundle) reads GOMP_SPINCOUNT; a torch on another runtime
(Intel's, preloaded; LLVM's on macOS) ignores it, and `describe` reports the variables as set.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, MutableMapping

SPIN_ENV = "GOMP_SPINCOUNT"
POLICY_ENV = "OMP_WAIT_POLICY"
SPINS = "10000"
# the value the command line set, so a worker process says where its value came from (a user's own
# GOMP_SPINCOUNT beside a stale marker differs from it)
ORIGIN_ENV = "DETAUDIT_OMP_WAIT"


def apply(environ: MutableMapping[str, str] | None = None, modules: Mapping | None = None) -> str:
    """Set GOMP_SPINCOUNT=SPINS in `environ` (os.environ) unless the user chose a wait (either variable
    set) or torch is already loaded (`modules`: sys.modules), when setting it would not reach libgomp.
    Returns what this process runs with (`describe`)."""
    environ = os.environ if environ is None else environ
    modules = sys.modules if modules is None else modules
    if SPIN_ENV not in environ and POLICY_ENV not in environ and "torch" not in modules:
        environ[SPIN_ENV] = environ[ORIGIN_ENV] = SPINS
    return describe(environ)


def describe(environ: Mapping[str, str] | None = None) -> str:
    """The OpenMP wait this process's torch runs with, and where it came from (bench settings, `doctor`)."""
    environ = os.environ if environ is None else environ
    if SPIN_ENV in environ:
        origin = "detaudit's default" if environ.get(ORIGIN_ENV) == environ[SPIN_ENV] else "set by the user"
        return f"{SPIN_ENV}={environ[SPIN_ENV]} ({origin})"
    if POLICY_ENV in environ:
        return f"{POLICY_ENV}={environ[POLICY_ENV]} (set by the user)"
    return f"libgomp's default ({SPIN_ENV} unset: 300,000 spins)"


def forwarded(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The wait variables set in this process, for processes that do not inherit its environment (the
    workers of a Ray cluster detaudit connects to)."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in (SPIN_ENV, POLICY_ENV, ORIGIN_ENV) if k in environ}
