"""The NCCL transport's fused reduce + cast (`peer_reduce.reduce_cast`: what `fixed_order_all_reduce`
runs on a GPU after NCCL's all-to-all or all-gather) gives, bitwise, the op-by-op sum in the backend's
order (`sequential_sum` for bio, `tree.tree_sum` for bio+tbik) and its cast, on one GPU: the reference
the two-rank tests (test_peer_allreduce.py) compare the other transports with."""

from __future__ import annotations

import pytest
import torch
from helpers import require

from detaudit.backends.allreduce import sequential_sum
from detaudit.backends.kernels import peer_reduce, tree

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
require("triton", "triton")


@pytest.mark.parametrize("c", [2, 4, 8])
@pytest.mark.parametrize("per", [7, 4096, 3 * 1024 * 1024 + 5])
def test_reduce_cast_gives_the_op_by_op_bits(c, per):
    g = torch.Generator(device="cuda").manual_seed(c * 7 + per % 97)
    # magnitudes over six decades: an addition out of order shows in the bits
    scale = 10.0 ** torch.randint(-3, 3, (c, per), device="cuda", generator=g)
    parts = torch.randn(c, per, device="cuda", generator=g) * scale
    rows = list(parts.unbind(0))
    rank, tree_ = sequential_sum(rows, torch.float32), tree.tree_sum(rows)
    if c >= 4:
        assert not torch.equal(rank, tree_)  # the two orders differ on these inputs
    for order, want in (("rank", rank), ("tree", tree_)):
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            for _ in range(2):  # the JIT launch, then the kept plan
                assert torch.equal(peer_reduce.reduce_cast(parts, dtype, order), want.to(dtype)), (order, dtype)
