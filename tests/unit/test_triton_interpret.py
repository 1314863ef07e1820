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


@pytest.mark.slow  # a subprocess interpreting every kernel: 35 s (AVX-512) to 150 s (2-core AVX2)
def test_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).with_name("triton_checks.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
