"""`peer.route_tables`: where the routed matmul of `PeerTransport.routed_all_reduce` stores a rank's
partial. Placing every tile row as the tables say (what the Gluon kernel does on a GPU, here by torch
indexing on CPU) must leave each owner's area holding, at every element the reduce reads, what `push`
would have put there; every tile row of the schedule is computed once; the tile rows a rank computes
together go to all owners alike, its successor first."""

from __future__ import annotations

import pytest
import torch

from detaudit.backends.peer import route_tables


@pytest.mark.parametrize("c", [2, 4, 8])
@pytest.mark.parametrize("m", [1, 127, 300, 1000, 4096, 4097])
def test_routed_tiles_land_where_push_puts_them(c, m):
    block, n = 16, 8  # small tiles: the same arithmetic as 128 x 128
    g = torch.Generator().manual_seed(m * 10 + c)
    for rank in range(c):
        rows, route = route_tables(m, c, rank, block)
        assert rows % block == 0 and c * rows >= m and rows - block < -(-m // c)  # the fewest whole tiles
        tiles = rows // block
        assert sorted(route) == list(range(c * tiles))  # each tile row of the slices computed once
        owners = [t // tiles for t in route]
        for i in range(0, len(route), c):  # c consecutive tile rows: one per owner, successor first
            assert owners[i : i + c] == [(rank + 1 + j) % c for j in range(c)]
        partial = torch.randn(m, n, generator=g)
        padded = torch.cat([partial, torch.zeros(c * rows - m, n)])  # rows past m: the kernel's zeros
        areas = [torch.full((c * rows, n), float("nan")) for _ in range(c)]
        for i, t in enumerate(route):
            j, u = divmod(t, tiles)
            at = rank * rows + u * block
            areas[j][at : at + block] = padded[t * block : (t + 1) * block]
        per = rows * n
        flat = partial.reshape(-1)
        for j in range(c):  # push: slice j of the flat partial (per elements) into slot `rank` of area j
            want = flat[j * per : (j + 1) * per]
            got = areas[j].reshape(-1)[rank * per : rank * per + want.numel()]
            assert torch.equal(got, want), (rank, j)
