"""Every hostile, broken or impossible server behaviour the client must survive, against the fake
OpenAI server (`tests/fake_openai.py`, a mock: these answers cannot be provoked from a real server).

Each behaviour must end in its expected way -- completed, its cell failed with one line naming the
server and the field, or one error line and exit 2 -- with no traceback, no hang, no record of an
impossible answer, and no piece of 8 characters of the API key in anything recorded or shown, even
when the server echoes a prefix of it or splits it with control characters.

Two levels. Every behaviour runs against the client itself (`OpenAIEngine`: the probe, generate,
teacher forcing, describe), fast: the outcome a sweep would have (a BadAnswer fails the cell, any
other error is exit 2), the error line and the description the manifest records. A subset (`SWEEP`:
each outcome, each way the key can come back, each impossible answer of issue 54) also runs as a real
sweep (the CLI, the run directory, the embedded model's tokenizer) from an empty working directory:
every file of the run directory, Parquet decompressed, is searched for pieces of the key, no record of
an impossible answer exists, and nothing is written outside the run directory.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fake_openai import MODEL_ID, MUTATIONS, Fake, Served
from helpers import deadline, error_lines, leaked_pieces, secret_pieces, sweep_args
from typer.testing import CliRunner

from detaudit.cli import app

# A key with no 8-character piece in common with anything detaudit writes on its own (its name, paths,
# JSON keys): a piece of it found anywhere came from the server.
SECRET = "sk-Zq7xW4pL9vKt2RmN8bYc3HfJ6gDs0aEu"
KEY_ENV = "DETAUDIT_ANSWERS_KEY"
MAX_NEW = 4
VOCAB = 49152  # the embedded model's: returned ids must lie below it
runner = CliRunner()

# behaviour -> (expected exit code, words the one error line holds, extra sweep options)
OK, CELL_FAILED, ERROR = 0, 1, 2
CHAT = ("--api", "chat")
SAMPLED = ("--temperature", "0.7")
BEHAVIOURS: dict[str, tuple[int, tuple[str, ...], tuple[str, ...]]] = {
    "ok": (OK, (), ()),
    # errors
    "http-400": (ERROR, ("HTTP 400", "max_tokens is too large"), ()),
    "http-401": (ERROR, ("HTTP 401", "not authorized"), ()),
    "http-404": (ERROR, ("HTTP 404", "no such route"), ()),
    "redirect-302": (ERROR, ("HTTP 302", "does not follow it"), ()),
    "http-500-echoing-the-key": (ERROR, ("HTTP 500", "Authorization: Bearer ***"), ()),
    "http-503-always": (ERROR, ("still HTTP 503",), ()),
    "429-twice-then-ok": (OK, (), ()),
    "drop-once": (OK, (), ()),
    "nologprobs": (ERROR, ("no logprobs",), ()),
    "wrong-model": (ERROR, ("model mismatch",), ()),
    "models-not-a-list": (ERROR, ("not an OpenAI model list",), ()),
    "models-empty": (ERROR, ("serves no model",), ()),
    "models-huge-id": (ERROR, ("model mismatch", "mmm"), ()),
    "version-a-number": (OK, (), ()),
    "version-huge": (OK, (), ()),
    # hangs and trickles: --request-timeout is a deadline
    "hang": (ERROR, ("no complete answer within 1.5 s",), ("--request-timeout", "1.5")),
    "trickle": (ERROR, ("no complete answer within 1.5 s",), ("--request-timeout", "1.5")),
    "trickle-models": (ERROR, ("/models: no complete answer within 1.5 s",), ("--request-timeout", "1.5")),
    # huge or malformed bodies
    "huge": (CELL_FAILED, ("bad answer: larger than 32 MiB",), ()),
    "huge-declared": (CELL_FAILED, ("bad answer: larger than 32 MiB",), ()),
    "gzip-bomb": (CELL_FAILED, ("bad answer: larger than 32 MiB",), ()),
    "not-json": (CELL_FAILED, ("bad answer: not JSON",), ()),
    "empty-body": (CELL_FAILED, ("bad answer: not JSON",), ()),
    "answer-null": (CELL_FAILED, ("answer is None, not an object",), ()),
    "deeply-nested-json": (CELL_FAILED, ("bad answer: not JSON",), ()),
    "integer-of-5000-digits": (CELL_FAILED, ("bad answer: not JSON",), ()),
    "string-logprob": (CELL_FAILED, ("token_logprobs[0] is a str",), ()),
    "boolean-logprob": (CELL_FAILED, ("token_logprobs[0] is True, not a number",), ()),
    "integer-token": (CELL_FAILED, ("tokens[0] is 123",), ()),
    "negative-id": (CELL_FAILED, ("tokens[0] is -5, outside the vocabulary",), ()),
    "out-of-vocab-id": (CELL_FAILED, ("tokens[1] is 4000000, outside the vocabulary",), ()),
    "huge-integer-id": (CELL_FAILED, ("tokens[0] is an integer of 30 digits",), ()),
    "token-id-plus-sign": (CELL_FAILED, ("tokens[0] is 'token_id:' without a token number",), ()),
    "token-id-float": (CELL_FAILED, ("tokens[0] is 'token_id:' without a token number",), ()),
    "token-id-arabic-digits": (CELL_FAILED, ("tokens[0] is 'token_id:' without a token number",), ()),
    "token-id-leading-zero": (CELL_FAILED, ("tokens[0] is 'token_id:' without a token number",), ()),
    "token-string-too-long": (CELL_FAILED, ("tokens[0] is a string too long",), ()),
    "huge-integer-logprob": (CELL_FAILED, ("token_logprobs[0] is an integer of 401 digits",), ()),
    "top-not-an-object": (CELL_FAILED, ("top_logprobs[0] is a list, not an object",), ()),
    "top-entry-null": (CELL_FAILED, ("top_logprobs[0] is None, not an object",), ()),
    "top-empty": (ERROR, ("no logprobs",), ()),
    "top-three-entries": (ERROR, ("no logprobs",), ()),
    "lists-of-different-lengths": (CELL_FAILED, ("lists differ in length",), ()),
    "token-logprobs-a-mapping": (CELL_FAILED, ("token_logprobs is a dict, not a list",), ()),
    "no-choices": (CELL_FAILED, ("choices is empty",), ()),
    "choices-null": (CELL_FAILED, ("choices is None, not a list",), ()),
    "choices-a-string": (CELL_FAILED, ("choices is a str, not a list",), ()),
    "answer-a-list": (CELL_FAILED, ("answer is a list, not an object",), ()),
    "logprobs-a-string": (CELL_FAILED, ("choices[0].logprobs is a str, not an object",), ()),
    # impossible answers
    "1000-tokens-for-max-tokens-4": (CELL_FAILED, ("holds 1000 tokens for max_tokens 4",), ()),
    "0-tokens": (CELL_FAILED, ("holds no token",), ()),
    "nan-logprob": (CELL_FAILED, ("token_logprobs[1] is nan",), ()),
    "inf-logprob": (CELL_FAILED, ("token_logprobs[1] is -inf",), ()),
    "positive-logprob": (CELL_FAILED, ("token_logprobs[2] is 0.5",), ()),
    "nan-top-logprob": (CELL_FAILED, ("top_logprobs[0] value 0 is nan",), ()),
    "top-probabilities-over-1": (CELL_FAILED, ("top_logprobs[0] probabilities sum to",), ()),
    "tf-nan": (CELL_FAILED, ("prompt_logprobs", "is nan"), ()),
    "tf-positive": (CELL_FAILED, ("prompt_logprobs", "is 0.5"), ()),
    "tf-string": (CELL_FAILED, ("prompt_logprobs", "is a str"), ()),
    "tf-float32-overflow": (CELL_FAILED, ("prompt_logprobs", "past float32's range"), ()),
    "tf-missing": (OK, (), ()),
    # answers whose numbers contradict each other (issue 54's five, and their kin)
    "greedy-not-top-1": (CELL_FAILED, ("top_logprobs[0] greedy decoding chose", "below the position's top-1"), ()),
    "greedy-token-below-top-k": (CELL_FAILED, ("greedy decoding chose token 299",), ()),
    "own-entry-contradicts": (CELL_FAILED, ("gives the chosen token", "log-probability -3.0, the answer -0.1"), ()),
    "chosen-absent-from-top-k": (CELL_FAILED, ("omits the chosen token", "not the most likely tokens"), ()),
    "duplicate-id-spellings": (CELL_FAILED, ("top_logprobs[0] key", "without a token number"), ()),
    "float32-overflow": (CELL_FAILED, ("token_logprobs[1] is -1e+308, past float32's range",), ()),
    "top-float32-overflow": (CELL_FAILED, ("top_logprobs[0] value 0 is -1e+308",), ()),
    # odd but possible: accepted
    "negative-zero-logprob": (OK, (), ()),
    "near-certain-token-above-0": (OK, (), ()),
    "bf16-rounded-top-entry": (OK, (), ()),
    "greedy-tie": (OK, (), ()),
    "sampled-token-below-top-k": (OK, (), SAMPLED),
    "sampled-token-added-as-k-plus-1": (OK, (), SAMPLED),
    "top-unsorted": (OK, (), ()),
    "top-more-entries-than-asked": (OK, (), ()),
    "finish-reason-a-number": (OK, (), ()),
    "extra-fields": (OK, (), ()),
    # chat answers
    "chat-string-logprob": (CELL_FAILED, ("content[0].logprob is a str",), CHAT),
    "chat-greedy-not-top-1": (CELL_FAILED, ("content[0].top_logprobs greedy decoding chose",), CHAT),
    "chat-own-entry-contradicts": (CELL_FAILED, ("gives the chosen token",), CHAT),
    "chat-chosen-absent-from-top-k": (CELL_FAILED, ("omits the chosen token",), CHAT),
    "chat-duplicate-top-entry": (CELL_FAILED, ("content[0].top_logprobs lists token", "twice"), CHAT),
    "chat-float32-overflow": (CELL_FAILED, ("content[1].logprob is -1e+308",), CHAT),
    "chat-nan-logprob": (CELL_FAILED, ("content[0].logprob is nan",), CHAT),
    "chat-empty-content": (CELL_FAILED, ("holds no token",), CHAT),
    "chat-content-a-string": (CELL_FAILED, ("content is a str, not a list",), CHAT),
    "chat-top-entry-a-string": (CELL_FAILED, ("top_logprobs[0] is a str, not an object",), CHAT),
    "chat-no-logprobs": (ERROR, ("no logprobs",), CHAT),
    # the API key echoed back, whole, in part or split
    "echo-key-in-version": (OK, (), ()),
    "echo-key-in-models": (OK, (), ()),
    "echo-key-prefix-in-version": (OK, (), ()),
    "echo-key-split-in-version": (OK, (), ()),
    "echo-key-after-64k-control-characters": (OK, (), ()),
    "echo-key-zero-width-in-models": (OK, (), ()),
    "echo-key-spaced-in-error": (ERROR, ("HTTP 500", "bad key ***"), ()),
    "echo-key-prefix-in-error": (ERROR, ("HTTP 500", "bad key ***"), ()),
    "echo-key-in-tokens": (OK, (), ("--max-new-tokens", "48")),  # its tokens spell the key (sweep only)
}

# run end to end as well: each outcome, each way the key comes back, the impossible answers of issue 54
SWEEP = (
    "ok",
    "429-twice-then-ok",
    "hang",
    "http-401",
    "nologprobs",
    "wrong-model",
    "huge",
    "not-json",
    "nan-logprob",
    "tf-nan",
    "chat-string-logprob",
    "greedy-not-top-1",
    "own-entry-contradicts",
    "chosen-absent-from-top-k",
    "duplicate-id-spellings",
    "float32-overflow",
    "chat-greedy-not-top-1",
    "echo-key-in-version",
    "echo-key-prefix-in-version",
    "echo-key-split-in-version",
    "echo-key-zero-width-in-models",
    "echo-key-in-tokens",
    "http-500-echoing-the-key",
    "echo-key-prefix-in-error",
)
NEEDS_TOKENIZER = ("echo-key-in-tokens",)


def test_the_matrix_is_wide():
    assert len(BEHAVIOURS) >= 70
    assert set(MUTATIONS) <= set(BEHAVIOURS) and set(SWEEP) <= set(BEHAVIOURS)
    assert {"greedy-not-top-1", "own-entry-contradicts", "chosen-absent-from-top-k"} <= set(SWEEP)
    assert {"duplicate-id-spellings", "float32-overflow"} <= set(SWEEP)
    assert not {SECRET[i : i + 8] for i in range(len(SECRET) - 7)} & {"detaudit", "manifest"}


def _setup(fake: Fake, behaviour: str) -> None:
    fake.reset()
    fake.mode = behaviour
    if behaviour == "429-twice-then-ok":
        fake.failures_left = 2
    if behaviour == "wrong-model":
        fake.model_id = "someone/else-7b"
    if behaviour in ("1000-tokens-for-max-tokens-4", "0-tokens"):
        fake.tokens_out = 1000 if behaviour.startswith("1000") else 0


def _flag(extra: tuple[str, ...], name: str, default: str) -> str:
    return extra[extra.index(name) + 1] if name in extra else default


def _shown(texts: list[str]) -> list[str]:
    return [p for t in texts for p in secret_pieces(t, SECRET)]


# ---------------------------------------------------------------- the client itself (fast)


@pytest.fixture(scope="module")
def served():
    with Served(Fake()) as fake:
        yield fake


def _engine_outcome(fake: Fake, extra: tuple[str, ...]) -> tuple[int, str, list[str]]:
    """(the outcome a sweep would have, the error line, what the manifest would record of the engine)."""
    from detaudit.config import DecodingParams
    from detaudit.errors import DetauditError
    from detaudit.server.client import OpenAIEngine, ServerOptions
    from detaudit.server.wire import BadAnswer

    options = ServerOptions(
        base_url=fake.url,
        api=_flag(extra, "--api", "completions"),
        api_key_env=KEY_ENV,
        model_candidates=(MODEL_ID,),
        vocab_size=VOCAB,
        request_timeout=float(_flag(extra, "--request-timeout", "300")),
    )
    decoding = DecodingParams(
        temperature=float(_flag(extra, "--temperature", "0")), max_new_tokens=int(_flag(extra, "--max-new-tokens", "4"))
    )
    try:
        engine = OpenAIEngine(options)  # the probe: the sweep makes it before any cell (exit 2)
    except DetauditError as e:
        return ERROR, str(e), []
    recorded = [json.dumps(engine.describe())]
    try:
        gens = engine.generate([[1, 2, 3, 4]], ["p0"], decoding, 1, texts=["What is 2+3?"])
        engine.score([[1, 2, 3, 4]], [g.token_ids for g in gens], 1)
    except BadAnswer as e:
        return CELL_FAILED, str(e), recorded
    except DetauditError as e:
        return ERROR, str(e), recorded
    for g in gens:  # a valid answer: what a record would hold
        assert 1 <= len(g.token_ids) <= decoding.max_new_tokens
        assert all(0 <= t < VOCAB for t in g.token_ids + [t for row in g.topk_ids for t in row])
        assert all(math.isfinite(x) and x <= 1e-3 for x in g.token_logprobs + [x for r in g.topk_logprobs for x in r])
    return OK, "", recorded + [json.dumps(engine.describe())]


# behaviours that wait on purpose (a deadline, a retry's backoff): `slow`, out of the fast loop
WAITS = ("hang", "trickle", "trickle-models", "429-twice-then-ok", "drop-once")


@pytest.mark.parametrize(
    "behaviour",
    [pytest.param(b, marks=[pytest.mark.slow] if b in WAITS else []) for b in BEHAVIOURS if b not in NEEDS_TOKENIZER],
)
def test_client_behaviour(served, monkeypatch, behaviour):
    code, words, extra = BEHAVIOURS[behaviour]
    _setup(served, behaviour)
    monkeypatch.setenv(KEY_ENV, SECRET)
    with deadline(60):  # every deadline the client has is far shorter: this one only catches a hang
        got, line, recorded = _engine_outcome(served, extra)
    assert got == code, (behaviour, got, line)
    assert any(h.get("authorization") == f"Bearer {SECRET}" for h in served.headers)  # the key was sent
    assert _shown([line, *recorded]) == [], (line, recorded)
    if code != OK:
        assert "\n" not in line and all(w in line for w in words), line
        assert "127.0.0.1" in line or behaviour in ("wrong-model", "models-huge-id"), line
        assert len(line) < 600, line


# ---------------------------------------------------------------- whole sweeps (slow)


@pytest.fixture(scope="module")
def fake(smollm):
    from detaudit.models import tokenizer_for

    app_ = Fake()
    app_.tokenizer = tokenizer_for(smollm.path)
    with Served(app_) as served:
        yield served


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*") if p.is_file()}


def _impossible(run: Path, vocab: int, max_new: int) -> list[str]:
    """Records no valid answer can give: ids outside the vocabulary, no token or more than `max_new`,
    a log-probability that is not a finite number <= 0, lists of different lengths."""
    bad = []
    for f in sorted((run / "cells").glob("*.parquet")) if (run / "cells").exists() else []:
        for r in pq.read_table(f).to_pylist():
            ids, lps = r["output_token_ids"], r["token_logprobs"]
            values = lps + [x for row in r["topk_logprobs"] for x in row] + list(r["tf_token_logprobs"] or [])
            if not 1 <= len(ids) <= max_new or len(lps) != len(ids) or len(r["topk_ids"]) != len(ids):
                bad.append(f"{f.name}: {len(ids)} tokens")
            if any(not 0 <= t < vocab for t in ids + [t for row in r["topk_ids"] for t in row]):
                bad.append(f"{f.name}: token id out of range")
            if any(not math.isfinite(x) or x > 1e-3 for x in values):
                bad.append(f"{f.name}: impossible log-probability")
    return bad


@pytest.mark.slow  # a sweep with the embedded model's tokenizer each
@pytest.mark.parametrize("behaviour", SWEEP)
def test_behaviour(fake, smollm, tmp_path, monkeypatch, behaviour):
    code, words, extra = BEHAVIOURS[behaviour]
    _setup(fake, behaviour)
    monkeypatch.setenv(KEY_ENV, SECRET)
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    home = Path(os.environ["DETAUDIT_HOME"])
    home_before = _tree(home)
    max_new = int(_flag(extra, "--max-new-tokens", str(MAX_NEW)))
    grid = sweep_args(limit=1, max_new_tokens=max_new, temperature=0, concurrency=1, api_key_env=KEY_ENV)
    args = ["sweep", "--engine", "openai", "--base-url", fake.url, *grid, "--no-analyze", "-o", "run"]
    args += [x for x in extra if x not in ("--max-new-tokens", str(max_new))]
    with deadline(120):
        res = runner.invoke(app, args)
    output = res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in output, output
    assert res.exit_code == code, output
    assert any(h.get("authorization") == f"Bearer {SECRET}" for h in fake.headers)  # the key was sent
    assert secret_pieces(output, SECRET) == [], output
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
    if behaviour == "wrong-model":  # refused by the probe, before the run directory is made
        assert not run.exists()
    if run.exists():
        if code == OK:  # the reports too: they show the outputs' text
            res = runner.invoke(app, ["analyze", str(run)])
            assert res.exit_code == 0 and secret_pieces(res.output, SECRET) == [], res.output
        assert leaked_pieces(run, SECRET) == []
        assert _impossible(run, smollm.config["vocab_size"], max_new) == []
        cells = list((run / "cells").glob("*.parquet")) if (run / "cells").exists() else []
        assert bool(cells) == (code == OK), cells
    if behaviour == "echo-key-in-tokens":  # the server did spell the key: the record holds its text, redacted
        (row,) = pq.read_table(next((run / "cells").glob("*.parquet"))).to_pylist()
        assert "***" in row["output_text"] and len(row["output_token_ids"]) > 8, row["output_text"]
