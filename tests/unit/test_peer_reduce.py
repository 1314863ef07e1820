"""The peer-memory all-reduce: its kernels' bits on CPU under the Triton interpreter (C ranks emulated
in one process; the real transport over NVLink is checked in tests/gpu/test_peer_allreduce.py), and the
`peer` transport refused where a group has no peer memory."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from detaudit.backends import get_backend
from detaudit.builtin.dist import TorchGroup
from detaudit.errors import DetauditError

pytest.importorskip("triton")


def test_peer_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    script = Path(__file__).with_name("peer_checks.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr


@pytest.mark.parametrize("name", ["bio", "bio+tbik"])
def test_peer_mode_refused_without_peer_memory(monkeypatch, name):
    """DETAUDIT_ALLREDUCE=peer on a CPU group: one clear error, never a silent other transport."""
    monkeypatch.setenv("DETAUDIT_ALLREDUCE", "peer")
    b = get_backend(name)
    with pytest.raises(DetauditError, match="DETAUDIT_ALLREDUCE=peer: this TP group has no peer-memory"):
        b.all_reduce(torch.zeros(2, 8), TorchGroup(0, 2), torch.bfloat16)
