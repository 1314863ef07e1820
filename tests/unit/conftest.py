"""Fixtures of the unit tests."""

from __future__ import annotations

import pytest

from detaudit.backends.kernels import cpu_bf16
from detaudit.errors import DetauditError


@pytest.fixture(params=["fp32", "bf16"])
def cpu_path(request):
    """Each CPU product path this machine can run, chosen for the test and put back after it (the
    environment's choice). The bf16 path is skipped where the CPU or oneDNN cannot run it (an AVX2
    machine, or `ONEDNN_MAX_CPU_ISA=AVX2` on this one)."""
    try:
        chosen = cpu_bf16.choose(request.param)
    except DetauditError as e:
        pytest.skip(str(e))
    yield chosen
    cpu_bf16.choose()
