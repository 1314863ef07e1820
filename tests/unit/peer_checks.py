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

from detaudit.backends.base import sequential_sum
from detaudit.backends.kernels import peer_reduce, tree


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
    check(peer_reduce.slice_size(1, 4) == 64 and peer_reduce.slice_size(4097, 4) == 1088, "slice sizes")
    fits = peer_reduce.oneshot_fits
    check(fits(1 << 18, 2) and not fits((1 << 18) + 1, 2), "one-shot at 2 ranks: up to ONESHOT_MAX")
    check(fits(32 * 4096, 4) and not fits(64 * 4096, 4) and fits(16 * 4096, 8), "one-shot: decode batches")
    print("ok")


if __name__ == "__main__":
    main()
