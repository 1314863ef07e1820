"""Real TP over gloo: each rank computes its partial (bio+tbik: its tree subtree) and the backend's
all-reduce combines them. Both transports (gather, scatter) must give the fp32 bits of the in-process
combine: TP 1 for bio+tbik, emulated TP for bio; the engine at real TP 8 equals TP 1 bitwise, in fp32 on a
tiny dense and a tiny MoE model. (Every transport's ordering logic over narrow and odd shapes, on ranks
emulated by threads: tests/unit/test_props_products.py.)"""

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
        torch.save([b.all_reduce(part, group, dt) for dt in (torch.float32, torch.bfloat16)], f"{out_dir}/{rank}.pt")
    finally:
        dist.shutdown()


@pytest.mark.parametrize(
    "backend,mode,size",
    [(b, m, s) for b in ("bio+tbik", "bio") for m in ("gather", "scatter") for s in (2, 4)] + [("bio+tbik", "nccl", 8)],
)
def test_gloo_equals_emulated(tmp_path, backend, mode, size):
    """Every rank's all-reduce, in fp32 (the sum's own bits) and rounded to bf16, equals the in-process
    combine. The partials span six decades, so a transport that added in another order would differ."""
    from detaudit.backends import get_backend

    g = torch.Generator().manual_seed(size)
    x = (torch.randn(19, 1536, generator=g) * 10.0 ** torch.randint(-3, 3, (19, 1536), generator=g)).bfloat16()
    w = torch.randn(577, 1536, generator=g).bfloat16()  # odd N: the scatter slices need padding
    b = get_backend(backend)
    k = w.shape[1] // size
    parts = [b.row_partial(x[:, r * k : (r + 1) * k], w[:, r * k : (r + 1) * k], size) for r in range(size)]
    if backend == "bio+tbik":  # TP invariant: TP 1's bits
        ref = [b.combine([b.row_partial(x, w, 1)], dt) for dt in (torch.float32, torch.bfloat16)]
        assert torch.equal(b.combine(parts, torch.float32), ref[0])
    else:  # batch invariant: emulated TP's bits at this TP size
        ref = [b.combine(parts, dt) for dt in (torch.float32, torch.bfloat16)]
    mp.spawn(_rank, args=(size, dist.free_port(), backend, mode, x, w, str(tmp_path)), nprocs=size, join=True)
    for r in range(size):
        got = torch.load(tmp_path / f"{r}.pt")
        assert all(torch.equal(a, want) for a, want in zip(got, ref)), (backend, mode, size, r)


@pytest.fixture(scope="module")
def tiny_moe(tmp_path_factory):
    """A tiny Qwen3-MoE (8 KV heads: one a rank at TP 8; experts 24 wide: 3 columns a rank; layer 1 a dense
    MLP 40 wide: 5 columns a rank)."""
    from .test_moe import build

    path = tmp_path_factory.mktemp("tp8-moe") / "qwen3-moe"
    return build("qwen3_moe", path, num_hidden_layers=2, moe_intermediate_size=24, intermediate_size=40)


@pytest.mark.parametrize("model,dtype", [("dense", "bfloat16"), ("dense", "float32"), ("moe", "float32")])
def test_real_tp8_engine_equals_tp1_bitwise(request, model, dtype):
    """Real TP 8 (eight worker processes, gloo; 8 KV heads: one per rank) under bio+tbik: every recorded
    number of every prompt (routing included) bitwise equal to TP 1 in this process, greedy and sampled,
    over prompts of different lengths in one batch. fp32: the all-reduce's own bits reach the outputs (a
    bf16 model rounds them in the residual add); the dense model's MLP is 128 wide, 16 columns a rank."""
    from helpers import builtin_engine, generation_difference, local_engine

    from detaudit.config import DecodingParams

    path = request.getfixturevalue("tiny_llama" if model == "dense" else "tiny_moe")
    prompts = [[5 + i for i in range(n)] for n in (3, 9, 17)]
    pids = ["a", "b", "c"]
    decodings = (DecodingParams(greedy=True, max_new_tokens=4), DecodingParams(max_new_tokens=4, seed=3))
    one = local_engine(path, "bio+tbik", 1, dtype=dtype)
    want = [one.generate(prompts, pids, d, 3) for d in decodings]
    eng = builtin_engine(path, "bio+tbik", 8, "real", dtype=dtype)
    try:
        assert eng.describe()["workers"] == 8
        got = [eng.generate(prompts, pids, d, 3) for d in decodings]
    finally:
        eng.close()
    for d, a, b in zip(decodings, got, want):
        assert generation_difference(a, b) is None, d
    assert generation_difference(got[0], got[1]) is not None  # sampled is not greedy: both paths were compared
    assert all((g.route_experts is not None) == (model == "moe") for g in got[0])  # MoE: routing compared too


def _await(*paths, limit_s: float = 120.0) -> bool:
    """Whether one of `paths` appears within `limit_s` (a guard against a hang, far above any real wait)."""
    import time

    deadline = time.monotonic() + limit_s
    while not any(p.exists() for p in paths):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


class _Asked:
    """Rank 0's store, marking `marker` the first time rank 0 asks whether the other ranks have left
    (`add(key, 0)`) and they have not: from then on it is waiting for them."""

    def __init__(self, store, marker, others: int) -> None:
        self.store, self.marker, self.others = store, marker, others

    def add(self, key, amount):
        value = self.store.add(key, amount)
        if amount == 0 and value < self.others:
            self.marker.touch()
        return value

    def __getattr__(self, name):
        return getattr(self.store, name)


def _leave(rank, size, port, wait, out_dir):
    """Rank 0 leaves first; rank 1 leaves (a) once rank 0 is waiting for it in `dist.shutdown` (it asked
    the store whether rank 1 left, and it had not) or has returned (`wait` long: a rank 0 that waits
    returns only after rank 1 began leaving), or (b) only after rank 0 returned (`wait` short: rank 0 must
    give up on its own). Markers in `out_dir` say what each one saw; no step waits for a time."""
    import json
    from pathlib import Path

    torch.set_num_threads(1)
    out = Path(out_dir)
    group = dist.init(rank, size, port, "cpu")
    group.barrier()
    if rank == 0:
        group.store = _Asked(group.store, out / "0.waiting", size - 1)
        dist.shutdown(group, wait_s=wait)
        seen = {"leaving_when_returned": (out / "1.leaving").exists()}
        (out / "0.returned").touch()
    else:
        if wait > 10:
            _await(out / "0.waiting", out / "0.returned")
            seen = {"waiting": (out / "0.waiting").exists() and not (out / "0.returned").exists()}
        else:
            seen = {"returned": _await(out / "0.returned")}
        (out / "1.leaving").touch()
        dist.shutdown(group, wait_s=wait)
    (out / f"{rank}.json").write_text(json.dumps(seen))


@pytest.mark.parametrize("wait", [120.0, 1.0], ids=["waits", "gives-up"])
def test_rank0_serves_the_store_until_the_others_left(tmp_path, wait):
    """`dist.shutdown(group)`: rank 0 (the store's server) returns only after every other rank has begun
    leaving its process group (NCCL's heartbeat monitor polls the store until then), and gives up after
    its wait when a rank never says so. Told by who saw whose marker, not by clocks."""
    import json

    mp.spawn(_leave, args=(2, dist.free_port(), wait, str(tmp_path)), nprocs=2, join=True)
    r0, r1 = (json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1))
    if wait > 10:
        assert r1["waiting"] and r0["leaving_when_returned"], (r0, r1)  # it waited for rank 1
    else:
        assert r1["returned"] and not r0["leaving_when_returned"], (r0, r1)  # it gave up, rank 1 still there
