"""Inputs that used to run for minutes or hang every cell are refused up front.

- a prompt longer than the model's context (prompt tokens + --max-new-tokens > max_position_embeddings)
  is refused before any model work, naming the suite, the row and the lengths (no truncation);
- for the built-in engine, a prompt holding a token id past the model's vocab_size (a tokenizer that
  is not the checkpoint's) is refused the same way, naming the id (it used to fail inside the first
  cell with a traceback);
- `--hang-timeout` must be a finite number > 0 (with -1 every TP cell "hung")."""

from __future__ import annotations

import pytest
from helpers import sweep_args
from typer.testing import CliRunner

from detaudit.errors import DetauditError
from detaudit.inputs.prompt_limits import check_prompt_lengths, check_prompt_vocab, model_context_len


# ------------------------------------------------------------------ prompt lengths
def _one_line(e: pytest.ExceptionInfo) -> str:
    msg = str(e.value)
    assert "\n" not in msg, msg
    return msg


def test_prompts_that_fit_pass_and_one_token_more_does_not():
    """The boundary: prompt + --max-new-tokens == context passes, one token more is refused."""
    check_prompt_lengths("smoke", ["a", "b"], [[1] * 10, [2] * 90], max_new_tokens=10, context_len=100)
    check_prompt_lengths("smoke", [], [], max_new_tokens=1, context_len=2)
    with pytest.raises(DetauditError, match="prompt 'b' is 91 tokens"):
        check_prompt_lengths("smoke", ["a", "b"], [[1] * 10, [2] * 91], max_new_tokens=10, context_len=100)
    with pytest.raises(DetauditError, match="--max-new-tokens 11"):
        check_prompt_lengths("smoke", ["a", "b"], [[1] * 10, [2] * 90], max_new_tokens=11, context_len=100)


def test_prompt_over_context_is_refused_naming_the_row():
    ids = ["p0", "p1", "p2", "p3"]
    toks = [[1] * 10, [1] * 91, [1] * 5, [1] * 200]
    with pytest.raises(DetauditError) as e:
        check_prompt_lengths("aime24", ids, toks, max_new_tokens=10, context_len=100)
    msg = _one_line(e)
    assert "suite aime24" in msg and "prompt 'p1'" in msg, msg
    assert "91 tokens" in msg and "--max-new-tokens 10" in msg and "101 > " in msg and "100 tokens" in msg, msg
    assert "1 more" in msg, msg  # p3 too


def test_single_offender_says_no_more():
    with pytest.raises(DetauditError) as e:
        check_prompt_lengths("s", ["only"], [[1] * 3], max_new_tokens=2, context_len=4)
    msg = _one_line(e)
    assert "prompt 'only' is 3 tokens" in msg and "more" not in msg, msg


def test_empty_prompt_and_max_new_tokens_filling_the_context_are_refused():
    with pytest.raises(DetauditError) as e:
        check_prompt_lengths("s", ["a", "b"], [[1], []], max_new_tokens=1, context_len=100)
    assert "prompt 'b' is empty" in _one_line(e)
    with pytest.raises(DetauditError) as e:
        check_prompt_lengths("s", ["a"], [[1]], max_new_tokens=100, context_len=100)
    assert "--max-new-tokens 100" in _one_line(e)
    with pytest.raises(ValueError):
        check_prompt_lengths("s", ["a"], [], max_new_tokens=1, context_len=100)


def test_model_context_len(tmp_path):
    from detaudit.config import ModelRef

    def ref(config: dict) -> ModelRef:
        return ModelRef("m", tmp_path, "?", "", config)

    assert model_context_len(ref({"max_position_embeddings": 8192})) == 8192
    assert model_context_len(ref({"max_position_embeddings": 8192}), cap=4096) == 4096  # vLLM's max_model_len
    assert model_context_len(ref({"text_config": {"max_position_embeddings": 512}})) == 512
    for bad in (
        {"max_position_embeddings": -1},
        {"max_position_embeddings": "8192"},
        {"max_position_embeddings": True},
        {},
    ):
        with pytest.raises(DetauditError) as e:
            model_context_len(ref(bad))
        _one_line(e)


def test_embedded_model_context(smollm):
    assert model_context_len(smollm) == 8192


# ------------------------------------------------------------------ --hang-timeout
@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_sweep_refuses_non_positive_hang_timeout(tmp_path, value):
    """Exit 2 with one line naming the flag, before any model work (nothing written)."""
    from detaudit.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "sweep",
            "--hang-timeout",
            value,
            *sweep_args(limit=1, max_new_tokens=2, backends="bio", tp="1,2", batch_sizes=1, output_path=out),
        ],
    )
    assert res.exit_code == 2, (res.output, res.exception)
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1, res.output
    assert "--hang-timeout" in lines[0], lines[0]
    assert not out.exists() or not any(out.iterdir())


def test_sweep_refuses_prompt_over_context_before_model_work(tmp_path, smollm):
    """smollm2-135m's context is 8192 positions: smoke's first prompt + 8180 new tokens does not fit.
    The sweep stops after tokenizing (no engine, no cell), with one line naming the suite and the row."""
    from detaudit.cli import app

    out = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        ["sweep", *sweep_args(limit=1, max_new_tokens=8180, backends="bio", tp=1, batch_sizes=1, output_path=out)],
    )
    assert res.exit_code == 2, (res.output, res.exception)
    assert "Traceback" not in res.output
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1, res.output
    assert "suite smoke: prompt " in lines[0] and "8180" in lines[0] and "8192" in lines[0], lines[0]
    assert not list(out.rglob("*.parquet"))


# ------------------------------------------------------------------ token ids and the vocabulary
def test_token_ids_past_the_vocabulary_are_refused_naming_the_row(tmp_path):
    check_prompt_vocab("s", ["a", "b"], [[0, 5], [9]], vocab_size=10, path=tmp_path)  # the boundary passes
    for toks, bad in (([[0, 5], [9, 10]], 10), ([[3, -1]], -1)):
        with pytest.raises(DetauditError) as e:
            check_prompt_vocab("aime24", ["r1", "r2"][: len(toks)], toks, vocab_size=10, path=tmp_path)
        msg = _one_line(e)
        assert "suite aime24" in msg and f"token id {bad}" in msg and "vocab_size of 10" in msg, msg


def test_sweep_refuses_a_tokenizer_past_the_vocabulary_before_model_work(tmp_path, smollm):
    """The embedded model's tokenizer beside a checkpoint of 300 tokens: the sweep stops after tokenizing,
    with one line naming the suite, the row and the id, and writes nothing."""
    import json
    import shutil

    from detaudit.cli import app

    model = tmp_path / "small-vocab"
    shutil.copytree(smollm.path, model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    out = tmp_path / "run"
    grid = sweep_args(limit=1, max_new_tokens=None, backends="bio", tp=1, batch_sizes=1, output_path=out)
    res = CliRunner().invoke(app, ["sweep", "--model", str(model), *grid])
    assert res.exit_code == 2, (res.output, res.exception)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in res.output, res.output
    assert "suite smoke: prompt " in lines[0] and "vocab_size of 300" in lines[0], lines[0]
    assert not out.exists() or not any(out.rglob("*.parquet"))
