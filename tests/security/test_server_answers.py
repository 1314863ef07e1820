"""Every hostile, broken or impossible server behaviour the client must survive, against the fake
OpenAI server (`tests/fake_openai.py`, a mock: these answers cannot be provoked from a real server).

Each behaviour runs a real sweep (the CLI, the run directory, the embedded model's tokenizer) from an
empty working directory and must end in its expected way -- completed, its cell failed with one line
naming the server and the field, or one error line and exit 2 -- with, in every case: no traceback, no
record of an impossible answer, the API key in no output line and in no byte of any file of the run
directory (Parquet decompressed), and nothing written outside the run directory.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fake_openai import MUTATIONS, Fake, Served
from helpers import error_lines, find_secrets
from typer.testing import CliRunner

from detaudit.cli import app

pytestmark = pytest.mark.slow
SECRET = "sk-detaudit-answers-0123456789abcdef"
MAX_NEW = 4
runner = CliRunner()

# behaviour -> (expected exit code, words the one error line holds; extra sweep options)
OK, CELL_FAILED, ERROR = 0, 1, 2
BEHAVIOURS: dict[str, tuple[int, tuple[str, ...], tuple[str, ...]]] = {
    # errors
    "http-400": (ERROR, ("HTTP 400", "max_tokens is too large"), ()),
    "http-401": (ERROR, ("HTTP 401", "not authorized"), ()),
    "http-500-echoing-the-key": (ERROR, ("HTTP 500", "Authorization: Bearer ***"), ()),
    "http-503-always": (ERROR, ("still HTTP 503",), ()),
    "429-twice-then-ok": (OK, (), ()),
    "drop-once": (OK, (), ()),
    "nologprobs": (ERROR, ("no logprobs",), ()),
    "wrong-model": (ERROR, ("model mismatch",), ()),
    # hangs and trickles: --request-timeout is a deadline
    "hang": (ERROR, ("no complete answer within 1.5 s",), ("--request-timeout", "1.5")),
    "trickle": (ERROR, ("no complete answer within 1.5 s",), ("--request-timeout", "1.5")),
    "trickle-models": (ERROR, ("/models: no complete answer within 1.5 s",), ("--request-timeout", "1.5")),
    # huge or malformed bodies
    "huge": (CELL_FAILED, ("bad answer: larger than 32 MiB",), ()),
    "huge-declared": (CELL_FAILED, ("bad answer: larger than 32 MiB",), ()),
    "not-json": (CELL_FAILED, ("bad answer: not JSON",), ()),
    "deeply-nested-json": (CELL_FAILED, ("bad answer: not JSON",), ()),
    "integer-of-5000-digits": (CELL_FAILED, ("bad answer: not JSON",), ()),
    "string-logprob": (CELL_FAILED, ("token_logprobs[0] is a str",), ()),
    "integer-token": (CELL_FAILED, ("tokens[0] is 123",), ()),
    "negative-id": (CELL_FAILED, ("tokens[0] is -5, outside the vocabulary",), ()),
    "out-of-vocab-id": (CELL_FAILED, ("tokens[1] is 4000000, outside the vocabulary",), ()),
    "huge-integer-id": (CELL_FAILED, ("tokens[0] is an integer of 30 digits",), ()),
    "huge-integer-logprob": (CELL_FAILED, ("token_logprobs[0] is an integer of 401 digits",), ()),
    "top-not-an-object": (CELL_FAILED, ("top_logprobs[0] is a list, not an object",), ()),
    "lists-of-different-lengths": (CELL_FAILED, ("lists differ in length",), ()),
    "no-choices": (CELL_FAILED, ("choices is empty",), ()),
    "choices-a-string": (CELL_FAILED, ("choices is a str, not a list",), ()),
    "answer-a-list": (CELL_FAILED, ("answer is a list, not an object",), ()),
    "logprobs-a-string": (CELL_FAILED, ("choices[0].logprobs is a str, not an object",), ()),
    "chat-string-logprob": (CELL_FAILED, ("content[0].logprob is a str",), ("--api", "chat")),
    # impossible answers
    "1000-tokens-for-max-tokens-4": (CELL_FAILED, ("holds 1000 tokens for max_tokens 4",), ()),
    "0-tokens": (CELL_FAILED, ("holds no token",), ()),
    "nan-logprob": (CELL_FAILED, ("token_logprobs[1] is nan",), ()),
    "inf-logprob": (CELL_FAILED, ("token_logprobs[1] is -inf",), ()),
    "positive-logprob": (CELL_FAILED, ("token_logprobs[2] is 0.5",), ()),
    "nan-top-logprob": (CELL_FAILED, ("top_logprobs[0] value 0 is nan",), ()),
    "top-probabilities-over-1": (CELL_FAILED, ("top_logprobs[0] probabilities sum to",), ()),
    "tf-nan": (CELL_FAILED, ("prompt_logprobs", "is nan"), ()),
    # the API key echoed back
    "echo-key-in-version": (OK, (), ()),
    "echo-key-in-models": (OK, (), ()),
}


def test_the_matrix_is_wide():
    assert len(BEHAVIOURS) >= 26
    assert set(MUTATIONS) <= set(BEHAVIOURS)


@pytest.fixture(scope="module")
def fake(smollm):
    with Served(Fake()) as served:
        yield served


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _impossible(run: Path, vocab: int) -> list[str]:
    """Records no valid answer can give: ids outside the vocabulary, no token or more than MAX_NEW,
    a log-probability that is not a finite number <= 0, lists of different lengths."""
    bad = []
    for f in sorted((run / "cells").glob("*.parquet")) if (run / "cells").exists() else []:
        for r in pq.read_table(f).to_pylist():
            ids, lps = r["output_token_ids"], r["token_logprobs"]
            values = lps + [x for row in r["topk_logprobs"] for x in row] + list(r["tf_token_logprobs"] or [])
            if not 1 <= len(ids) <= MAX_NEW or len(lps) != len(ids) or len(r["topk_ids"]) != len(ids):
                bad.append(f"{f.name}: {len(ids)} tokens")
            if any(not 0 <= t < vocab for t in ids + [t for row in r["topk_ids"] for t in row]):
                bad.append(f"{f.name}: token id out of range")
            if any(not math.isfinite(x) or x > 1e-3 for x in values):
                bad.append(f"{f.name}: impossible log-probability")
    return bad


@pytest.mark.parametrize("behaviour", list(BEHAVIOURS))
def test_behaviour(fake, smollm, tmp_path, monkeypatch, behaviour):
    code, words, extra = BEHAVIOURS[behaviour]
    fake.reset()
    fake.mode = behaviour
    if behaviour == "429-twice-then-ok":
        fake.failures_left = 2
    if behaviour == "wrong-model":
        fake.model_id = "someone/else-7b"
    if behaviour in ("1000-tokens-for-max-tokens-4", "0-tokens"):
        fake.tokens_out = 1000 if behaviour.startswith("1000") else 0
    monkeypatch.setenv("DETAUDIT_ANSWERS_KEY", SECRET)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    home = Path(os.environ["DETAUDIT_HOME"])
    home_before = _tree(home)
    res = runner.invoke(
        app,
        [
            "sweep",
            "--engine",
            "openai",
            "--base-url",
            fake.url,
            "--suites",
            "smoke",
            "--limit",
            "1",
            "--max-new-tokens",
            str(MAX_NEW),
            "--temperature",
            "0",
            "--concurrency",
            "1",
            "--api-key-env",
            "DETAUDIT_ANSWERS_KEY",
            "--no-analyze",
            "-o",
            "run",
            *extra,
        ],
    )
    output = res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in output, output
    assert res.exit_code == code, output
    assert any(h.get("authorization") == f"Bearer {SECRET}" for h in fake.headers)  # the key was sent
    assert SECRET not in output, output
    if code == ERROR:
        lines = error_lines(output)  # (the first request fails once its cell started: log lines come first)
        assert len(lines) == 1 and lines[0].startswith("error: "), output
        assert all(w in lines[0] for w in words), lines[0]
        assert "127.0.0.1" in lines[0] or behaviour == "wrong-model", lines[0]
    elif code == CELL_FAILED:
        failed = [x for x in output.splitlines() if x.startswith("cell ") and " failed: " in x]
        assert len(failed) == 1, output
        assert f"server {fake.url}" in failed[0] and all(w in failed[0] for w in words), failed[0]
    run = cwd / "run"
    assert sorted(p.name for p in cwd.iterdir()) == (["run"] if run.exists() else []), (
        "written outside the run directory"
    )
    assert _tree(home) == home_before, "the model cache changed"
    if run.exists():
        assert find_secrets(run, [SECRET]) == []
        assert _impossible(run, smollm.config["vocab_size"]) == []
        cells = list((run / "cells").glob("*.parquet")) if (run / "cells").exists() else []
        assert bool(cells) == (code == OK), cells
