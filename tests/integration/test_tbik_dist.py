"""Real TP over gloo: each rank computes its tree subtree and the backend's all-reduce combines them.
Both implementations (gather, a2a) must equal emulated TP and TP 1 bitwise."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from detaudit.engine import dist

pytestmark = pytest.mark.slow  # the real embedded model and/or worker processes


def _rank(rank, size, port, mode, x, w, out_dir):
    import os

    os.environ["DETAUDIT_TBIK_ALLREDUCE"] = mode
    torch.set_num_threads(1)
    from detaudit.backends import get_backend

    group = dist.init(rank, size, port, "cpu")
    try:
        b = get_backend("bio+tbik")
        k = w.shape[1] // size
        part = b.row_partial(x[:, rank * k : (rank + 1) * k], w[:, rank * k : (rank + 1) * k], size, name="t")
        torch.save(b.all_reduce(part, group, torch.bfloat16), f"{out_dir}/{rank}.pt")
    finally:
        dist.shutdown()


@pytest.mark.parametrize("mode", ["gather", "a2a"])
@pytest.mark.parametrize("size", [2, 4])
def test_gloo_equals_emulated(tmp_path, mode, size):
    from detaudit.backends import get_backend

    g = torch.Generator().manual_seed(size)
    x = torch.randn(19, 1536, generator=g).bfloat16()
    w = torch.randn(577, 1536, generator=g).bfloat16()  # odd N: the a2a slices need padding
    b = get_backend("bio+tbik")
    ref = b.combine([b.row_partial(x, w, 1)], torch.bfloat16)
    mp.spawn(_rank, args=(size, dist.free_port(), mode, x, w, str(tmp_path)), nprocs=size, join=True)
    for r in range(size):
        assert torch.equal(torch.load(tmp_path / f"{r}.pt"), ref), (mode, size, r)
