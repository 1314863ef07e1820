"""A suite's generation_kwargs become its decoding (the command line's flags win), and stop strings end a
row as lm-eval defines it."""

from __future__ import annotations

import pytest
import torch

from detaudit.config import DecodingParams
from detaudit.decoding import (
    GenerationKwargs,
    StopWatch,
    cut_at_stop,
    parse_generation_kwargs,
    suite_decoding,
)
from detaudit.errors import DetauditError

CLI = DecodingParams(temperature=0.6, top_p=0.95, top_k=20, max_new_tokens=16)  # the sweep's defaults


def _gen(**kw) -> GenerationKwargs:
    return parse_generation_kwargs(kw, "t.yaml")


def test_minerva_style_kwargs_are_honoured():
    gen = _gen(until=["Problem:"], do_sample=False, temperature=0.0, max_gen_toks=256)
    decoding, notes = suite_decoding(CLI, gen)
    assert decoding.greedy and decoding.max_new_tokens == 256 and decoding.stop == ("Problem:",)
    assert notes == []
    assert decoding.to_dict()["stop"] == ["Problem:"]


def test_until_as_one_string_and_duplicates():
    assert _gen(until="\n\n").until == ("\n\n",)
    assert _gen(until=["a", "b", "a"]).until == ("a", "b")
    assert _gen(until=[]).until == ()


@pytest.mark.parametrize(
    "kw, greedy, temperature",
    [
        ({"temperature": 0.0}, True, 0.0),  # lm-eval: temperature 0 without do_sample is greedy
        ({"do_sample": False}, True, 0.6),
        ({"do_sample": False, "temperature": 0.7}, True, 0.7),  # transformers ignores T when not sampling
        ({"do_sample": True}, False, 0.6),
        ({"do_sample": True, "temperature": 0.8}, False, 0.8),
        ({"temperature": 0.8}, False, 0.8),
    ],
)
def test_sampling_keys(kw, greedy, temperature):
    decoding, _ = suite_decoding(CLI, _gen(**kw))
    assert (decoding.greedy, decoding.temperature) == (greedy, temperature)


def test_top_p_top_k():
    decoding, _ = suite_decoding(CLI, _gen(top_p=0.5, top_k=3))
    assert (decoding.top_p, decoding.top_k) == (0.5, 3)


def test_command_line_flags_win_and_are_named():
    gen = _gen(until=["Q:"], do_sample=False, temperature=0.0, max_gen_toks=256, top_k=5)
    decoding, notes = suite_decoding(CLI, gen, flags=("max_new_tokens", "temperature"))
    assert decoding.max_new_tokens == 16 and not decoding.greedy and decoding.temperature == 0.6
    assert decoding.stop == ("Q:",) and decoding.top_k == 5  # keys no flag overrides still apply
    assert notes == ["max_gen_toks: 256 -> --max-new-tokens 16", "do_sample: False -> --temperature 0.6",
                     "temperature: 0.0 -> --temperature 0.6"]  # fmt: skip
    greedy, notes = suite_decoding(CLI, _gen(do_sample=True, temperature=0.9), flags=("greedy",))
    assert notes == ["do_sample: True -> --greedy", "temperature: 0.9 -> --greedy"]


def test_no_kwargs_keeps_the_command_line():
    assert suite_decoding(CLI, GenerationKwargs()) == (CLI, [])
    assert "stop" not in CLI.to_dict()  # runs without stop strings keep the identity they always had


@pytest.mark.parametrize(
    "kw, named",
    [
        ({"num_beams": 4}, "num_beams cannot be honoured"),
        ({"repetition_penalty": 1.1, "until": []}, "repetition_penalty"),
        ({"until": [""]}, "generation_kwargs.until"),
        ({"until": [1]}, "generation_kwargs.until"),
        ({"max_gen_toks": 0}, "max_gen_toks"),
        ({"max_gen_toks": "256"}, "max_gen_toks"),
        ({"do_sample": "no"}, "do_sample"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"do_sample": True, "temperature": 0}, "`do_sample: true` with `temperature: 0`"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(kw, named):
    with pytest.raises(DetauditError) as info:
        parse_generation_kwargs(kw, "t.yaml")
    assert named in str(info.value) and "\n" not in str(info.value)


def test_not_a_mapping():
    with pytest.raises(DetauditError, match="must be a mapping"):
        parse_generation_kwargs(["until"], "t.yaml")


def test_cut_at_stop_is_lm_evals_split():
    text = "x = 1\nProblem: next\n\nmore"
    for stops in (["Problem:"], ["\n\n", "Problem:"], ["Problem:", "\n\n"]):
        expected = text
        for s in stops:
            expected = expected.split(s)[0]  # lm-eval's post-processing
        assert cut_at_stop(text, stops) == expected == "x = 1\n"
    assert cut_at_stop(text, ["absent"]) == text and cut_at_stop(text, []) == text


def _decode(ids: list[int]) -> str:
    # a stand-in detokenizer for the random-weight checkpoint, which has no tokenizer: one letter per id
    return "".join(chr(ord("a") + i % 26) for i in ids)


def test_stop_watch_looks_at_the_tail_only():
    watch = StopWatch(["xyz"], _decode)
    assert watch.lookback == 5
    assert watch.hit([0] * 100 + [23, 24, 25]) and not watch.hit([23, 24, 25] + [0] * 100)


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize(
    "device, graphs",
    [
        ("cpu", False),
        ("cpu", True),  # CPU: decode steps replayed from a recording
        pytest.param("cuda", False, marks=[pytest.mark.gpu, GPU]),
        pytest.param("cuda", True, marks=[pytest.mark.gpu, GPU]),
    ],  # fmt: skip
)
def test_builtin_engine_stops_at_a_stop_string(tiny_llama, device, graphs, monkeypatch):
    """Greedy rows of the real engine: with a stop string taken from a row's own output, that row ends at
    the token completing it (finish reason "stop", the tokens a prefix of the unstopped row, bitwise), and
    the other rows of the batch are unchanged. The decode loop runs a step ahead of the host (from CUDA
    graphs, or on CPU replayed steps, whose outputs each step overwrites): a row stopped by a string must
    still end where the host saw the string."""
    from helpers import local_engine

    from detaudit.builtin import generate
    from detaudit.builtin.generate import Generator

    monkeypatch.setattr(generate, "REPLAY_AFTER_STEPS", 0)  # (CPU: recorded at once, a short call)
    eng = local_engine(tiny_llama, "bio", dtype="float32", device=device, cuda_graphs=graphs)
    gen = Generator(eng.model, eos_ids=(), cuda_graphs=graphs, cpu_replay=graphs, decode=_decode)
    prompts, ids = [[1, 2, 3], [4, 5, 6, 7], [8, 9]], ["a", "b", "c"]
    free = DecodingParams(greedy=True, max_new_tokens=12)
    with eng.backend.activate():
        base = gen.generate(prompts, ids, free)
        stop = _decode(base[1].token_ids[3:5])
        first = next(k for k in range(len(base[1].token_ids)) if stop in _decode(base[1].token_ids[: k + 1]))
        stopped = gen.generate(prompts, ids, DecodingParams(greedy=True, max_new_tokens=12, stop=(stop,)))
    assert first < 11 and stopped[1].finish_reason == "stop"
    for b, s in zip(base, stopped):  # every row ends at its own first stop, or runs as before
        hit = next((k for k in range(len(b.token_ids)) if stop in _decode(b.token_ids[: k + 1])), None)
        n = len(b.token_ids) if hit is None else hit + 1
        assert s.token_ids == b.token_ids[:n] and s.finish_reason == ("length" if hit is None else "stop")
        assert torch.equal(torch.tensor(s.token_logprobs), torch.tensor(b.token_logprobs[:n]))
        assert torch.equal(torch.tensor(s.topk_ids), torch.tensor(b.topk_ids[:n]))
    with pytest.raises(ValueError, match="decode"):
        Generator(eng.model, eos_ids=()).generate(prompts, ids, DecodingParams(greedy=True, stop=("x",)))


def test_server_requests_carry_the_stop_strings():
    from detaudit.server import wire

    stops = DecodingParams(greedy=True, stop=("Problem:", "\n\n"))
    assert wire.completion_body("m", [1, 2], stops, "p", kind="vllm")["stop"] == ["Problem:", "\n\n"]
    assert wire.chat_body("m", "hi", stops, "p", kind="generic")["stop"] == ["Problem:", "\n\n"]
    assert "stop" not in wire.completion_body("m", [1, 2], DecodingParams(), "p", kind="vllm")


# ---------------------------------------------------------------- what a task file leaves out: lm-eval's defaults
# lm-eval (lm_eval/api/task.py TaskConfig.__post_init__ in v0.4.9.2; lm_eval/config/task.py at HEAD): a
# generate_until task without generation_kwargs decodes greedily with until [fewshot_delimiter] ("\n\n" by
# default); generation_kwargs without until get that until.


def _task(tmp_path, extra: str = ""):
    from detaudit.inputs.suites import load_suite

    path = tmp_path / "t.yaml"
    path.write_text("task: t\ndocs: [{q: x}]\ndoc_to_text: q\n" + extra)
    return load_suite(str(path))


@pytest.mark.parametrize(
    "extra, greedy, stop, temperature",
    [
        ("", True, ("\n\n",), 0.0),
        ("output_type: generate_until\n", True, ("\n\n",), 0.0),
        ("generation_kwargs: null\n", True, ("\n\n",), 0.0),
        ("fewshot_delimiter: '###'\n", True, ("###",), 0.0),
        ("fewshot_delimiter: null\n", True, (), 0.0),
        ("generation_kwargs: {max_gen_toks: 9}\n", False, ("\n\n",), 0.6),  # sampling knobs: the command line's
        ("generation_kwargs: {do_sample: true, temperature: 0.8}\nfewshot_delimiter: '|'\n", False, ("|",), 0.8),
        ("generation_kwargs: {until: ['Q:'], do_sample: false}\n", True, ("Q:",), 0.6),
        ("generation_kwargs: {until: []}\n", False, (), 0.6),
    ],
)
def test_what_the_file_leaves_out_decodes_as_lm_eval(tmp_path, extra, greedy, stop, temperature):
    suite = _task(tmp_path, extra)
    decoding, notes = suite_decoding(CLI, suite.generation)
    assert (decoding.greedy, decoding.stop, decoding.temperature) == (greedy, stop, temperature) and notes == []
    assert "output_type" not in suite.ignored_keys and "fewshot_delimiter" not in suite.ignored_keys


def test_flags_still_override_lm_evals_defaults_and_say_so(tmp_path):
    gen = _task(tmp_path).generation
    assert gen.defaults == ("until", "do_sample", "temperature") and gen.from_file() == {}
    decoding, notes = suite_decoding(CLI, gen, flags=("temperature",))
    assert not decoding.greedy and decoding.temperature == 0.6 and decoding.stop == ("\n\n",)
    assert notes == [
        "do_sample: False (lm-eval's default) -> --temperature 0.6",
        "temperature: 0.0 (lm-eval's default) -> --temperature 0.6",
    ]


def test_decoding_sources_name_the_file_lm_eval_flags_and_detaudit(tmp_path):
    from detaudit.decoding import decoding_sources

    plain = _task(tmp_path).generation
    assert decoding_sources(CLI, plain) == {
        "lm-eval's defaults": ["do_sample false", "temperature 0.0", "until ['\\n\\n']"],
        "detaudit's defaults": ["--max-new-tokens 16 (lm-eval's is 256)"],
    }
    greedy = DecodingParams(greedy=True, temperature=0.0, max_new_tokens=16)  # what --greedy gives
    assert decoding_sources(greedy, plain, ("greedy", "max_new_tokens")) == {
        "lm-eval's defaults": ["until ['\\n\\n']"],
        "flags": ["--greedy", "--max-new-tokens 16"],
    }
    own = _task(tmp_path, "generation_kwargs: {max_gen_toks: 9, top_k: 5}\n").generation
    assert decoding_sources(CLI, own, ("top_p",)) == {
        "the file": ["top_k 5", "max_gen_toks 9"],
        "lm-eval's defaults": ["until ['\\n\\n']"],
        "flags": ["--top-p 0.95"],
        "detaudit's defaults": ["temperature 0.6"],
    }


def test_a_bad_fewshot_delimiter_is_refused(tmp_path):
    with pytest.raises(DetauditError, match="`fewshot_delimiter` must be a string"):
        _task(tmp_path, "fewshot_delimiter: [1]\n")


def test_the_default_decoding_is_the_published_setup():
    """T 0.6, top-p 0.95, top-k 20, seed 42 (the TBIK paper's Qwen3 settings, as the README says), in
    `DecodingParams` and as the defaults of `detaudit sweep`'s flags."""
    from typer.main import get_command

    from detaudit.cli import app

    published = dict(temperature=0.6, top_p=0.95, top_k=20, seed=42)
    assert {k: getattr(DecodingParams(), k) for k in published} == published
    flags = {p.name: p.default for p in get_command(app).commands["sweep"].params}
    assert {k: flags[k] for k in published} == published


def test_the_built_in_suites_keep_the_published_sampling():
    """They say so in their files now (without generation_kwargs lm-eval would decode them greedily)."""
    from detaudit.inputs.suites import _resolve, list_suites, load_spec

    for row in list_suites():
        decoding, notes = suite_decoding(CLI, load_spec(_resolve(row["name"])).generation)
        assert decoding == CLI and notes == [], row["name"]


@pytest.mark.slow  # loads a (tiny) checkpoint and the embedded tokenizer
def test_sweep_prints_where_each_decoding_value_comes_from(tmp_path, tiny_sweep_model):
    """The sweep's console line per suite (its prepare step: suites, model, prompts; no engine runs)."""
    from rich.console import Console

    from detaudit.config import SweepConfig
    from detaudit.sweep import prepare

    (tmp_path / "t.yaml").write_text("task: t\ndocs: [{q: x}]\ndoc_to_text: q\n")
    cfg = SweepConfig(
        model=str(tiny_sweep_model),
        suites=(str(tmp_path / "t.yaml"),),
        decoding=DecodingParams(top_k=7, max_new_tokens=4),
        decoding_flags=("top_k",),
    )
    console = Console(record=True, width=400)
    prepare(cfg, None, console)
    text = console.export_text()
    assert (
        "suite t: plain text; greedy, max 4 new tokens, stop ['\\n\\n'] (lm-eval's defaults: do_sample false, "
        "temperature 0.0, until ['\\n\\n']; detaudit's defaults: --max-new-tokens 4 (lm-eval's is 256))"
    ) in text, text
