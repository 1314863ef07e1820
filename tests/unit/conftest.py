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


@pytest.fixture(params=["compiled", "off"])
def cpu_kernels(request, monkeypatch):
    """bio's CPU attention and RMSNorm on each path: the compiled kernels (numba) and the PyTorch ops
    (DETAUDIT_CPU_COMPILED=off). The compiled run is skipped where numba is not installed."""
    from detaudit.backends.kernels import cpu_calls

    monkeypatch.setenv(cpu_calls.ENV, "auto" if request.param == "compiled" else "off")
    if request.param == "compiled" and cpu_calls.compiled("cpu_attention") is None:
        pytest.skip("numba not installed (the cpu extra)")
    yield request.param


@pytest.fixture(params=["team", "pool"])
def spread_on(request, monkeypatch):
    """spread_on(n): the compiled row kernels spread over n threads, on the compiled team's workers (the
    "team" run) or the Python pool's (DETAUDIT_CPU_TEAM=off, the "pool" run); returns the team (None for
    the pool). torch's thread count is put back after the test. Skipped where numba is not installed."""
    import torch

    from detaudit.backends.kernels import cpu_calls

    if cpu_calls.compiled("cpu_rows") is None:
        pytest.skip("numba not installed (the cpu extra)")
    monkeypatch.setenv(cpu_calls.TEAM_ENV, "auto" if request.param == "team" else "off")
    before = torch.get_num_threads()

    def spread(threads: int):
        torch.set_num_threads(threads)
        team = cpu_calls.team()
        assert (team is not None) == (request.param == "team")
        return team

    yield spread
    torch.set_num_threads(before)
