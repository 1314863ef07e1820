"""Checks of the peer all-reduce kernels (`kernels/peer_reduce.py`), run by test_peer_reduce.py in a
subprocess with TRITON_INTERPRET=1: C ranks emulated in one process (CPU tensors stand in for the peer
buffers). Every rank's output must have the bits of the all-gather transport's reduce (rank order for
bio, the tree for bio+tbik), through the three-step and the one-shot kernels, and the two orders must
differ on these inputs (so a kernel that added in the other order would fail). The one-shot pair must
alternate the halves of its area call by call through its device epoch (which a CUDA graph replays
correctly: no host state). Exits non-zero with a message on the first failed check."""

from __future__ import annotations

import sys

import torch
from interpreter_speed import install

from detaudit.backends.allreduce import sequential_sum
from detaudit.backends.kernels import peer_reduce, tree

install()


def check(cond: bool, what: str) -> None:
    if not cond:
        sys.exit(f"FAILED: {what}")


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for c in (2, 4, 8):
        for shape in ((3, 40), (1, 7), (17, 130)):  # n not a multiple of C, n < C, several blocks of slices
            # magnitudes over six decades: the order of fp32 additions shows in the bits
            parts = [
                torch.randn(*shape, generator=g) * 10.0 ** torch.randint(-3, 3, shape, generator=g) for _ in range(c)
            ]
            rank, tree_ = sequential_sum(parts, torch.float32), tree.tree_sum(parts)
            if c >= 4 and shape != (1, 7):
                check(not torch.equal(rank, tree_), f"the orders differ on these inputs C={c} {shape}")
            for order, want in (("rank", rank), ("tree", tree_)):
                stacked = torch.stack([p.reshape(-1) for p in parts])  # as NCCL's all-gather leaves them
                got = peer_reduce.reduce_cast(stacked, torch.float32, order)
                check(torch.equal(got, want.view(-1)), f"the NCCL transport's fused sum C={c} {shape} {order}")
                for dt in (torch.bfloat16, torch.float32):
                    outs = peer_reduce.emulate(parts, dt, order)
                    ok = all(torch.equal(o, want.to(dt)) for o in outs)
                    check(ok, f"peer all-reduce bits C={c} {shape} {order} {dt}")
                    calls = 3 if dt == torch.float32 else 1
                    outs, areas, counters = peer_reduce.emulate_oneshot(parts, dt, order, calls)
                    ok = all(torch.equal(o, want.to(dt)) for o in outs)
                    check(ok, f"one-shot all-reduce bits C={c} {shape} {order} {dt} after {calls} calls")
                    check(all(k.tolist() == [calls, 0] for k in counters), f"epochs {calls}, tickets 0: {counters}")
                    n, slot = parts[0].numel(), peer_reduce.ONESHOT_MAX
                    for half in range(min(calls, 2)):  # call 1 wrote half 0, call 2 half 1 (call 3 half 0)
                        for r, p in enumerate(parts):
                            got = areas[(r + 1) % c][(half * c + r) * slot :][:n]
                            check(torch.equal(got, p.view(-1)), f"half {half} slot {r} of a peer, C={c} {shape}")
    row_all_reduce_threads(g)
    check(peer_reduce.slice_size(1, 4) == 64 and peer_reduce.slice_size(4097, 4) == 1088, "slice sizes")
    fits = peer_reduce.oneshot_fits
    check(fits(1 << 18, 2) and not fits((1 << 18) + 1, 2), "one-shot at 2 ranks: up to ONESHOT_MAX")
    check(fits(32 * 4096, 4) and not fits(64 * 4096, 4) and fits(16 * 4096, 8), "one-shot: decode batches")
    print("ok")


def row_all_reduce_threads(g: torch.Generator) -> None:
    """`PeerTransport.row_all_reduce` on C ranks emulated by C threads: the real transport code, its
    kernels under the interpreter, with what only a GPU has replaced by stand-ins (mocks): symmetric
    memory is C CPU buffers every thread can address, the device barrier a threading barrier, streams
    no-ops. Each rank's matmul is a function of its rows only (as the batch-invariant kernels are); every
    rank's result must be the fixed-order sum of the whole partials, for m not a multiple of C and slices
    that fill the areas unevenly (the areas start as NaN: no unwritten element may reach the output), and
    the rows must be asked for the other ranks' slices first. Below OVERLAP_MIN nothing may run."""
    import threading

    from detaudit.backends import peer

    class Stream:
        def wait_event(self, event):
            pass

    class Event:
        def record(self, stream=None):
            pass

    import torch.distributed._symmetric_memory as symm_mem

    saved: list[tuple[object, str, object]] = []

    def patch(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    cuda = torch.cuda
    patch(cuda, "is_current_stream_capturing", lambda: False)
    patch(cuda, "current_stream", lambda device=None: Stream())
    patch(cuda, "Stream", lambda device=None: Stream())
    patch(cuda, "set_stream", lambda s: None)
    patch(cuda, "Event", lambda: Event())
    patch(peer.PeerTransport, "_agree", lambda self, ok, device: bool(ok))
    real_min = peer.OVERLAP_MIN
    patch(peer, "OVERLAP_MIN", real_min)
    kernels = threading.Lock()  # the interpreter runs one kernel at a time
    for name in ("push", "reduce", "gather"):
        real = getattr(peer_reduce, name)

        def locked(*a, real=real, **k):
            with kernels:
                return real(*a, **k)

        patch(peer_reduce, name, locked)
    try:
        for c in (2, 4):
            n, m = 64, 4201  # past the one-shot sizes; rows ceil(m / C), the last slice short
            parts = [
                torch.randn(m, n, generator=g) * 10.0 ** torch.randint(-3, 3, (m, n), generator=g) for _ in range(c)
            ]
            bufs: dict[int, torch.Tensor] = {}
            meet = threading.Barrier(c)

            class Handle:
                def __init__(self, buf):
                    self.buf = buf

                def get_buffer(self, rank, sizes, dtype):
                    return bufs[rank].view(dtype)[: sizes[0]]

                def barrier(self, channel=0, timeout_ms=0):
                    meet.wait(timeout=60)

            def empty(nbytes, dtype, device):  # all bits set: NaN wherever nothing was written
                return torch.full((nbytes,), 255, dtype=dtype)

            def rendezvous(buf, pg, bufs=bufs, meet=meet):
                bufs[int(threading.current_thread().name)] = buf
                meet.wait(timeout=60)
                return Handle(buf)

            patch(symm_mem, "empty", empty)
            patch(peer, "_rendezvous", rendezvous)
            peer.OVERLAP_MIN = real_min  # these partials are below it
            small, touched = peer.PeerTransport(0, c), []
            got = small.row_all_reduce(m, n, torch.float32, "rank", lambda *r: touched.append(r), torch.device("cpu"))
            quiet = got is None and not touched and small.buffers is None and not small.reason
            check(quiet, f"below OVERLAP_MIN nothing runs (the caller's all_reduce does), C={c}")
            peer.OVERLAP_MIN = 0  # the threads' partials are small: take the overlapped path at every size
            for order, want in (("rank", sequential_sum(parts, torch.float32)), ("tree", tree.tree_sum(parts))):
                outs, asked = [None] * c, [[] for _ in range(c)]
                transports = [peer.PeerTransport(r, c) for r in range(c)]

                def run(r, order=order, parts=parts, outs=outs, asked=asked, transports=transports):
                    def rows_partial(r0, r1):
                        asked[r].append(r0)
                        return parts[r][r0:r1].clone()

                    outs[r] = transports[r].row_all_reduce(
                        m, n, torch.float32, order, rows_partial, torch.device("cpu")
                    )

                threads = [threading.Thread(target=run, args=(r,), name=str(r)) for r in range(c)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=300)
                rows = -(-m // c)
                for r in range(c):
                    check(outs[r] is not None and torch.equal(outs[r], want), f"row all-reduce C={c} rank {r} {order}")
                    check(asked[r] == [((r + s) % c) * rows for s in range(1, c + 1)], f"row order C={c}: {asked[r]}")
            routed_threads(c, m, n, parts, bufs, patch)
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def routed_threads(c: int, m: int, n: int, parts, bufs, patch) -> None:
    """`PeerTransport.routed_all_reduce` on the threads of `row_all_reduce_threads` (its stand-ins in
    place): each rank's `write` places its partial's tile rows as the tables say (what the Gluon kernel
    does on a GPU, here by torch indexing), then the real reduce and gather kernels run. Every rank gets
    the fixed-order sum, also where rank 0 has no routed matmul and pushes its partial with `all_reduce`
    while the others route (the two cut the same slices); below ROUTED_MIN nothing runs and the kernel is
    not even asked for."""
    import threading

    from detaudit.backends import peer

    patch(peer, "ROUTED_MIN", m * n + 1)
    asked = []
    small = peer.PeerTransport(0, c)
    got = small.routed_all_reduce(m, 128, torch.float32, "rank", lambda: asked.append(1), torch.device("cpu"))
    check(got is None and not asked and small.buffers is None, f"below ROUTED_MIN nothing runs, C={c}")
    peer.ROUTED_MIN, peer.OVERLAP_MIN = 0, 1 << 62  # the routed path at this size (both restored by the caller)
    block, padded = peer.ROUTE_ROWS, 128 * -(-n // 128)  # routed partials are whole 128-column tiles
    wide = [torch.nn.functional.pad(p, (0, padded - n)) for p in parts]
    for order, want in (("rank", sequential_sum(wide, torch.float32)), ("tree", tree.tree_sum(wide))):
        for pusher in (None, 0):
            outs = [None] * c
            transports = [peer.PeerTransport(r, c) for r in range(c)]

            def run(r, order=order, outs=outs, transports=transports, pusher=pusher):
                def write(areas, route, rows, rank):
                    tiles = rows // block
                    src = torch.cat([wide[r], torch.zeros(c * rows - m, padded)])  # past m: the kernel's zeros
                    for t in route.tolist():
                        j, u = divmod(t, tiles)
                        areas[j][rank * rows + u * block :][:block] = src[t * block : (t + 1) * block]

                tr, cpu = transports[r], torch.device("cpu")
                out = tr.routed_all_reduce(m, padded, torch.float32, order, lambda: None if r == pusher else write, cpu)
                outs[r] = tr.all_reduce(wide[r], torch.float32, order) if r == pusher else out

            threads = [threading.Thread(target=run, args=(r,), name=str(r)) for r in range(c)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=300)
            for r in range(c):
                ok = outs[r] is not None and torch.equal(outs[r], want)
                check(ok, f"routed all-reduce C={c} rank {r} {order}, rank {pusher} pushing")


if __name__ == "__main__":
    main()
