"""The compiled team of `cpu_calls` (`cpu_team`): a product's slices on worker threads that wait in
compiled code. Which thread makes a call never changes the call, so the checks are that every call is
made exactly once, in the slices `cpu_calls.slices` cuts, whatever the thread count, with the team and
with the Python pool, and that a busy, stopped or forked team still gets the work done. They run in a
process of their own (`team_checks.py`), where the calls' symbol is bound to a fake micro-kernel: any CPU
with numba. The real kernel's bits on the team are the thread-count tests of test_cpu_bf16.py,
test_bio.py and test_tbik.py, on the machines with that kernel (AVX-512 BF16, AMX)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import require

require("numba", "cpu")


@pytest.mark.slow  # a process of its own: numba compiles the team (~5 s, cached on disk after)
def test_team_makes_every_call_once_in_the_pools_slices():
    script = Path(__file__).with_name("team_checks.py")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
