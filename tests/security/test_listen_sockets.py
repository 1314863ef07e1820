"""Every socket detaudit's TP workers listen on is on loopback.

Rank 0's torch.distributed store used to listen on `*:PORT` (unauthenticated, reachable from the
network). These tests start real TP-2 process groups on CPU and read the listening TCP sockets of the
test's own child processes only (never the whole host's). `--engine vllm` at TP 2 (the host process and
the workers vLLM starts): read in tests/integration/test_vllm.py's sweep, whose TP-2 engines are up there
anyway (a vLLM engine's start is CI's time)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from helpers import assert_loopback_only, is_loopback, listening


def test_helper_flags_wildcard_addresses():
    """The check itself: wildcard and routable addresses (IPv4 and IPv6) are not loopback."""
    for ip in ("0.0.0.0", "::", "10.1.2.3", "fe80::1%eth0", "::ffff:10.0.0.1", "2001:db8::1"):
        assert not is_loopback(ip), ip
    for ip in ("127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1"):
        assert is_loopback(ip), ip
    with pytest.raises(AssertionError):
        assert_loopback_only([(1, "127.0.0.1", 1), (1, "::", 2)])
    with pytest.raises(AssertionError):
        assert_loopback_only([])


_RANK = textwrap.dedent("""
    import sys, time
    import torch
    from detaudit.builtin import dist
    rank, port = int(sys.argv[1]), int(sys.argv[2])
    dist.init(rank, 2, port, "cpu", timeout_s=60)
    t = torch.ones(4)
    torch.distributed.all_reduce(t)
    assert t.tolist() == [2.0] * 4
    print("ready", flush=True)
    sys.stdin.read()  # hold the group open until the test closes stdin
    dist.shutdown()
""")


@pytest.mark.slow  # a child process with its own torch import and process group
def test_dist_init_without_listen_fd_is_loopback_only():
    """`dist.init` as benchmarks and mp.spawn tests call it (a port, no inherited socket)."""
    from detaudit.builtin.dist import free_port

    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, str(r), str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        for r in range(2)
    ]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready"
        assert_loopback_only(listening([p.pid for p in procs]))
    finally:
        for p in procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0]


@pytest.mark.slow
def test_tp2_engine_listens_on_loopback_only(smollm):
    """A real TP-2 engine (gloo, one worker process per rank) on the embedded model: its store and
    gloo's pair sockets listen on loopback only, and it still generates."""
    from helpers import builtin_engine

    from detaudit.config import DecodingParams

    eng = builtin_engine(smollm, "bio", 2, "real", device="cpu", hang_timeout=300)
    try:
        pids = [p.pid for p in eng.procs]
        assert len(pids) == 2
        socks = listening(pids)
        assert_loopback_only(socks)
        assert {pid for pid, _, _ in socks} == set(pids), socks  # the store (rank 0) and gloo (both ranks)
        out = eng.generate([[1, 2, 3, 4]], ["p0"], DecodingParams(max_new_tokens=2, greedy=True), 1)
        assert len(out) == 1
        assert_loopback_only(listening(pids))
    finally:
        eng.close()


@pytest.mark.slow
def test_ray_runtime_listens_on_loopback_only(tiny_llama):
    """`--executor ray`'s private runtime (GCS, raylet, object manager, workers, the driver's core worker),
    read while a cell's engine is up in its actor: every socket on loopback."""
    from helpers import require

    ray = require("ray", "ray")
    import os

    import psutil
    from helpers import engine_options

    from detaudit.config import DecodingParams
    from detaudit.executors import CellGroup, CellJob
    from detaudit.executors.ray import RayExecutor

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    seen: dict = {}

    def progress(cell_id, event, n):
        if event == "engine" and "socks" not in seen:  # the runtime and the cell's actor are up
            seen["socks"] = listening([os.getpid()])
            seen["ray"] = {p.pid: p.name() for p in psutil.Process().children(recursive=True) if p.pid not in before}

    job = CellJob("c1", 1, ["p"], [[1, 2, 3]], "c1", DecodingParams(greedy=True, max_new_tokens=2))
    group = CellGroup(engine_options(tiny_llama, "bio+tbik", 1), [job])
    outputs = []
    RayExecutor(num_cpus=2).run([group], lambda _: None, outputs.append, progress)
    assert [o.cell_id for o in outputs] == ["c1"] and not ray.is_initialized()
    socks = seen["socks"]
    assert_loopback_only(socks)
    owners = {seen["ray"].get(pid, "") for pid, _, _ in socks}
    assert any(name.startswith(("gcs_server", "raylet")) for name in owners), (owners, socks)  # Ray's own servers
