"""The peer-memory all-reduce on real GPUs (2 and 4 ranks where the machine has them): bitwise the
all-gather transport's result for bio (rank order) and bio+tbik (tree), eager and replayed from a CUDA
graph, at decode and prefill sizes, through buffer growths, on every rank; a graph captured before a
growth still replays afterwards (the outgrown buffer is kept: freeing it crashed `bench e2e`); the
one-shot path of decode sizes alternates its halves through a device epoch, so a graph of an odd number
of calls replayed between eager calls stays exact (a parity kept on the host would reuse a half that a
slower rank may still be reading)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2+ CUDA devices")]

SIZES = [(3, 7), (8, 4096), (33, 4096), (513, 4096), (4096, 4096), (16, 4096), (16384, 4096)]  # grows, shrinks


def _rank(rank, size, port, out_dir):
    from detaudit.backends import allreduce, get_backend
    from detaudit.builtin import dist

    torch.cuda.set_device(rank)
    group = dist.init(rank, size, port, f"cuda:{rank}")
    bad = []
    try:
        g = torch.Generator(device="cuda").manual_seed(100 + rank)
        graphs = []  # (graph, its static input, its output, backend) of every size, replayed again at the end
        for name in ("bio", "bio+tbik"):
            b = get_backend(name)

            def run(p, mode, b=b):
                return allreduce.fixed_order_all_reduce(p, group, torch.bfloat16, b._reduce, mode, b.REDUCE_ORDER)

            for shape in SIZES:
                # magnitudes over six decades: an addition out of order shows in the bits
                p = torch.randn(*shape, device="cuda", generator=g) * 10.0 ** torch.randint(
                    -3, 3, shape, device="cuda", generator=g
                )
                want = run(p, "gather")
                if not torch.equal(run(p, "peer"), want):
                    bad.append(f"{name} eager {shape}")
                static = p.clone()  # captured at this size (the buffer fits: allocated by the eager call)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                    out = run(static, "peer")
                for _ in range(3):  # new partials through the same graph
                    static.copy_(torch.randn(*shape, device="cuda", generator=g))
                    graph.replay()
                    if not torch.equal(out, run(static.clone(), "gather")):
                        bad.append(f"{name} graph {shape}")
                graphs.append((graph, static, out, run, f"{name} {shape}"))
        for graph, static, out, run, what in graphs:  # captured on buffers outgrown since
            static.copy_(torch.randn(*static.shape, device="cuda", generator=g))
            graph.replay()
            if not torch.equal(out, run(static.clone(), "gather")):
                bad.append(f"graph replayed after growth {what}")
        b = get_backend("bio+tbik")

        def run(p, mode, b=b):
            return allreduce.fixed_order_all_reduce(p, group, torch.bfloat16, b._reduce, mode, b.REDUCE_ORDER)

        statics = [torch.randn(8, 4096, device="cuda", generator=g) for _ in range(3)]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            outs = [run(x, "peer") for x in statics]
        for i in range(4):
            for x in statics:
                x.copy_(torch.randn(8, 4096, device="cuda", generator=g) * 10.0 ** (i - 2))
            graph.replay()
            if not all(torch.equal(o, run(x.clone(), "gather")) for o, x in zip(outs, statics)):
                bad.append(f"odd graph of one-shot calls, replay {i}")
            x = torch.randn(16, 4096, device="cuda", generator=g)
            if not torch.equal(run(x, "peer"), run(x, "gather")):
                bad.append(f"eager one-shot call after replay {i}")
        transport = group._peer
        assert transport is not None and transport.buffers is not None, transport and transport.reason
        assert transport.oneshot is not None
    finally:
        dist.shutdown(group)
    with open(f"{out_dir}/{rank}.txt", "w") as f:
        f.write("\n".join(bad) or "ok")


def _spawn_and_check(rank_fn, size, tmp_path):
    """Run rank_fn(rank, size, port, out_dir) on `size` processes; each rank writes "ok" or what failed."""
    from detaudit.builtin.dist import free_port

    mp.spawn(rank_fn, args=(size, free_port(), str(tmp_path)), nprocs=size, join=True)
    for r in range(size):
        assert (tmp_path / f"{r}.txt").read_text() == "ok", (r, (tmp_path / f"{r}.txt").read_text())


@pytest.mark.parametrize("size", [n for n in (2, 4) if n <= torch.cuda.device_count()])
def test_peer_allreduce_gives_the_gather_bits(tmp_path, size):
    _spawn_and_check(_rank, size, tmp_path)


# (rows, a rank's K): every kernel path, with OVERLAP_MIN lowered to 0, and one shape past the real one
ROW_SHAPES = [(300, 1024), (1030, 3072), (4096, 1024), (4097, 3072)]
ROW_SHAPE_PAST_MIN = (8200, 1024)


@contextlib.contextmanager
def _overlap_min(value):
    """peer.OVERLAP_MIN set to `value` for the block."""
    from detaudit.backends import peer

    kept, peer.OVERLAP_MIN = peer.OVERLAP_MIN, value
    try:
        yield
    finally:
        peer.OVERLAP_MIN = kept


def _row_rank(rank, size, port, out_dir):
    """A row-parallel layer through `row_group` (each owner's rows computed, then copied to it while
    the next rows are computed) against the same layer's partial all-gathered and reduced: bitwise on
    every rank for bio and bio+tbik, eagerly (the overlapped path) and inside a CUDA graph (where the
    layer takes `all_reduce`)."""
    from detaudit.backends import allreduce, get_backend, peer
    from detaudit.builtin import dist

    torch.cuda.set_device(rank)
    group = dist.init(rank, size, port, f"cuda:{rank}")
    bad = []
    try:
        g = torch.Generator(device="cuda").manual_seed(7 + rank)
        for name in ("bio", "bio+tbik"):
            b = get_backend(name)

            def want(x, w, b=b):
                p = b.row_partial(x, w, size)
                return allreduce.fixed_order_all_reduce(p, group, torch.bfloat16, b._reduce, "gather", b.REDUCE_ORDER)

            for (m, k), least in [*((s, 0) for s in ROW_SHAPES), (ROW_SHAPE_PAST_MIN, peer.OVERLAP_MIN)]:
                x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
                w = (torch.randn(4096, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
                calls = []
                b.row_partial = lambda *a, b=b, calls=calls, **kw: calls.append(1) or type(b).row_partial(b, *a, **kw)
                with _overlap_min(least):
                    got = b.row_group(x, w, group, torch.bfloat16)
                del b.row_partial
                if not torch.equal(got, want(x, w)):
                    bad.append(f"{name} eager {m}x{k}")
                if len(calls) != size:  # one matmul per slice owner: the overlapped path ran
                    bad.append(f"{name} {m}x{k}: {len(calls)} matmuls, not the overlapped path's {size}")
            static = torch.randn(300, 1024, device="cuda", generator=g).to(torch.bfloat16)
            w = (torch.randn(4096, 1024, device="cuda", generator=g) / 32).to(torch.bfloat16)
            graph = torch.cuda.CUDAGraph()
            with _overlap_min(0), torch.cuda.graph(graph, capture_error_mode="thread_local"):
                out = b.row_group(static, w, group, torch.bfloat16)  # only the capture check decides
            for _ in range(3):
                static.copy_(torch.randn(300, 1024, device="cuda", generator=g).to(torch.bfloat16))
                graph.replay()
                if not torch.equal(out, want(static.clone(), w)):
                    bad.append(f"{name} graph")
    finally:
        dist.shutdown(group)
    with open(f"{out_dir}/{rank}.txt", "w") as f:
        f.write("\n".join(bad) or "ok")


@pytest.mark.parametrize("size", [n for n in (2, 4) if n <= torch.cuda.device_count()])
def test_row_all_reduce_overlapped_gives_the_gather_bits(tmp_path, size):
    _spawn_and_check(_row_rank, size, tmp_path)


def _routed_rank(rank, size, port, out_dir):
    """bio+tbik's row-parallel layer on Hopper where the Gluon tree kernel stores each slice owner's rows
    straight into this rank's slot of the owner's receive area (`routed_all_reduce`; ROUTED_MIN lowered to
    0 for the small shapes), with row counts that leave owners' slots part empty or wholly empty: bitwise
    the all-gather's result on every rank, the routed path taken (its kernel ran once), twice in a row
    (the areas of one call reused by the next); at the real ROUTED_MIN a prefill of 4096 rows takes it and
    one of 1000 rows does not."""
    from detaudit.backends import allreduce, get_backend, peer
    from detaudit.backends.kernels import gluon_tree
    from detaudit.builtin import dist

    torch.cuda.set_device(rank)
    group = dist.init(rank, size, port, f"cuda:{rank}")
    bad = []
    real_min = peer.ROUTED_MIN
    real = gluon_tree.tree_mm_routed
    routed = []
    gluon_tree.tree_mm_routed = lambda *a, **kw: routed.append(1) or real(*a, **kw)
    try:
        g = torch.Generator(device="cuda").manual_seed(11 + rank)
        b = get_backend("bio+tbik")
        cases = [(s, 0, 1) for s in (*ROW_SHAPES, (257, 1024))] + [
            ((4096, 1024), real_min, 1),
            ((1000, 1024), real_min, 0),
        ]
        for (m, k), least, runs in cases:
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            w = (torch.randn(4096, k, device="cuda", generator=g) / k**0.5).to(torch.bfloat16)
            p = b.row_partial(x, w, size)
            want = allreduce.fixed_order_all_reduce(p, group, torch.bfloat16, b._reduce, "gather", b.REDUCE_ORDER)
            peer.ROUTED_MIN = least
            for call in range(2):
                routed.clear()
                got = b.row_group(x, w, group, torch.bfloat16)
                if not torch.equal(got, want):
                    bad.append(f"routed {m}x{k} call {call}")
                if len(routed) != runs:
                    bad.append(f"{m}x{k}: the routed kernel ran {len(routed)} times, not {runs}")
    finally:
        gluon_tree.tree_mm_routed = real
        peer.ROUTED_MIN = real_min
        dist.shutdown(group)
    with open(f"{out_dir}/{rank}.txt", "w") as f:
        f.write("\n".join(bad) or "ok")


@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability(0)[0] != 9, reason="the Gluon kernel is Hopper's"
)
@pytest.mark.parametrize("size", [n for n in (2, 4) if n <= torch.cuda.device_count()])
def test_routed_row_all_reduce_gives_the_gather_bits(tmp_path, size):
    _spawn_and_check(_routed_rank, size, tmp_path)
