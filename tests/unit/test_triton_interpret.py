"""The Triton kernels on CPU under TRITON_INTERPRET=1: batch invariance, TP invariance of the tree
kernel, accuracy. (On a GPU, tests/gpu/ runs the same properties at real shapes.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import require

require("triton", "triton")


@pytest.mark.slow  # interpreting every kernel: 35 s (AVX-512) to 150 s (2-core AVX2) of one core's time
def test_triton_kernels_under_interpreter():
    """`triton_checks.py` in two processes at once, each half of the checks (CI has two cores)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).with_name("triton_checks.py")
    procs = {
        part: subprocess.Popen(
            [sys.executable, str(script), part], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for part in ("moe", "rest")
    }
    for part, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        assert proc.returncode == 0 and out.strip().endswith("ok"), f"{part}: {out}{err}"
