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
from helpers import require

from detaudit.backends import get_backend
from detaudit.builtin.dist import TorchGroup
from detaudit.errors import DetauditError

require("triton", "triton")


@pytest.mark.slow  # a subprocess interpreting the peer kernels on emulated ranks: 40-90 s
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


@pytest.mark.parametrize("mode", ["auto", "nccl", "gather", "scatter", "peer"])
def test_backend_description_names_the_forced_transport(monkeypatch, mode):
    """The manifest's all_reduce_impl says what DETAUDIT_ALLREDUCE chose: peer memory only where the mode
    can use it (auto, peer), never for a forced NCCL transport."""
    monkeypatch.setenv("DETAUDIT_ALLREDUCE", mode)
    text = get_backend("bio+tbik").describe()["all_reduce_impl"]
    assert text.startswith(f"{mode}: ")
    assert ("peer memory" in text) == (mode in ("auto", "peer")), text


class _FakeHandle:
    """Stands in for PyTorch's symmetric-memory handle, which needs GPUs (a mock: no real part runs on
    CPU). Every rank's buffer is this rank's own."""

    def __init__(self, buf):
        self.buf = buf

    def get_buffer(self, rank, sizes, dtype):
        return self.buf.view(dtype)[: sizes[0]]

    def barrier(self, channel=0, timeout_ms=0):
        pass


def test_peer_buffers_grow_by_doubling_and_keep_the_old(monkeypatch):
    """The transport's buffer policy (mocked symmetric memory and kernels: the real ones need GPUs): the
    first buffer holds MIN_SLICE a slice, a larger partial at least doubles it, a dtype change alone keeps
    the size, outgrown buffers are kept (graphs may hold them), a partial past the kernels' int32 offsets
    goes to NCCL, and a rank that cannot allocate turns the transport off with its reason. Decode-size
    partials take the one-shot area instead, allocated once and never grown."""
    import torch.distributed._symmetric_memory as symm_mem

    from detaudit.backends import peer
    from detaudit.backends.kernels import peer_reduce

    monkeypatch.setattr(symm_mem, "empty", lambda n, dtype, device: torch.empty(n, dtype=dtype))
    monkeypatch.setattr(peer, "_rendezvous", lambda buf, pg: _FakeHandle(buf))
    monkeypatch.setattr(peer.PeerTransport, "_agree", lambda self, ok, device: bool(ok))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for name in ("push", "reduce", "gather", "oneshot_push", "oneshot_reduce"):
        monkeypatch.setattr(peer_reduce, name, lambda *a, **k: None)
    t = peer.PeerTransport(0, 4)
    assert t.all_reduce(torch.zeros(8, 64), torch.bfloat16, "tree") is not None  # one-shot
    assert t.buffers is None and len(t.oneshot.areas) == 4
    assert t.oneshot.areas[0].numel() == 2 * 4 * peer_reduce.ONESHOT_MAX
    area = t.oneshot
    t.all_reduce(torch.zeros(32, 4096), torch.bfloat16, "tree")  # still one-shot at 4 ranks, same area
    assert t.oneshot is area and t.buffers is None
    assert t.all_reduce(torch.zeros(64, 4096), torch.bfloat16, "tree") is not None  # three steps
    assert t.buffers.per == peer.MIN_SLICE and not t.retired
    big = peer_reduce.slice_size(3 * peer.MIN_SLICE * 4, 4)
    t.all_reduce(torch.zeros(3 * peer.MIN_SLICE, 4), torch.bfloat16, "tree")
    assert t.buffers.per == max(big, 2 * peer.MIN_SLICE) and len(t.retired) == 1
    per = t.buffers.per
    t.all_reduce(torch.zeros(64, 4096), torch.float32, "rank")  # fits, other dtype: same size
    assert (t.buffers.per, t.buffers.dtype, len(t.retired)) == (per, torch.float32, 2)
    huge = torch.zeros(1).expand(2**31)  # a view: no memory, only its size matters here
    assert t.all_reduce(huge, torch.float32, "rank") is None and len(t.retired) == 2

    def no_memory(n, dtype, device):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(symm_mem, "empty", no_memory)
    t = peer.PeerTransport(0, 4)
    assert t.all_reduce(torch.zeros(8, 64), torch.bfloat16, "tree") is None
    assert "out of memory" in t.reason and t.buffers is None
    assert t.all_reduce(torch.zeros(8, 64), torch.bfloat16, "tree") is None  # off for good: no retry
