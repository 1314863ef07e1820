"""The built-in engine against transformers' reference implementation of the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from helpers import builtin_engine, local_engine

from detaudit.config import DecodingParams

GREEDY = DecodingParams(greedy=True, max_new_tokens=8)


def _prompts(n=5, vocab=300, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(L),), generator=g).tolist() for L in torch.randint(2, 14, (n,), generator=g)]


def _hf_check(path, prompts, gens, atol):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    worst = 0.0
    for p, g in zip(prompts, gens):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([p]), max_new_tokens=len(g.token_ids), do_sample=False, eos_token_id=None, pad_token_id=0
            )
            assert ref[0, len(p) :].tolist() == g.token_ids
            lp = torch.log_softmax(hf(torch.tensor([p + g.token_ids])).logits[0].float(), -1)
        lp = lp[len(p) - 1 : len(p) - 1 + len(g.token_ids)]
        ours = torch.tensor(g.token_logprobs)
        ref_lp = lp.gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
        worst = max(worst, (ours - ref_lp).abs().max().item())
        top = torch.topk(lp, 5, dim=-1)
        assert torch.allclose(torch.tensor([t[:5] for t in g.topk_logprobs]), top.values, atol=atol)
    assert worst < atol


@pytest.mark.parametrize("arch", ["tiny_llama", "tiny_qwen3"])
def test_matches_transformers_fp32(arch, request):
    path = request.getfixturevalue(arch)
    prompts = _prompts()
    eng = local_engine(path, "bf16", 1, dtype="float32")
    gens = eng.generate(prompts, [str(i) for i in range(len(prompts))], GREEDY, batch_size=2)
    _hf_check(path, prompts, gens, atol=1e-4)


def test_teacher_forced_score_matches_generation(tiny_qwen3):
    prompts = _prompts()
    eng = local_engine(tiny_qwen3, "bf16", 1, dtype="float32")
    gens = eng.generate(prompts, [str(i) for i in range(len(prompts))], GREEDY, batch_size=3)
    scores = eng.score(prompts, [g.token_ids for g in gens], batch_size=3)
    for s, g in zip(scores, gens):
        assert torch.allclose(torch.tensor(s), torch.tensor(g.token_logprobs), atol=1e-5)


def test_seeded_sampling_is_per_request(tiny_llama):
    """A request's samples depend on (seed, prompt id), not on its batch or neighbours (fp32 here,
    so only the sampler is under test)."""
    prompts = _prompts(6)
    ids = [f"p{i}" for i in range(6)]
    dec = DecodingParams(temperature=1.0, top_p=0.9, top_k=50, max_new_tokens=10, seed=7)
    eng = local_engine(tiny_llama, "bio", 1, dtype="float32")
    a = eng.generate(prompts, ids, dec, batch_size=6)
    b = eng.generate(prompts[3:], ids[3:], dec, batch_size=1)
    assert [g.token_ids for g in a[3:]] == [g.token_ids for g in b]
    c = eng.generate(prompts, ids, DecodingParams(**{**dec.to_dict(), "seed": 8}), batch_size=6)
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_emulated_tp_matches_tp1_fp32(tiny_llama):
    prompts = _prompts()
    ids = [str(i) for i in range(len(prompts))]
    ref = local_engine(tiny_llama, "bf16", 1, dtype="float32").generate(prompts, ids, GREEDY, 5)
    for tp in (2, 4, 8):
        got = local_engine(tiny_llama, "bf16", tp, emulated=True, dtype="float32").generate(prompts, ids, GREEDY, 5)
        assert [g.token_ids for g in got] == [g.token_ids for g in ref]
        for x, y in zip(got, ref):
            assert torch.allclose(torch.tensor(x.token_logprobs), torch.tensor(y.token_logprobs), atol=1e-5)


def test_eos_ends_its_request_and_nothing_else(tiny_llama):
    """Decode runs one step ahead of the host (the next step's input is decided on the device): a request
    that draws an EOS is cut right after it and marked "stop", the others go on with the bits they have
    without it (bio is batch invariant), and when every request has stopped the loop ends."""
    prompts = _prompts(6)
    ids = [str(i) for i in range(6)]
    dec = DecodingParams(greedy=True, max_new_tokens=10)
    free = local_engine(tiny_llama, "bio", 1, dtype="float32").generate(prompts, ids, dec, 6)
    eos = free[0].token_ids[2]
    got = local_engine(tiny_llama, "bio", 1, dtype="float32", eos_ids=(eos,)).generate(prompts, ids, dec, 6)
    stopped = 0
    for f, g in zip(free, got):
        cut = f.token_ids.index(eos) + 1 if eos in f.token_ids else len(f.token_ids)
        assert g.token_ids == f.token_ids[:cut] and g.token_logprobs == f.token_logprobs[:cut]
        assert g.topk_ids == f.topk_ids[:cut]
        assert g.finish_reason == ("stop" if cut < len(f.token_ids) or eos in f.token_ids else "length")
        stopped += g.finish_reason == "stop"
    assert 0 < stopped < len(prompts)  # (the test needs both kinds of request)
    firsts = {f.token_ids[0] for f in free}
    eng = local_engine(tiny_llama, "bio", 1, dtype="float32", eos_ids=tuple(firsts))
    every = eng.generate(prompts, ids, dec, 6)
    assert all(g.token_ids == f.token_ids[:1] and g.finish_reason == "stop" for f, g in zip(free, every))
    assert eng.last_timings["decode_steps"] == 1  # the one step issued ahead, never read


@pytest.mark.slow
def test_real_tp_matches_tp1_fp32(tiny_llama):
    prompts = _prompts()
    ids = [str(i) for i in range(len(prompts))]
    ref = local_engine(tiny_llama, "bf16", 1, dtype="float32").generate(prompts, ids, GREEDY, 5)
    for tp in (2, 4):
        eng = builtin_engine(tiny_llama, "bf16", tp, "real", dtype="float32")
        try:
            got = eng.generate(prompts, ids, GREEDY, 5)
            assert eng.describe()["threads_per_rank"] >= 1
        finally:
            eng.close()
        assert [g.token_ids for g in got] == [g.token_ids for g in ref]
        for x, y in zip(got, ref):
            assert torch.allclose(torch.tensor(x.token_logprobs), torch.tensor(y.token_logprobs), atol=1e-5)


def test_gpu_cache_lengths_are_rounded_within_the_position_limit(tiny_llama, tmp_path):
    """The GPU decode cache (graphed, and eager since both attend the whole cache) is rounded up to a
    multiple of 256 slots, so calls share a few key lengths, but never past a dynamic rope's position
    limit (that would refuse a request that fits). The engines' own generators, on CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(tiny_llama)
    cfg.max_position_embeddings = 2000
    cfg.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "dynamic")
    free = local_engine(tiny_llama, "bf16", 1, dtype="float32").generator
    limited = local_engine(tmp_path / "dynamic", "bf16", 1, dtype="float32").generator
    assert limited.model.cfg.rope.max_positions == 2000 and free.model.cfg.rope.max_positions is None
    assert [free._slots(n) for n in (1, 256, 257, 544)] == [256, 256, 512, 768]
    assert [limited._slots(n) for n in (1500, 1900, 2000)] == [1536, 2000, 2000]
