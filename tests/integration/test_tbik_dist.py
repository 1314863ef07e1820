"""Real TP over gloo: each rank computes its partial (bio+tbik: its tree subtree) and the backend's
all-reduce combines them. Both transports (gather, scatter) must give the bits of the in-process combine:
TP 1 for bio+tbik, emulated TP for bio."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from detaudit.builtin import dist

pytestmark = pytest.mark.slow  # the real embedded model and/or worker processes


def _rank(rank, size, port, backend, mode, x, w, out_dir):
    import os

    os.environ["DETAUDIT_ALLREDUCE"] = mode
    torch.set_num_threads(1)
    from detaudit.backends import get_backend

    group = dist.init(rank, size, port, "cpu")
    try:
        b = get_backend(backend)
        k = w.shape[1] // size
        part = b.row_partial(x[:, rank * k : (rank + 1) * k], w[:, rank * k : (rank + 1) * k], size, name="t")
        torch.save(b.all_reduce(part, group, torch.bfloat16), f"{out_dir}/{rank}.pt")
    finally:
        dist.shutdown()


@pytest.mark.parametrize("backend", ["bio+tbik", "bio"])
@pytest.mark.parametrize("mode", ["gather", "scatter"])
@pytest.mark.parametrize("size", [2, 4])
def test_gloo_equals_emulated(tmp_path, backend, mode, size):
    from detaudit.backends import get_backend

    g = torch.Generator().manual_seed(size)
    x = torch.randn(19, 1536, generator=g).bfloat16()
    w = torch.randn(577, 1536, generator=g).bfloat16()  # odd N: the scatter slices need padding
    b = get_backend(backend)
    k = w.shape[1] // size
    if backend == "bio+tbik":  # TP invariant: TP 1's bits
        ref = b.combine([b.row_partial(x, w, 1)], torch.bfloat16)
    else:  # batch invariant: emulated TP's bits at this TP size
        parts = [b.row_partial(x[:, r * k : (r + 1) * k], w[:, r * k : (r + 1) * k], size) for r in range(size)]
        ref = b.combine(parts, torch.bfloat16)
    mp.spawn(_rank, args=(size, dist.free_port(), backend, mode, x, w, str(tmp_path)), nprocs=size, join=True)
    for r in range(size):
        assert torch.equal(torch.load(tmp_path / f"{r}.pt"), ref), (backend, mode, size, r)


def _leave(rank, size, port, delay, wait, out_dir):
    import json
    import time

    torch.set_num_threads(1)
    group = dist.init(rank, size, port, "cpu")
    group.barrier()
    time.sleep(delay if rank == 1 else 0.0)  # rank 1 lets go of its group late
    start = time.time()
    dist.shutdown(group, wait_s=wait)
    with open(f"{out_dir}/{rank}.json", "w") as f:
        json.dump({"start": start, "end": time.time()}, f)


@pytest.mark.parametrize("delay,wait", [(1.0, 30.0), (6.0, 1.0)])
def test_rank0_serves_the_store_until_the_others_left(tmp_path, delay, wait):
    """`dist.shutdown(group)`: rank 0 (the store's server) returns only after every other rank has begun
    leaving its process group (NCCL's heartbeat monitor polls the store until then), and gives up after
    its wait when a rank never says so."""
    import json

    mp.spawn(_leave, args=(2, dist.free_port(), delay, wait, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    if wait > delay:
        assert r0["end"] >= r1["start"], (r0, r1)  # it waited for rank 1
    else:
        assert r0["end"] < r1["start"] and r0["end"] - r0["start"] < delay, (r0, r1)  # it gave up
