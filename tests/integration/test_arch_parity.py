"""Every architecture the built-in engine runs, against transformers' own implementation of the same
tiny random checkpoint (written by transformers here, biases non-zero): fp32 logits within 1e-4 under
bf16 / bio / bio+tbik at TP 1 and emulated TP 2; bio+tbik bitwise TP invariant; each architecture's
distinguishing feature (biases, llama3 RoPE scaling, sliding window) shown to matter; real TP 2 over gloo
and CLI sweeps (slow)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import builtin_engine, cli_json, generation_difference, local_engine, sweep_args, with_embedded_tokenizer

from detaudit.config import DecodingParams
from detaudit.errors import DetauditError

ATOL = 1e-4
BACKENDS = ("bf16", "bio", "bio+tbik")
SEQ = 80  # > the bio attention chunk (64 keys) and > the sliding windows below
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=16,
    max_position_embeddings=512,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

# name -> (transformers model type, config overrides)
ARCHS = {
    # Llama-3.1-style: llama3 RoPE scaling (original context 32, so positions < SEQ cross every band),
    # q/k/v/o biases, gate/up/down biases, tied embeddings
    "llama31": (
        "llama",
        dict(attention_bias=True, mlp_bias=True, tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE)),
    ),
    # Qwen2.5-style: q/k/v biases, a sliding window declared but off (use_sliding_window false), as shipped
    "qwen25": (
        "qwen2",
        dict(
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            use_sliding_window=False,
            sliding_window=32768,
            max_window_layers=1,
        ),
    ),
    # Qwen2 with the window on for layers >= max_window_layers (layer 1 sliding, layer 0 full)
    "qwen2_swa": ("qwen2", dict(use_sliding_window=True, sliding_window=12, max_window_layers=1)),
    # Mistral-style: a sliding window smaller than the test sequence
    "mistral": ("mistral", dict(sliding_window=8)),
    "qwen3": ("qwen3", dict()),
    # Qwen3 with attention_bias: q/k biases come before QK-norm, o_proj's after the all-reduce
    "qwen3_bias": ("qwen3", dict(attention_bias=True)),
}


def build(kind: str, path: Path, vocab: int = 300, seed: int = 0, **overrides) -> Path:
    """A tiny random checkpoint written by transformers: matrices N(0, 0.15), biases N(0, 0.5) (so they
    matter), norms N(1, 0.1)."""
    import transformers

    cls = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[kind]
    config = getattr(transformers, f"{cls}Config")(**{**COMMON, "vocab_size": vocab, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, f"{cls}ForCausalLM")(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.5)
            else:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path)
    return path


def hf_logits(path: Path, ids: torch.Tensor, config_edit=None, zero_biases: bool = False) -> torch.Tensor:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(path))
    if config_edit:
        config_edit(config)
    model = AutoModelForCausalLM.from_pretrained(str(path), config=config, dtype=torch.float32).eval()
    if zero_biases:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.zero_()
    with torch.no_grad():
        return model(ids).logits.float()


def engine_logits(path: Path, backend: str, tp: int, ids: torch.Tensor) -> torch.Tensor:
    eng = local_engine(path, backend, tp, emulated=tp > 1, dtype="float32")
    m = eng.model
    B, T = ids.shape
    with eng.backend.activate(), torch.inference_mode():
        return m.logits(m.hidden(ids, torch.arange(T).expand(B, T), m.new_cache(B, T)))


def token_ids(vocab: int = 300, batch: int = 2, length: int = SEQ, seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {name: build(kind, root / name, **over) for name, (kind, over) in ARCHS.items()}


@pytest.fixture(scope="module")
def reference(ckpts) -> dict[str, torch.Tensor]:
    ids = token_ids()
    return {name: hf_logits(path, ids) for name, path in ckpts.items()}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arch", list(ARCHS))
def test_logits_match_transformers(ckpts, reference, arch, backend, tp):
    got = engine_logits(ckpts[arch], backend, tp, token_ids())
    err = (got - reference[arch]).abs().max().item()
    assert err < ATOL, (arch, backend, tp, err)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tbik_is_bitwise_tp_invariant(ckpts, arch):
    """Row-parallel biases are added once, after the tree all-reduce: bio+tbik stays bitwise TP invariant."""
    ids = token_ids()
    ref = engine_logits(ckpts[arch], "bio+tbik", 1, ids)
    for tp in (2, 4):
        assert torch.equal(engine_logits(ckpts[arch], "bio+tbik", tp, ids), ref), (arch, tp)


def _no_rope_scaling(c):
    c.rope_parameters = {"rope_type": "default", "rope_theta": c.rope_parameters["rope_theta"]}


def _no_window(c):
    c.sliding_window = None
    if getattr(c, "layer_types", None):
        c.layer_types = ["full_attention"] * len(c.layer_types)


ABLATIONS = [  # (arch, what is removed from transformers' model, how)
    ("llama31", "llama3 rope scaling", dict(config_edit=_no_rope_scaling)),
    ("llama31", "attention / mlp biases", dict(zero_biases=True)),
    ("qwen25", "q/k/v biases", dict(zero_biases=True)),
    ("qwen3_bias", "q/k/v/o biases", dict(zero_biases=True)),
    ("qwen2_swa", "sliding window", dict(config_edit=_no_window)),
    ("mistral", "sliding window", dict(config_edit=_no_window)),
]


@pytest.mark.parametrize("arch,feature,ablation", ABLATIONS, ids=[f"{a}-{f}" for a, f, _ in ABLATIONS])
def test_each_feature_changes_the_logits(ckpts, reference, arch, feature, ablation):
    """The parity above is not vacuous: without the feature transformers' logits are far from the engine's."""
    without = hf_logits(ckpts[arch], token_ids(), **ablation)
    assert (without - reference[arch]).abs().max().item() > 100 * ATOL, feature


def test_llama_attention_bias_is_no_longer_ignored(tmp_path):
    """The issue-20 bug: a Llama checkpoint with attention_bias was accepted and its biases dropped (the
    outputs of another model). Now greedy generation and log-probs match transformers."""
    from transformers import AutoModelForCausalLM

    path = build("llama", tmp_path / "llama-bias", attention_bias=True)
    prompts = [token_ids(batch=1, length=n, seed=n)[0].tolist() for n in (5, 11, 17)]
    dec = DecodingParams(greedy=True, max_new_tokens=6)
    gens = local_engine(path, "bf16", 1, dtype="float32").generate(prompts, ["a", "b", "c"], dec, batch_size=3)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p, g in zip(prompts, gens):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
            lp = torch.log_softmax(hf(torch.tensor([p + g.token_ids])).logits[0], -1)
        assert ref[0, len(p) :].tolist() == g.token_ids
        ref_lp = lp[len(p) - 1 : -1].gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert (torch.tensor(g.token_logprobs) - ref_lp).abs().max().item() < ATOL


def test_unused_checkpoint_parameters_are_refused(tmp_path):
    """Biases the config does not declare (transformers would drop them) are refused by name."""
    path = build("llama", tmp_path / "llama-bias", attention_bias=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["attention_bias"] = False
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DetauditError, match=r"does not use \(model.layers.0.self_attn.k_proj.bias"):
        local_engine(path, "bf16", 1, dtype="float32")


@pytest.mark.parametrize("backend", ["bio", "bio+tbik"])
def test_sliding_window_decode_equals_prefill_and_transformers(ckpts, backend):
    """Generation with a window (8) over prompts longer than one attention chunk: the decode path's window
    mask skips whole chunks; each token's log-prob equals the teacher-forced prefill's bitwise, the batch
    does not change it, and transformers agrees."""
    from transformers import AutoModelForCausalLM

    path = ckpts["mistral"]
    prompts = [token_ids(batch=1, length=n, seed=n)[0].tolist() for n in (70, 66, 75)]
    ids = ["a", "b", "c"]
    dec = DecodingParams(greedy=True, max_new_tokens=6)
    eng = local_engine(path, backend, 1, dtype="float32")
    gens = eng.generate(prompts, ids, dec, batch_size=3)
    alone = eng.generate(prompts[1:2], ids[1:2], dec, batch_size=1)
    assert torch.equal(torch.tensor(alone[0].token_logprobs), torch.tensor(gens[1].token_logprobs))
    scores = eng.score(prompts, [g.token_ids for g in gens], batch_size=3)
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    for p, g, s in zip(prompts, gens, scores):
        assert torch.equal(torch.tensor(s), torch.tensor(g.token_logprobs))
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([p + g.token_ids])).logits[0], -1)
        ref = lp[len(p) - 1 : -1].gather(1, torch.tensor(g.token_ids)[:, None])[:, 0]
        assert (torch.tensor(g.token_logprobs) - ref).abs().max().item() < ATOL


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    ],
    ids=["linear", "dynamic"],
)
def test_other_rope_scalings_match_transformers(tmp_path, rope):
    path = build("llama", tmp_path / rope["rope_type"], rope_parameters=dict(rope), max_position_embeddings=96)
    ids = token_ids()
    err = (engine_logits(path, "bio", 1, ids) - hf_logits(path, ids)).abs().max().item()
    assert err < ATOL, err
    if rope["rope_type"] == "linear":  # the factor matters
        assert (hf_logits(path, ids, config_edit=_no_rope_scaling) - hf_logits(path, ids)).abs().max() > 100 * ATOL


def test_dynamic_rope_beyond_max_positions_is_refused(tmp_path):
    """Past max_position_embeddings transformers rescales by each forward call's longest sequence (not
    batch invariant): the engine refuses instead of computing something else."""
    path = build(
        "llama",
        tmp_path / "dyn",
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        max_position_embeddings=96,
    )
    eng = local_engine(path, "bf16", 1, dtype="float32")
    with pytest.raises(DetauditError, match="rope_type 'dynamic' beyond max_position_embeddings \\(96"):
        eng.generate(
            [token_ids(batch=1, length=90)[0].tolist()], ["a"], DecodingParams(greedy=True, max_new_tokens=10), 1
        )


# ---------------------------------------------------------------- slow: real TP over gloo, CLI sweeps
@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama31", "mistral"])
def test_real_tp2_gloo(ckpts, arch):
    """Real TP 2 (worker processes, gloo): bio+tbik's outputs bitwise equal TP 1's in every recorded number
    (biases of o_proj / down_proj added once after the all-reduce on every rank); bf16 within fp32
    tolerance of TP 1."""
    prompts = [token_ids(batch=1, length=n, seed=n)[0].tolist() for n in (9, 30, 70)]
    ids = ["a", "b", "c"]
    dec = DecodingParams(greedy=True, max_new_tokens=5)
    for backend in ("bio+tbik", "bf16"):
        ref = local_engine(ckpts[arch], backend, 1, dtype="float32").generate(prompts, ids, dec, 3)
        eng = builtin_engine(ckpts[arch], backend, 2, "real", dtype="float32")
        try:
            got = eng.generate(prompts, ids, dec, 3)
        finally:
            eng.close()
        assert [g.token_ids for g in got] == [g.token_ids for g in ref], backend
        if backend == "bio+tbik":
            assert generation_difference(got, ref) is None
            continue
        a = torch.tensor([x for g in got for x in g.token_logprobs])
        b = torch.tensor([x for g in ref for x in g.token_logprobs])
        assert (a - b).abs().max() < ATOL, backend


def _sweep_checkpoint(arch: str, dest: Path) -> Path:
    """A tiny checkpoint with the embedded model's tokenizer (vocab 49152) so the CLI can tokenize suites."""
    kind, over = ARCHS[arch]
    build(kind, dest, vocab=49152, **over)
    return with_embedded_tokenizer(dest)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama31", "qwen25", "mistral", "qwen3"])
def test_cli_sweep(arch, tmp_path):
    """`detaudit sweep --model DIR` over bf16 / bio / bio+tbik at TP 1 and 2 (real TP for llama31, emulated
    for the others, to spare the 2-core CI machine): every cell runs and bio+tbik is bitwise invariant."""
    from typer.testing import CliRunner

    from detaudit.cli import app

    path = _sweep_checkpoint(arch, tmp_path / arch)
    out = tmp_path / "run"
    mode = "real" if arch == "llama31" else "emulated"
    grid = sweep_args(backends="bf16,bio,bio+tbik", tp="1,2", batch_sizes=2, dtype="float32", tp_mode=mode)
    args = ["sweep", "--model", str(path), *grid, "--output-path", str(out)]
    runner = CliRunner()
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert len(manifest["cells"]) == 6
    res = runner.invoke(app, ["analyze", str(out), "--json"])
    rows = {r["backend"]: r for r in cli_json(res)}
    assert rows["bio+tbik"]["cells"] == 2
    assert rows["bio+tbik"]["bitwise_diff_records"] == 0, rows["bio+tbik"]["bitwise_first_diff"]
    assert rows["bio+tbik"]["unique_mean"] == 1 and rows["bio+tbik"]["maxprob_div_mean"] == 0


@pytest.fixture(scope="module")
def kv2(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """Qwen3 with q/k/v/o biases and 2 KV heads for 8 query heads, and transformers' logits."""
    path = build("qwen3", tmp_path_factory.mktemp("kv2") / "qwen3_kv2", attention_bias=True, num_key_value_heads=2)
    return path, hf_logits(path, token_ids())


@pytest.mark.parametrize("backend", BACKENDS)
def test_replicated_kv_heads_match_transformers(kv2, backend):
    """TP 8 over 2 KV heads (emulated: every rank's shards here): each KV head and its biases held by the
    4 ranks whose query heads read it."""
    path, ref = kv2
    err = (engine_logits(path, backend, 8, token_ids()) - ref).abs().max().item()
    assert err < ATOL, (backend, err)


def test_replicated_kv_heads_tbik_bitwise(kv2):
    path, _ = kv2
    ids = token_ids()
    ref = engine_logits(path, "bio+tbik", 1, ids)
    for tp in (2, 4, 8):  # KV heads split, then held by 2 and 4 ranks each
        assert torch.equal(engine_logits(path, "bio+tbik", tp, ids), ref), tp
