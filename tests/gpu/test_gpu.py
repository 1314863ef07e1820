"""GPU checks at real shapes (skipped without CUDA): the Triton kernels' batch and TP invariance, the
bio row ops and attention on CUDA, and the engine on the embedded model with NCCL when 2+ GPUs exist."""

from __future__ import annotations

import pytest
import torch
from helpers import require

from detaudit.backends import get_backend
from detaudit.backends.kernels import fixed

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
triton = require("triton", "triton")

SHAPES = [(576, 1536), (1536, 576), (576, 49152), (4096, 4096), (6144, 2048)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,n", SHAPES)
def test_matmul_prefix_invariant(k, n, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(256, k, device="cuda", generator=g).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=g).to(dtype)
    full = fixed.matmul(a, w)
    for m in range(1, 257):
        assert torch.equal(fixed.matmul(a[:m], w), full[:m]), m
    for start in (1, 77, 130):  # a row's bits do not depend on its slot in the tile
        assert torch.equal(fixed.matmul(a[start : start + 5], w), full[start : start + 5]), start
    ref = a.double() @ w.double().t()  # of the rounded inputs: only the kernel's own rounding is measured
    # fp32 accumulation in both dtypes (bf16 products are exact in fp32; fp32 inputs use no TF32, which
    # would be ~1e-3 off): fp32 rounding over K <= 4096 terms stays well under 1e-5 relative
    assert ((full.double() - ref).norm() / ref.norm()) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", SHAPES + [(1024, 1000)])  # N = 1000: the last column tile is partial
def test_every_tiling_gives_the_same_bits(k, n, dtype):
    """The output tiling follows M (the swapped kernel for decode sizes, narrow tiles for few rows, wide
    ones for many); the reduction does not, so products computed under different tilings agree bitwise,
    plain and tree. x's columns are scaled over a wide exponent range, so the products an MMA adds differ
    in size by up to 2^60 (bf16; 2^8 for fp16, whose range is narrow)."""
    from detaudit.backends.kernels import triton_mm

    g = torch.Generator(device="cuda").manual_seed(4)
    span = 30 if dtype == torch.bfloat16 else 4
    scale = torch.exp2(torch.randint(-span, span + 1, (1, k), device="cuda", generator=g).float())
    a = (torch.randn(2100, k, device="cuda", generator=g) * scale).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=g).to(dtype)
    full = fixed.matmul(a, w, out_dtype=dtype)  # the large-M tiling
    tree_full = triton_mm.mm(a, w, leaves=8)
    for tree in (False, True):  # decode sizes take the swapped kernel (`triton_swap`), both tile heights
        assert triton_mm.tiling(dtype, 8, tree, n).get("SWAP") and triton_mm.tiling(dtype, 32, tree, n)["BLOCK_M"] == 32
    for m in (1, 8, 16, 17, 32, 33, 64, 65, 300, 1024, 1025, 2048):
        assert torch.equal(fixed.matmul(a[:m], w, out_dtype=dtype), full[:m]), m
        assert torch.equal(triton_mm.mm(a[:m], w, leaves=8), tree_full[:m]), m
        if m <= 32:  # a transposed weight view (the swapped kernel's strided loads)
            assert torch.equal(triton_mm.mm(a[:m], w.t().contiguous().t(), leaves=8), tree_full[:m]), m
    assert torch.equal(fixed.matmul(a[1000:1005], w, out_dtype=dtype), full[1000:1005])


@pytest.mark.parametrize("k,n", [(2048, 1536), (768, 2048), (96, 2048)])
def test_batched_expert_tiling_gives_the_per_expert_bits(k, n):
    """A MoE decode step's batched expert products (`batched_tiling`: 64-column tiles, BLOCK_K 32 at a
    tree leaf's short K) give each expert's rows the bits of that expert's own 2-D product under the
    ordinary tilings (what the per-expert layout of prefill computes), for contiguous operands and for a
    leaf's strided K slice."""
    from detaudit.backends.kernels import triton_mm

    g = torch.Generator(device="cuda").manual_seed(7)
    x = torch.randn(16, 8, 2 * k, device="cuda", generator=g).bfloat16()
    w = torch.randn(16, n, 2 * k, device="cuda", generator=g).bfloat16()
    assert triton_mm.batched_tiling(torch.bfloat16, 16, 8, k) is not None
    for xs, ws in ((x[..., :k].contiguous(), w[..., :k].contiguous()), (x[..., k:], w[..., k:])):
        out = triton_mm.mm(xs, ws)
        for e in range(16):
            assert torch.equal(out[e], triton_mm.mm(xs[e].contiguous(), ws[e])), e
            assert torch.equal(out[e, :3], triton_mm.mm(xs[e, :3].contiguous(), ws[e])), e


def test_grouped_expert_products_give_the_per_expert_bits():
    """A MoE prefill's grouped launches (`grouped_mm`, 64-row blocks of one expert) at Qwen3-30B-A3B's
    expert shapes give every row the bits of its expert's own product by `triton_mm.mm` (whose tiling
    follows the run's length: narrow, mid and TMA tiles all occur), the down product's leaves included;
    `weighted_tree` gives the bits of the torch ops it replaces."""
    from detaudit.backends.bio import weighted_experts
    from detaudit.backends.kernels import grouped_mm, tree, triton_mm

    g = torch.Generator(device="cuda").manual_seed(11)
    t, k, e, h, inter = 600, 8, 128, 2048, 768
    # skewed routing: low experts get long runs (TMA tiles), high ones a few rows or none
    scores = torch.rand(t, e, device="cuda", generator=g) * torch.linspace(4, 1, e, device="cuda") ** 3
    experts = scores.topk(k).indices
    runs = grouped_mm.Runs(experts, e)
    order, counts = runs.order, torch.bincount(experts.reshape(-1), minlength=e).tolist()
    x = torch.randn(t, h, device="cuda", generator=g).bfloat16()
    w_gu = torch.randn(e, 2 * inter, h, device="cuda", generator=g).bfloat16() / 32
    gu = grouped_mm.grouped(x, (order // k).int(), w_gu, runs, runs.identity, t * k, out_dtype=torch.bfloat16)
    act = torch.randn(t * k, inter, device="cuda", generator=g).bfloat16()
    w_down = torch.randn(e, h, inter, device="cuda", generator=g).bfloat16() / 32
    down = grouped_mm.grouped(act, runs.identity, w_down, runs, order.int(), t * k)
    w_leaf = w_down.view(e, h, 8, 96).transpose(1, 2).contiguous()
    by_leaf = grouped_mm.grouped(act, runs.identity, w_leaf, runs, order.int(), t * k)
    one_leaf = w_down.view(e, 1, h, inter)  # a TP-8 rank's single leaf, leaf-major
    assert torch.equal(grouped_mm.grouped(act, runs.identity, one_leaf, runs, order.int(), t * k), down[None])
    start = 0
    for ex, n in enumerate(counts):
        rows = order[start : start + n]
        a = act[start : start + n]
        assert torch.equal(gu[start : start + n], triton_mm.mm(x[rows // k], w_gu[ex], out_dtype=torch.bfloat16)), ex
        assert torch.equal(down[rows], triton_mm.mm(a, w_down[ex])), ex
        assert torch.equal(by_leaf[:, rows], triton_mm.mm(a.view(n, 8, 96).transpose(0, 1), w_leaf[ex])), ex
        start += n
    gates = torch.rand(t, k, device="cuda", generator=g)
    y = by_leaf.view(8, t, k, h)
    assert torch.equal(grouped_mm.weighted_tree(y, gates), tree.pairwise(weighted_experts(y, gates)))
    assert torch.equal(grouped_mm.weighted_tree(y[0], gates), weighted_experts(y[0], gates))


@pytest.mark.parametrize("k,n", SHAPES)
def test_bf16_epilogue_rounds_like_a_cast(k, n):
    """bio's linear stores bf16 from the kernel: the same bits as casting the fp32 result, and still
    batch invariant."""
    g = torch.Generator(device="cuda").manual_seed(2)
    a = torch.randn(300, k, device="cuda", generator=g).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    full = fixed.matmul(a, w, out_dtype=torch.bfloat16)
    assert full.dtype == torch.bfloat16
    assert torch.equal(full, fixed.matmul(a, w).to(torch.bfloat16))
    for m in (1, 7, 64, 129, 256):
        assert torch.equal(fixed.matmul(a[:m], w, out_dtype=torch.bfloat16), full[:m]), m


@pytest.mark.parametrize("k,n", [(576, 1536), (1000, 576), (4096, 4096)])
def test_tma_and_pointer_paths_give_the_same_bits(k, n):
    """The bf16 config loads through TMA on Hopper and falls back to pointer loads elsewhere (batched,
    misaligned or transposed operands): the two paths, and a transposed weight view, agree bitwise."""
    from detaudit.backends.kernels import triton_mm

    g = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(300, k, device="cuda", generator=g).bfloat16()
    w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
    cfg = triton_mm.CONFIGS[torch.bfloat16]
    ptr = dict(cfg, TMA=0)
    tma = triton_mm.mm(a, w, config=cfg, out_dtype=torch.bfloat16)
    assert torch.equal(tma, triton_mm.mm(a, w, config=ptr, out_dtype=torch.bfloat16))
    assert torch.equal(tma, triton_mm.mm(a, w.t().contiguous().t(), config=cfg, out_dtype=torch.bfloat16))
    assert torch.equal(
        tma, triton_mm.mm(a.unsqueeze(0).expand(2, -1, -1), w, config=cfg, out_dtype=torch.bfloat16)[1]
    )  # batched: pointer path
    if (k // 8) % 64 == 0:  # leaves of whole BLOCK_K steps: the TMA tree path
        tcfg = dict(triton_mm.TREE_CONFIGS[torch.bfloat16], TMA=1, GLUON=0)
        assert torch.equal(triton_mm.mm(a, w, leaves=8, config=tcfg), triton_mm.mm(a, w, leaves=8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,n", [(1536, 576), (4096, 4096), (6144, 2048)])
def test_gluon_tree_kernel_gives_the_triton_bits(k, n, dtype):
    """On Hopper the tree's large-M tiling runs the warp-specialised Gluon kernel: bitwise the Triton
    tree kernel's result for every leaf count (TP 1/2/4/8 subtrees), ragged M and N (padded tiles), a
    transposed weight view, row prefixes, and rounded to the model dtype in the store."""
    from detaudit.backends.kernels import gluon_tree, triton_mm

    g = torch.Generator(device="cuda").manual_seed(5)
    a = torch.randn(2049, k, device="cuda", generator=g).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=g).to(dtype)
    if not gluon_tree.supports(a, w, 8):
        pytest.skip("the Gluon kernel needs Triton's Gluon and a Hopper GPU")
    triton_cfg = dict(triton_mm.TREE_CONFIGS[dtype], GLUON=0)
    for leaves in (8, 4, 2, 1):
        kl = k * leaves // 8  # a rank's columns at TP 8 / leaves
        x, wl = a[:, :kl].contiguous(), w[:, :kl]
        ref = triton_mm.mm(x, wl, leaves=leaves, tree=True, config=triton_cfg)
        out = gluon_tree.tree_mm(x, wl, leaves)
        assert torch.equal(out, ref), leaves
        # a TP-1 layer's tree rounded in the store (both kernels): the fp32 result's cast, bit for bit
        assert torch.equal(gluon_tree.tree_mm(x, wl, leaves, out_dtype=dtype), ref.to(dtype)), leaves
        rounded = triton_mm.mm(x, wl, leaves=leaves, tree=True, config=triton_cfg, out_dtype=dtype)
        assert rounded.dtype == dtype and torch.equal(rounded, ref.to(dtype)), leaves
        assert torch.equal(gluon_tree.tree_mm(x, wl.t().contiguous().t(), leaves), ref), leaves
        for m in (257, 1000, 2048):
            assert torch.equal(gluon_tree.tree_mm(x[:m], wl, leaves), ref[:m]), (leaves, m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,n", [(1536, 576), (4096, 4096), (6144, 2048)])
def test_tree_tp_invariant(k, n, dtype):
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(300, k, device="cuda", generator=g).to(dtype)
    w = torch.randn(n, k, device="cuda", generator=g).to(dtype)
    b = get_backend("bio+tbik")
    one = b.combine([b.row_partial(x, w, 1)], dtype)
    for c in (2, 4, 8):
        kc = k // c
        parts = [b.row_partial(x[:, r * kc : (r + 1) * kc], w[:, r * kc : (r + 1) * kc], c) for r in range(c)]
        assert torch.equal(b.combine(parts, dtype), one), c
        assert torch.equal(b.combine([p[:7] for p in parts], dtype), one[:7])
        for m in (7, 32):  # a decode step's rows: each rank's subtree by the swapped kernel (bf16)
            few = [b.row_partial(x[:m, r * kc : (r + 1) * kc], w[:, r * kc : (r + 1) * kc], c) for r in range(c)]
            assert torch.equal(b.combine(few, dtype), one[:m]), (c, m)


def test_row_ops_and_attention_on_cuda():
    b = get_backend("bio")
    g = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(64, 576, device="cuda", generator=g).bfloat16()
    wt = torch.randn(576, device="cuda", generator=g).bfloat16()
    full = b.rms_norm(x, wt, 1e-5)
    assert all(torch.equal(b.rms_norm(x[:m], wt, 1e-5), full[:m]) for m in (1, 3, 33))
    logits = torch.randn(40, 49152, device="cuda", generator=g) * 4
    lp = b.log_softmax(logits)
    assert all(torch.equal(b.log_softmax(logits[:m]), lp[:m]) for m in (1, 9))
    q = torch.randn(2, 24, 150, 64, device="cuda", generator=g).bfloat16()
    k = torch.randn(2, 8, 150, 64, device="cuda", generator=g).bfloat16()
    v = torch.randn(2, 8, 150, 64, device="cuda", generator=g).bfloat16()
    pos = torch.arange(150, device="cuda").expand(2, 150)
    pre = b.attention(q, k, v, pos, 0.125)
    for t in (0, 63, 64, 149):
        step = b.attention(q[:, :, t : t + 1], k[:, :, : t + 1], v[:, :, : t + 1], pos[:, t : t + 1], 0.125)
        assert torch.equal(step, pre[:, :, t : t + 1]), t
    ref = get_backend("bf16").attention(q.float(), k.float(), v.float(), pos, 0.125)
    assert torch.allclose(pre.float(), ref, atol=2e-2)


def _model(name: str):
    """A named model, prepared if need be. On a GPU machine a model that cannot be prepared fails the
    tests that need it (it never skips them: a skipped engine test would read as a passed GPU audit).
    Air-gapped: DETAUDIT_WHEEL_DIR, a folder holding the embedded model's wheel."""
    from detaudit.models import resolve_model

    return resolve_model(name, auto_prepare=True)


def _real_tps() -> list[int]:
    """The real TP sizes this machine's GPUs allow, up to the largest (8 on an 8-GPU machine)."""
    return [tp for tp in (2, 4, 8) if tp <= torch.cuda.device_count()]


@pytest.fixture(scope="module")
def smollm_gpu():
    return _model("smollm2-135m")


def _smoke(model):
    from detaudit.inputs.prepare import tokenizer_for
    from detaudit.inputs.suites import load_suite, prompt_token_ids

    suite = load_suite("smoke")
    tok = tokenizer_for(model.path)
    return [prompt_token_ids(tok, p) for p in suite.prompts] * 4, [
        f"{p.id}#{r}" for r in range(4) for p in suite.prompts
    ]


def _out(gens):
    """Every recorded number of every generation (float lists compare equal only value for value)."""
    return [(g.token_ids, g.token_logprobs, g.topk_ids, g.topk_logprobs) for g in gens]


def test_engine_bio_batch_and_tbik_tp_invariant_on_gpu(smollm_gpu):
    from helpers import builtin_engine

    from detaudit.config import DecodingParams

    ids, pids = _smoke(smollm_gpu)
    dec = DecodingParams(max_new_tokens=32)
    ref = builtin_engine(smollm_gpu, "bio", 1, "real", device="cuda").generate(ids[:8], pids[:8], dec, 1)
    for bs in (8, 16, 32):
        eng = builtin_engine(smollm_gpu, "bio", 1, "real", device="cuda")
        assert _out(eng.generate(ids, pids, dec, bs)[:8]) == _out(ref), bs
    tref = builtin_engine(smollm_gpu, "bio+tbik", 1, "real", device="cuda").generate(ids, pids, dec, 32)
    for tp in (2, 4, 8):
        got = builtin_engine(smollm_gpu, "bio+tbik", tp, "emulated", device="cuda").generate(ids, pids, dec, 8)
        assert _out(got) == _out(tref), tp
    for tp in _real_tps():  # real NCCL TP, up to the largest this machine has
        eng = builtin_engine(smollm_gpu, "bio+tbik", tp, "real", device="cuda")
        try:
            assert _out(eng.generate(ids, pids, dec, 16)) == _out(tref), f"real NCCL TP {tp}"
        finally:
            eng.close()


def test_cuda_graph_decode_matches_eager(smollm_gpu, capsys):
    """Decode replayed from a CUDA graph (whole cache attended, masked) gives the same bits as eager decode
    under bio and bio+tbik; the graph is reused across batches of one size. bf16 is reported."""
    from helpers import local_engine

    from detaudit.config import DecodingParams

    ids, pids = _smoke(smollm_gpu)
    dec = DecodingParams(max_new_tokens=24)
    report = {}
    for backend in ("bio", "bio+tbik", "bf16"):
        eager = local_engine(smollm_gpu, backend, 1, device="cuda", cuda_graphs=False).generate(
            ids[:16], pids[:16], dec, 8
        )
        eng = local_engine(smollm_gpu, backend, 1, device="cuda", cuda_graphs=True)
        assert eng.describe()["cuda_graphs"]
        graphed = eng.generate(ids[:16], pids[:16], dec, 8)  # two batches of 8: one capture, two replays
        assert eng.last_timings["cuda_graphs"] and len(eng.generator._graphs) == 1
        if backend == "bf16":
            report[backend] = sum(a != b for a, b in zip(_out(graphed), _out(eager)))
            continue
        assert _out(graphed) == _out(eager), backend
    with capsys.disabled():
        print(f"\n[cuda graphs] bf16 prompts (of 16) whose outputs differ graphed vs eager: {report['bf16']}")


def test_qwen3_8b_shaped_model_on_gpu():
    """The synthetic Qwen3-8B-shaped model at real size: bio is batch invariant, bio+tbik at emulated TP 2
    equals TP 1 (greedy, 8 tokens, random prompts)."""
    import gc

    from helpers import local_engine

    from detaudit.bench.e2e import random_prompts
    from detaudit.config import DecodingParams

    ref = _model("qwen3-8b-shaped")
    prompts = random_prompts(4, 80, 151936, seed=1)
    pids = [str(i) for i in range(4)]
    dec = DecodingParams(greedy=True, max_new_tokens=8)

    def run(backend, tp, bs):
        eng = local_engine(ref, backend, tp, emulated=tp > 1, device="cuda")
        try:
            return _out(eng.generate(prompts, pids, dec, bs))
        finally:
            del eng
            gc.collect()
            torch.cuda.empty_cache()

    assert run("bio", 1, 1) == run("bio", 1, 4)
    assert run("bio+tbik", 1, 4) == run("bio+tbik", 2, 4)


def test_kept_launch_plans_give_the_jit_bits():
    """The wrappers launch a kept compiled kernel after the first call of a plan key (`kernels/launch`):
    every path (small-M pointer, mid-M, TMA large-M, tree pointer, Gluon tree, row sums, attention) gives
    bitwise the result of a JIT launch with an explicit config (which never uses plans), for aligned and
    misaligned operands, and a second call is served by the plan."""
    from detaudit.backends.kernels import gluon_tree, triton_attn, triton_mm, triton_rows

    g = torch.Generator(device="cuda").manual_seed(6)
    a = torch.randn(2100, 4096, device="cuda", generator=g).bfloat16()
    w = torch.randn(2048, 4096, device="cuda", generator=g).bfloat16()
    triton_mm._PLANS.clear()
    for m in (1, 8, 64, 200, 1500):
        for x in (a[:m], a[1 : m + 1]):  # 16-byte aligned and not (a 2-byte offset: the pointer path)
            bf16, fp32 = torch.bfloat16, torch.float32  # a TP-1 layer's tree is rounded in the store
            for leaves, tree, out_dtype in ((1, False, bf16), (8, True, fp32), (4, True, fp32), (8, True, bf16)):
                xx = x[:, : 4096 * leaves // 8] if tree else x
                ww = w[:, : 4096 * leaves // 8] if tree else w
                if tree:
                    xx = xx.contiguous() if x.data_ptr() % 16 == 0 else xx
                cfg = triton_mm.tiling(torch.bfloat16, m, tree, 2048)
                if tree and cfg.get("GLUON") and gluon_tree.supports(xx, ww, leaves):
                    # cfg given: no plan kept
                    ref = gluon_tree.tree_mm(xx, ww, leaves, cfg={}, out_dtype=out_dtype).contiguous()
                else:
                    ref = triton_mm.mm(xx, ww, leaves, config=cfg, tree=tree, out_dtype=out_dtype)
                first = triton_mm.mm(xx, ww, leaves, tree=tree, out_dtype=out_dtype)
                plans = len(triton_mm._PLANS)
                second = triton_mm.mm(xx, ww, leaves, tree=tree, out_dtype=out_dtype)
                assert len(triton_mm._PLANS) == plans  # served by the kept plan
                assert torch.equal(first, ref) and torch.equal(second, ref), (m, leaves, x.data_ptr() % 16)
    assert triton_mm._PLANS, "no plan was kept"
    rows = torch.randn(40, 151936, device="cuda", generator=g)
    want = [triton_rows.row_sum(rows) for _ in range(3)]
    assert all(torch.equal(want[0], r) for r in want[1:]) and triton_rows._PLANS
    q = torch.randn(64, 4, 128, device="cuda", generator=g).bfloat16()
    k = torch.randn(64, 300, 128, device="cuda", generator=g).bfloat16()
    pos = torch.randint(0, 300, (64, 4), device="cuda", generator=g)
    outs = [triton_attn.attention(q, k, k, pos, 0.08, 64) for _ in range(3)]
    assert all(torch.equal(outs[0], o) for o in outs[1:]) and triton_attn._PLANS


def test_gpu_fast_path_gives_the_reference_bits(smollm_gpu, monkeypatch):
    """The engine's GPU fast path (`row_ops.FusedOps`: the fused add + norm and rotary kernels) against its
    reference path (`row_ops.TorchOps`: PyTorch ops around the backend's reductions), end to end on the
    embedded model, eager and graphed, bitwise for the invariant backends."""
    from helpers import local_engine

    from detaudit.backends import get_backend, row_ops
    from detaudit.config import DecodingParams

    ids, pids = _smoke(smollm_gpu)
    dec = DecodingParams(max_new_tokens=16)
    for backend in ("bio", "bio+tbik"):
        fast = local_engine(smollm_gpu, backend, 1, device="cuda")
        assert isinstance(fast.model.ops, row_ops.FusedOps)
        want = _out(fast.generate(ids[:8], pids[:8], dec, 8))
        with monkeypatch.context() as m:
            m.setattr(type(get_backend(backend)), "row_ops", lambda b, device: row_ops.TorchOps(b))
            for graphs in (False, True):
                ref = local_engine(smollm_gpu, backend, 1, device="cuda", cuda_graphs=graphs)
                assert isinstance(ref.model.ops, row_ops.TorchOps)
                assert _out(ref.generate(ids[:8], pids[:8], dec, 8)) == want, (backend, graphs)


@pytest.fixture(scope="module")
def qwen3_shaped():
    return _model("qwen3-8b-shaped")


def test_real_tp1_process_group_graphed_equals_in_process(qwen3_shaped, monkeypatch):
    """Real TP through a process group (DETAUDIT_TP1_GROUP=1: one NCCL rank, its all-gather captured in
    the CUDA graph) gives bitwise the in-process TP-1 result, graphed and eager, and for bio+tbik the
    emulated TP 2 result; real TP 2 / 4 / 8 (graphed, NCCL) too, as many as the machine's GPUs allow."""
    import gc

    from helpers import builtin_engine

    from detaudit.bench.e2e import random_prompts
    from detaudit.builtin import TP1_GROUP_ENV
    from detaudit.config import DecodingParams

    prompts = random_prompts(4, 80, 151936, seed=2)
    pids = [str(i) for i in range(4)]
    dec = DecodingParams(max_new_tokens=12)  # seeded sampling

    def run(backend, tp, mode, graphs, group=False):
        monkeypatch.setenv(TP1_GROUP_ENV, "1" if group else "0")
        eng = builtin_engine(qwen3_shaped, backend, tp, mode, device="cuda", cuda_graphs=graphs)
        try:
            d = eng.describe()
            assert d["cuda_graphs"] == graphs and (d.get("workers") == tp) == (group or (tp > 1 and mode == "real"))
            return _out(eng.generate(prompts, pids, dec, 4))
        finally:
            eng.close()
            del eng
            gc.collect()
            torch.cuda.empty_cache()

    refs = {}
    for backend in ("bio+tbik", "bio"):
        ref = refs[backend] = run(backend, 1, "real", True)
        assert run(backend, 1, "real", False) == ref, backend  # in process: graphed == eager
        assert run(backend, 1, "real", True, group=True) == ref, backend
        assert run(backend, 1, "real", False, group=True) == ref, backend
    tref = refs["bio+tbik"]
    assert run("bio+tbik", 2, "emulated", True) == tref
    for tp in _real_tps():  # up to the largest this machine has
        assert run("bio+tbik", tp, "real", True) == tref, f"real NCCL TP {tp}, graphed"


def test_hoisted_step_ops_give_the_same_bits():
    """bf16 attention with the step's mask (built once per step, reused by every layer) against SDPA
    given the additive mask (0 / -inf in bf16) freshly built, bitwise."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(3)
    nat = get_backend("bf16")
    for b, t, length in ((8, 1, 530), (3, 40, 40)):
        q = torch.randn(b, 32, t, 128, device="cuda", generator=g).bfloat16()
        k = torch.randn(b, 8, length, 128, device="cuda", generator=g).bfloat16()
        v = torch.randn(b, 8, length, 128, device="cuda", generator=g).bfloat16()
        pos = (torch.arange(t, device="cuda") + (length - t)).expand(b, t) - torch.arange(b, device="cuda")[:, None] % 3
        mask = torch.arange(length, device="cuda").view(1, 1, 1, -1) <= pos.view(b, 1, -1, 1)
        bias = torch.zeros(mask.shape, device="cuda", dtype=torch.bfloat16).masked_fill(~mask, float("-inf"))
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=128**-0.5, enable_gqa=True)
        plan = nat.attention_plan(pos, length)
        for _ in range(2):  # building the mask, then reusing it
            assert torch.equal(nat.attention(q, k, v, pos, 128**-0.5, plan=plan), want), (b, t, length)


def test_bf16_products_are_f_linear():
    """bf16's linear / row_partial on CUDA (torch.mm with the weight's transposed view kept) give F.linear's
    bits: the call F.linear makes for a 2-D input. 3-D inputs go through F.linear itself."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(4)
    nat = get_backend("bf16")
    for m, k, n in ((8, 4096, 6144), (32, 12288, 4096), (1, 128, 300), (520, 512, 1536)):
        x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
        w = torch.randn(n, k, device="cuda", generator=g).bfloat16()
        want = F.linear(x, w)
        for _ in range(2):  # making the view, then reusing it
            assert torch.equal(nat.linear(x, w), want) and torch.equal(nat.row_partial(x, w, 1), want), (m, k, n)
        assert torch.equal(nat.linear(x.view(1, m, k), w), F.linear(x.view(1, m, k), w))
    w2 = torch.randn(300, 128, device="cuda", generator=g).bfloat16()  # another weight: its own view
    x2 = torch.randn(4, 128, device="cuda", generator=g).bfloat16()
    assert torch.equal(nat.linear(x2, w2), F.linear(x2, w2))


def test_moe_on_gpu_layouts_graphs_and_tp_invariance(tmp_path):
    """A shrunk copy of `qwen3-30b-a3b-shaped` (the same parameter names and routing) on a GPU: decode
    steps (grouped at batch 1 and 4: at most one (token, slot) row of its 32 experts; every expert on
    every token is `test_grouped_decode.py`'s reference) and the long prefill give the same bits (teacher
    forcing re-scores the generated tokens in one prefill), graphed decode equals eager decode, bio is
    batch invariant and bio+tbik at emulated TP 2 equals TP 1, routing records included."""
    import json
    import shutil

    from helpers import local_engine

    from detaudit.bench.e2e import random_prompts
    from detaudit.config import DecodingParams

    ref = _model("qwen3-30b-a3b-shaped")
    d = tmp_path / "m"
    shutil.copytree(ref.path, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(num_hidden_layers=4, num_experts=32, num_experts_per_tok=4)
    (d / "config.json").write_text(json.dumps(cfg))
    prompts = random_prompts(4, 100, 151936, seed=3)  # 400 prefill tokens: the per-expert layout
    pids = [str(i) for i in range(4)]
    dec = DecodingParams(max_new_tokens=8, seed=5)

    def out(gens):
        return [(g.token_ids, g.token_logprobs, g.route_experts, g.route_gates) for g in gens]

    for backend in ("bio", "bio+tbik"):
        eng = local_engine(d, backend, 1, device="cuda", cuda_graphs=True)
        graphed = eng.generate(prompts, pids, dec, 4)
        assert eng.score(prompts, [g.token_ids for g in graphed], 4) == [g.token_logprobs for g in graphed]
        assert [r[0] for r in eng.last_score_routing] == [g.route_experts for g in graphed]
        eng.close()
        eager = local_engine(d, backend, 1, device="cuda", cuda_graphs=False)
        assert out(eager.generate(prompts, pids, dec, 1)) == out(graphed), backend  # eager, batch 1
        eager.close()
    tbik = out(local_engine(d, "bio+tbik", 1, device="cuda").generate(prompts, pids, dec, 4))
    assert out(local_engine(d, "bio+tbik", 2, emulated=True, device="cuda").generate(prompts, pids, dec, 4)) == tbik
