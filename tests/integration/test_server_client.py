"""`--engine openai` against a fake OpenAI server: the client's paths, its secrets, SGLang's format.

The fake server (`tests/fake_openai.py`) is a mock because the behaviours it plays -- a 429 before
success, an answer without logprobs, another model id, a hung server, SGLang's answer format (SGLang
does not run on these CPUs) -- cannot be provoked on demand from a real one. Everything else is real:
the CLI, the sweep, the run directory, the tokenizer of the embedded model. The real-server audit is in
`test_server_vllm.py`; every malformed, impossible or hostile answer in `tests/security/test_server_answers.py`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from fake_openai import MODEL_ID, Fake, Served, free_port
from helpers import error_lines, find_secrets, listening, sweep_args
from typer.testing import CliRunner

from detaudit.cli import app

runner = CliRunner()
SECRET = "sk-detaudit-test-0123456789abcdef"


@pytest.fixture(scope="module")
def fake(smollm):
    from detaudit.models import tokenizer_for

    app_ = Fake()
    app_.tokenizer = tokenizer_for(smollm.path)
    with Served(app_) as served:
        yield served


@pytest.fixture(autouse=True)
def reset(fake):
    fake.reset()
    os.environ["DETAUDIT_TEST_KEY"] = SECRET
    yield
    os.environ.pop("DETAUDIT_TEST_KEY", None)


def sweep(url: str, out: Path, *extra: str):
    return runner.invoke(
        app,
        [
            "sweep",
            "--engine",
            "openai",
            "--base-url",
            url,
            *sweep_args(max_new_tokens=3, temperature=0, api_key_env="DETAUDIT_TEST_KEY", no_analyze=True),
            "-o",
            str(out),
            *extra,
        ],
    )


def one_line_exit_2(res, *words: str) -> str:
    assert res.exit_code == 2, res.output
    lines = error_lines(res.output)  # (an error found once cells run follows the sweep's log lines)
    assert len(lines) == 1, res.output
    assert "Traceback" not in res.output
    for w in words:
        assert w in lines[0], lines[0]
    assert SECRET not in res.output
    return lines[0]


def test_audit_records_secrets_and_loopback(fake, tmp_path):
    """A sweep over two concurrency levels and background load writes ordinary cells (ids, top-k
    logprobs, teacher forcing, repeats); the API key is sent but never written; the client listens on
    nothing. (The fake answers deterministically, so its 8 configurations must agree exactly: a real
    bf16 server need not. Against the real vLLM server, with a key it checks: test_server_vllm.py.)"""
    out = tmp_path / "run"
    res = sweep(fake.url, out, "--concurrency", "1,2", "--background-load", "0,2", "--repeats", "2")
    assert res.exit_code == 0, res.output
    assert SECRET not in res.output
    assert any(h.get("authorization") == f"Bearer {SECRET}" for h in fake.headers)
    audited = [r for r in fake.requests if r.get("logprobs")]
    assert {r["seed"] for r in audited} and all(r["return_tokens_as_token_ids"] for r in audited)
    assert any(r.get("prompt_logprobs") == 0 for r in fake.requests)  # teacher forcing
    assert any(not r.get("logprobs") and "prompt_logprobs" not in r for r in fake.requests)  # background load
    man = json.loads((out / "manifest.json").read_text())
    assert set(man["cells"]) == {f"smoke__bf16__tp1__bs{c}{s}" for c in (1, 2) for s in ("", "__bg2")}
    assert man["comparable"]["server_model"] == MODEL_ID and "model_checksum" not in man["comparable"]
    desc = man["backends"]["bf16@tp1@bs2@bg2"]
    assert desc["server"]["version"] == "fake-0.1" and desc["load"]["background"] == 2
    t = pq.read_table(next((out / "cells").glob("smoke__bf16__tp1__bs1.*")))
    assert t.num_rows == 4 and sorted(t.column("repeat").to_pylist()) == [0, 0, 1, 1]
    assert all(len(k) == 10 for row in t.column("topk_ids").to_pylist() for k in row)
    assert all(x is not None for x in t.column("tf_token_logprobs").to_pylist())
    assert find_secrets(out, [SECRET]) == []  # Parquet pages and metadata decoded, not only raw bytes
    # the client opens no listening socket: the only one in this process tree is the fake server's own
    assert {port for _, _, port in listening([os.getpid()])} == {int(fake.url.split(":")[2].split("/")[0])}
    res = runner.invoke(app, ["analyze", str(out), "--json"])
    assert res.exit_code == 0, res.output
    row = json.loads(res.stdout)[0]
    assert row["cells"] == 4 and row["unique_max"] == 1  # the fake is deterministic: 8 configurations agree


def test_unreachable(tmp_path):
    res = sweep(f"http://127.0.0.1:{free_port()}/v1", tmp_path / "run")
    one_line_exit_2(res, "cannot reach server", "127.0.0.1")


def test_429_then_success(fake, tmp_path):
    fake.failures_left = 2
    res = sweep(fake.url, tmp_path / "run", "--concurrency", "1")
    assert res.exit_code == 0, res.output
    man = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert man["backends"]["bf16@tp1@bs1"]["retries_used"] == 2


def test_missing_logprobs(fake, tmp_path):
    fake.mode = "nologprobs"
    one_line_exit_2(sweep(fake.url, tmp_path / "run", "--concurrency", "1"), "no logprobs")


def test_wrong_model(fake, tmp_path):
    fake.model_id = "someone/else-7b"
    one_line_exit_2(sweep(fake.url, tmp_path / "run"), "model mismatch", "someone/else-7b")


@pytest.mark.parametrize("mode", ["hang", "trickle"])
def test_request_timeout_is_a_deadline(fake, tmp_path, mode):
    """A server that does not answer for 30 s, and one that answers a byte every 0.3 s for a minute (each
    read is quick, the whole is late), both end the sweep at the deadline of one request: told by the
    message, not by a clock (a client without the deadline would get the late answers: a completion, then
    a malformed one)."""
    fake.mode = mode
    res = sweep(fake.url, tmp_path / "run", "--concurrency", "1", "--request-timeout", "1.5")
    one_line_exit_2(res, "no complete answer within 1.5 s")


def test_credentials_in_url_refused(fake, tmp_path):
    url = fake.url.replace("http://", f"http://user:{SECRET}@")
    line = one_line_exit_2(sweep(url, tmp_path / "run"), "no credentials")
    assert "user" not in line


def test_sglang_answer_format(fake, tmp_path):
    """SGLang's /v1/completions (its `to_openai_style_logprobs`): token texts, top-k keyed by text,
    exact generated ids in `choices[0].token_ids` when asked with `return_token_ids`, prompt
    log-probabilities through `echo`. Recorded: the ids SGLang generated, the top-k mapped from texts
    with --model's tokenizer, teacher forcing via echo; the manifest says which ids are exact."""
    fake.owner = "sglang"
    out = tmp_path / "run"
    res = sweep(fake.url, out, "--concurrency", "1,2")
    assert res.exit_code == 0, res.output
    audited = [r for r in fake.requests if r.get("logprobs") and not r.get("echo")]
    assert audited and all(r["return_token_ids"] is True and "return_tokens_as_token_ids" not in r for r in audited)
    assert all(isinstance(r["seed"], int) and r["temperature"] == 0.0 for r in audited)
    assert any(r.get("echo") and r["logprobs"] == 1 for r in fake.requests)  # teacher forcing
    man = json.loads((out / "manifest.json").read_text())
    d = man["backends"]["bf16@tp1@bs2"]
    assert d["server"]["kind"] == "sglang" and d["server"]["version"] is None
    assert d["token_ids"].startswith("generated tokens returned as ids (SGLang return_token_ids)"), d["token_ids"]
    assert d["teacher_forcing"].startswith("echo"), d["teacher_forcing"]
    expected = {tuple(r["prompt"]): [(sum(r["prompt"]) + 7 * i) % 400 + 300 for i in range(3)] for r in audited}
    t = pq.read_table(out / "cells" / "smoke__bf16__tp1__bs1.parquet").to_pylist()
    assert len(t) == 2
    for row in t:
        assert row["output_token_ids"] in expected.values()
        assert all(len(k) >= 5 for k in row["topk_ids"])
        # the fake's top-1 is the generated token: its text maps back to the same id
        assert [k[0] for k in row["topk_ids"]] == row["output_token_ids"], row["topk_ids"]
        assert row["tf_token_logprobs"] is not None and all(x < 0 for x in row["tf_token_logprobs"])


def test_prefix_load_pattern(fake, tmp_path):
    """`--background-prompts prefix`: the background requests are cuts of one long text per audited
    prompt (shorter than it, or extending it); each cell names its pattern, and the run's identity
    holds it (a resumed run cannot mix patterns)."""
    out = tmp_path / "run"
    res = sweep(fake.url, out, "--concurrency", "1", "--background-load", "2", "--background-prompts", "prefix")
    assert res.exit_code == 0, res.output
    audited = {tuple(r["prompt"]) for r in fake.requests if r.get("logprobs")}
    background = [r["prompt"] for r in fake.requests if not r.get("logprobs") and "prompt_logprobs" not in r]
    assert background
    for b in background:
        assert any(list(a[: len(b)]) == b or b[: len(a)] == list(a) for a in audited), "not a cut of an audited prompt"
    man = json.loads((out / "manifest.json").read_text())
    assert man["backends"]["bf16@tp1@bs1@bg2"]["load"]["background_prompts"] == "prefix"
    assert man["backends"]["bf16@tp1@bs1@bg2"]["load"]["background_sent"] >= 2
    assert man["comparable"]["load_pattern"] == "prefix"


@pytest.mark.slow  # a 4-cell sweep of a deliberately slow fake, then every report format
def test_server_audit_report_has_the_load_axis(fake, tmp_path):
    """A concurrency 1/2 x background 0/2 x 2-repeat audit of a server whose numerics move with its load
    (the fake's `load-variant`: the sequential cell, which runs first, answered alone; every request of
    the others under load): the report names every cell by its load (cells table columns, agreement
    labels), gives the headline "N requests, K distinct completions" and one row per configuration
    against the sequential baseline, with the exact divergence the fake put in."""
    from detaudit.analysis.analyze import analyze
    from detaudit.render import cell_labels

    fake.mode = "load-variant"
    fake.alone = 4  # the sequential baseline's 2 prompts x 2 repeats
    run = tmp_path / "run"
    res = sweep(fake.url, run, "--concurrency", "1,2", "--background-load", "0,2", "--repeats", "2")
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["report", str(run), "--format", "md,csv,html"])
    assert res.exit_code == 0, res.output
    # the headline, counted here from the records themselves
    rows = [r for f in sorted((run / "cells").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    per_prompt = {}
    for r in rows:
        per_prompt.setdefault(r["prompt_id"], set()).add(tuple(r["output_token_ids"]))
    k = sum(len(v) for v in per_prompt.values())
    assert len(rows) == 16 and k == 4  # per prompt: the answer alone and the answer under load
    headline = (
        f"smoke / bf16: 16 requests, {k} distinct completions (2 prompts; at most "
        f"{max(len(v) for v in per_prompt.values())} for one prompt) over 4 load configurations"
    )
    md = (run / "report.md").read_text()
    assert f"**{headline}**" in md, md[:1500]
    assert "| configuration | concurrency | background | pattern | repeats | requests | distinct" in md
    assert "| bitwise as baseline | differ from baseline |" in md
    assert "| cell | backend | TP | concurrency | background | pattern | repeats | TP mode |" in md
    for label in ("c1/bg0 (baseline)", "c1/bg2 suite", "c2/bg0", "c2/bg2 suite"):
        assert f"| {label} |" in md, label
    load = {r["label"]: r for r in __import__("csv").DictReader((run / "load.csv").open())}
    base = load["c1/bg0"]
    assert base["baseline"] == "True" and base["differ"] == "0" and base["distinct_max"] == "1"
    assert base["identical"] == base["compared"] == "2"  # its second sends, bitwise its first
    assert base["maxprob_div_max"] == "0.0" and base["logprob_diff_max"] == "0.0"  # alone: bitwise the same
    for label in ("c1/bg2 suite", "c2/bg0", "c2/bg2 suite"):  # loaded: every request moved from its third token
        r = load[label]
        assert r["differ"] == r["compared"] == "4" and r["identical"] == "0" and r["first_div_min"] == "2", r
        assert float(r["logprob_diff_max"]) == pytest.approx(0.01, abs=1e-5), r
    html = (run / "report.html").read_text()
    assert headline in html and 'alt="load smoke"' in html
    labels = cell_labels(analyze(run))  # the agreement heatmap's and accuracy plot's tick labels
    assert len(set(labels.values())) == len(labels) == 4, labels
    res = runner.invoke(app, ["analyze", str(run)])
    assert headline in " ".join(res.output.split()), res.output
