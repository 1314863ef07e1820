"""`--engine openai` against a fake OpenAI server: the client's error paths and its secrets.

The fake server is a mock (a raw ASGI app served by uvicorn on 127.0.0.1 in a thread) because the
error paths it plays -- a 429 before success, an answer without logprobs, another model id, a hung
server -- cannot be provoked on demand from a real one. Everything else is real: the CLI, the sweep,
the run directory, the tokenizer of the embedded model. The real-server audit is in
`test_server_vllm.py`.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import uvicorn
from helpers import find_secrets, listening
from typer.testing import CliRunner

from detaudit.cli import app

runner = CliRunner()
SECRET = "sk-detaudit-test-0123456789abcdef"
MODEL_ID = "smollm2-135m"


class Fake:
    """Plays one behaviour per test; records what it received."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.model_id = MODEL_ID
        self.requests: list[dict] = []
        self.headers: list[dict] = []
        self.failures_left = 0

    def completion(self, body: dict) -> dict:
        prompt = body["prompt"]
        k = int(body.get("logprobs") or 0)
        n = int(body.get("max_tokens", 1))
        ids = [(sum(prompt) + 7 * i) % 400 + 10 for i in range(n)]
        lp = {
            "tokens": [f"token_id:{t}" for t in ids],
            "token_logprobs": [-0.1 - 0.01 * i for i in range(n)],
            "top_logprobs": [
                {f"token_id:{t + j}": -0.1 - 0.5 * j - 0.01 * i for j in range(k)} for i, t in enumerate(ids)
            ],
            "text_offset": list(range(n)),
        }
        choice = {"index": 0, "text": "x" * n, "finish_reason": "length", "logprobs": lp if k else None}
        if self.mode == "nologprobs":
            choice["logprobs"] = None
        if body.get("prompt_logprobs") is not None:
            choice["prompt_logprobs"] = [None] + [
                {str(t): {"logprob": -1.0 - 0.001 * p, "rank": 1}} for p, t in enumerate(prompt[1:], 1)
            ]
        return {"id": "cmpl", "object": "text_completion", "model": self.model_id, "choices": [choice]}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                msg = await receive()
                if msg["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif msg["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        body = b""
        while True:
            msg = await receive()
            body += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        path = scope["path"]
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        status, out = 404, {"error": {"message": "not found"}}
        if path == "/v1/models":
            status, out = (
                200,
                {"object": "list", "data": [{"id": self.model_id, "object": "model", "owned_by": "vllm"}]},
            )
        elif path == "/version":
            status, out = 200, {"version": "fake-0.1"}
        elif path == "/v1/completions":
            req = json.loads(body)
            self.requests.append(req)
            if self.mode == "hang":
                await asyncio.sleep(30)
            if self.failures_left > 0:
                self.failures_left -= 1
                status, out = 429, {"error": {"message": "too many requests"}}
            else:
                status, out = 200, self.completion(req)
        data = json.dumps(out).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": data})


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake():
    app_ = Fake()
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app_, host="127.0.0.1", port=port, log_level="error", lifespan="on", timeout_graceful_shutdown=1)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:  # a server that cannot start ends its thread
        assert thread.is_alive(), "fake server did not start"
        time.sleep(0.05)
    app_.url = f"http://127.0.0.1:{port}/v1"
    yield app_
    server.should_exit = True
    thread.join(timeout=10)


@pytest.fixture(autouse=True)
def reset(fake, smollm):
    fake.mode, fake.model_id, fake.failures_left = "ok", MODEL_ID, 0
    fake.requests.clear()
    fake.headers.clear()
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
            "--suites",
            "smoke",
            "--limit",
            "2",
            "--max-new-tokens",
            "3",
            "--temperature",
            "0",
            "--api-key-env",
            "DETAUDIT_TEST_KEY",
            "--no-analyze",
            "-o",
            str(out),
            *extra,
        ],
    )


def one_line_exit_2(res, *words: str) -> str:
    assert res.exit_code == 2, res.output
    lines = [x for x in res.output.strip().splitlines() if x.strip()]
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


def test_hang_is_bounded(fake, tmp_path):
    """A server that does not answer in time: the request timeout ends the sweep with one line (the fake
    answers after 30 s: a sweep that waited for it would complete, exit 0)."""
    fake.mode = "hang"
    res = sweep(fake.url, tmp_path / "run", "--concurrency", "1", "--request-timeout", "1.5")
    one_line_exit_2(res, "no response within 1.5 s")


def test_credentials_in_url_refused(fake, tmp_path):
    url = fake.url.replace("http://", f"http://user:{SECRET}@")
    line = one_line_exit_2(sweep(url, tmp_path / "run"), "no credentials")
    assert "user" not in line
