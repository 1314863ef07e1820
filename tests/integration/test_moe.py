"""Mixture-of-experts models in the built-in engine, against transformers' Qwen3-MoE and Mixtral on tiny
random checkpoints written by transformers here: fp32 logits within 1e-4 and the same greedy tokens
under bf16 / bio / bio+tbik at TP 1 and emulated TP 2; bio batch invariant and bio+tbik TP invariant
bitwise, routing records included, in bf16 and in fp32 (where the all-reduce's own bits reach the
outputs); the two expert layouts (every token to every expert in decode, the chosen rows only in a long
prefill) give the same bits; real TP 2 over gloo in fp32. (The layer's fp32 partials over narrow and odd
shapes: tests/unit/test_props_moe.py; real TP 8: test_tbik_dist.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import builtin_engine, generation_difference, local_engine

from detaudit.config import DecodingParams

pytestmark = pytest.mark.slow  # engines on transformers-made checkpoints, a few seconds each

ATOL = 1e-4
BACKENDS = ("bf16", "bio", "bio+tbik")
COMMON = dict(
    vocab_size=300,
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=16,
    max_position_embeddings=512,
)
MODELS = {
    # Qwen3-MoE: 8 experts, top 2, gates renormalised, layer 1 a dense MLP (mlp_only_layers)
    "qwen3_moe": dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        intermediate_size=96,
        norm_topk_prob=True,
        mlp_only_layers=[1],
    ),
    # Qwen3-MoE without renormalised gates, top 3
    "qwen3_moe_raw": dict(
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=64,
        intermediate_size=96,
        norm_topk_prob=False,
    ),
    # Mixtral: 4 experts, top 2 (gates always renormalised)
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=64),
}


def build(name: str, path: Path, **over) -> Path:
    import transformers

    kind = "Mixtral" if name == "mixtral" else "Qwen3Moe"
    config = getattr(transformers, f"{kind}Config")(**{**COMMON, **MODELS[name], **over})
    torch.manual_seed(0)
    model = getattr(transformers, f"{kind}ForCausalLM")(config)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.normal_(1.0, 0.1) if pname.endswith("norm.weight") else p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe")
    return {name: build(name, root / name) for name in MODELS}


def token_ids(batch: int = 2, length: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, 300, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(path: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits.float()


def engine_logits(path: Path, backend: str, tp: int, ids: torch.Tensor) -> torch.Tensor:
    eng = local_engine(path, backend, tp, emulated=tp > 1, dtype="float32")
    m = eng.model
    B, T = ids.shape
    with eng.backend.activate(), torch.inference_mode():
        return m.logits(m.hidden(ids, torch.arange(T).expand(B, T), m.new_cache(B, T)))


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_match_transformers(ckpts, name, backend, tp):
    ids = token_ids()
    want = hf_logits(ckpts[name], ids)
    got = engine_logits(ckpts[name], backend, tp, ids)
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max().item()


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_greedy_tokens_match_transformers(ckpts, name):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(ckpts[name]), dtype=torch.float32).eval()
    prompt = token_ids(batch=1, length=12)
    with torch.no_grad():
        want = hf.generate(prompt, max_new_tokens=8, do_sample=False, min_new_tokens=8, pad_token_id=0)[0, 12:]
    for backend in BACKENDS:
        gens = local_engine(ckpts[name], backend, dtype="float32").generate(
            prompt.tolist(), ["p"], DecodingParams(greedy=True, max_new_tokens=8), 1
        )
        assert gens[0].token_ids == want.tolist(), backend
        layers = 2 if name == "qwen3_moe" else 3  # qwen3_moe's layer 1 is dense
        k = MODELS[name]["num_experts_per_tok"]
        assert len(gens[0].route_experts) == 8 and all(len(r) == layers * k for r in gens[0].route_experts)
        assert all(len(m) == layers and min(m) >= 0 for m in gens[0].route_margins)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe"])
def test_recorded_routing_is_layer_major_as_transformers_routes(ckpts, name):
    """Each position's recorded expert ids are layer-major (MoE layer by layer, its top k within each) and
    each layer's set is the one transformers' router of that layer picks. Mixtral's 3 MoE layers of top 2
    tell layer-major from k-major (with layers == top-k, as qwen3_moe's 2 of 2, both split the same)."""
    from transformers import AutoModelForCausalLM

    ids = token_ids(batch=1, length=16, seed=5)
    hf = AutoModelForCausalLM.from_pretrained(str(ckpts[name]), dtype=torch.float32).eval()
    with torch.no_grad():
        routers = hf(ids, output_router_logits=True).router_logits  # one [T, experts] per MoE layer
    k = MODELS[name]["num_experts_per_tok"]
    eng = local_engine(ckpts[name], "bio", dtype="float32")
    eng.score([ids[0, :1].tolist()], [ids[0, 1:].tolist()], 1)  # the routing of positions 0 .. T-2
    experts, gates, margins = eng.last_score_routing[0]
    assert len(experts) == ids.shape[1] - 1 and all(len(e) == len(routers) * k for e in experts)
    compared = 0
    for t, row in enumerate(experts):
        for layer, logits in enumerate(routers):
            top = torch.sort(logits[t].softmax(-1), descending=True).values
            if top[k - 1] - top[k] < 1e-4:  # a near tie: fp32 rounding may pick either expert
                continue
            want = set(torch.topk(logits[t], k).indices.tolist())
            assert set(row[layer * k : (layer + 1) * k]) == want, (t, layer, row)
            compared += 1
    assert compared >= len(experts) * len(routers) * 3 // 4, compared


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("name", list(MODELS))
def test_bio_batch_invariant_and_tbik_tp_invariant_with_routing(ckpts, name, dtype):
    prompts = [token_ids(batch=1, length=n, seed=n)[0].tolist() for n in (5, 9, 14, 3)]
    pids = ["a", "b", "c", "d"]
    dec = DecodingParams(max_new_tokens=6, seed=3)  # seeded sampling
    one = local_engine(ckpts[name], "bio", 1, dtype=dtype).generate(prompts, pids, dec, 1)
    assert one[0].route_experts is not None  # routing recorded
    for bs in (2, 4):
        got = local_engine(ckpts[name], "bio", 1, dtype=dtype).generate(prompts, pids, dec, bs)
        assert generation_difference(got, one) is None, bs
    ref = local_engine(ckpts[name], "bio+tbik", 1, dtype=dtype).generate(prompts, pids, dec, 4)
    for tp in (2, 4, 8):
        got = local_engine(ckpts[name], "bio+tbik", tp, emulated=True, dtype=dtype).generate(prompts, pids, dec, 4)
        assert generation_difference(got, ref) is None, tp


@pytest.mark.parametrize(
    "backend,patch",
    [("bio", {}), ("bio+tbik", {}), ("bio+tbik", {"LEAF_BATCH_BYTES": 0}), ("bio+tbik", {"PREFILL_BYTES": 1 << 16})],
)
def test_decode_and_prefill_layouts_give_the_same_bits(ckpts, backend, patch, monkeypatch):
    """A 100-token prompt's prefill runs the chosen-rows layout (more than 64 tokens), each decode step the
    every-expert layout (bio+tbik: every leaf in one product, or with LEAF_BATCH_BYTES 0 one product a
    leaf, as large batches run); teacher forcing scores the generated tokens in one prefill (with a small
    PREFILL_BYTES in pieces of tokens, as long prefills run): log-probabilities and routing equal the
    generation's bitwise."""
    from detaudit.backends import experts as moe

    for name, value in patch.items():
        monkeypatch.setattr(moe, name, value)
    eng = local_engine(ckpts["qwen3_moe"], backend)
    prompts = [token_ids(batch=1, length=100, seed=7)[0].tolist(), token_ids(batch=1, length=30, seed=8)[0].tolist()]
    gens = eng.generate(prompts, ["a", "b"], DecodingParams(max_new_tokens=6, seed=1), 2)
    scores = eng.score(prompts, [g.token_ids for g in gens], 2)
    for g, s, (experts, gates, margins) in zip(gens, scores, eng.last_score_routing):
        assert s == g.token_logprobs
        assert (experts, gates, margins) == (g.route_experts, g.route_gates, g.route_margins)


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_real_tp2_over_gloo_equals_tp1(ckpts, name):
    """In fp32: the gloo all-reduce's own bits reach the outputs (bf16 real TP: test_moe_routing.py)."""
    prompts = [token_ids(batch=1, length=n, seed=n)[0].tolist() for n in (5, 9)]
    dec = DecodingParams(max_new_tokens=5, seed=2)
    ref = local_engine(ckpts[name], "bio+tbik", 1, dtype="float32").generate(prompts, ["a", "b"], dec, 2)
    eng = builtin_engine(ckpts[name], "bio+tbik", 2, "real", dtype="float32")
    try:
        assert generation_difference(eng.generate(prompts, ["a", "b"], dec, 2), ref) is None
        assert eng.describe()["routing"] is True
    finally:
        eng.close()


def test_routing_replay(ckpts):
    """Teacher forcing with the rollout's expert choices forced (routing replay): replaying a sequence's
    own routing changes no bit; replaying other choices uses exactly those experts."""
    eng = local_engine(ckpts["qwen3_moe"], "bio")
    prompts = [token_ids(batch=1, length=10, seed=3)[0].tolist()]
    gens = eng.generate(prompts, ["a"], DecodingParams(max_new_tokens=5, seed=4), 1)
    conts = [gens[0].token_ids]
    plain = eng.score(prompts, conts, 1)
    own = [gens[0].route_experts]
    assert eng.score(prompts, conts, 1, forced_routing=own) == plain
    other = [[[(e + 1) % 8 for e in experts] for experts in gens[0].route_experts]]
    replayed = eng.score(prompts, conts, 1, forced_routing=other)
    assert eng.last_score_routing[0][0] == other[0] and replayed != plain
