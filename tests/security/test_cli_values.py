"""Command-line values that name where to write, where to connect or what to link, refused up front
(one line, exit 2, nothing created): a port past 65535, an empty or over-long output path, a report
URL that would inject markdown, a flag that has nothing to apply to, a task name no cell file can be
named after, and the JUnit file written atomically."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import one_line_error, require
from typer.testing import CliRunner
from unit.test_analyze import invariant_cells, make_run

from detaudit.cli import app
from detaudit.errors import DetauditError

runner = CliRunner()
LONG = "a" * 300  # one name component: past every filesystem's 255 bytes


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path / "run", invariant_cells(), backends=("bio+tbik",))


@pytest.fixture
def cwd(tmp_path, monkeypatch):
    here = tmp_path / "cwd"
    here.mkdir()
    monkeypatch.chdir(here)
    return here


OPENAI = ["sweep", "--engine", "openai", "--suites", "smoke", "--no-analyze"]


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://127.0.0.1:99999/v1", "the port must be a number from 1 to 65535"),
        ("http://127.0.0.1:65536/v1", "the port must be a number from 1 to 65535"),
        ("http://127.0.0.1:0/v1", "the port must be a number from 1 to 65535"),
        ("http://127.0.0.1:http/v1", "the port must be a number from 1 to 65535"),
        ("http://[::1]:99999/v1", "the port must be a number from 1 to 65535"),
        ("http://127.0.0.1:8000/v1\n", "no spaces or control characters"),
        ("http://127.0.0.1:8000/v 1", "no spaces or control characters"),
    ],
)
def test_a_base_url_no_socket_can_use_is_refused_before_any_work(cwd, url, message):
    """Before: port 99999 reached the socket layer (OverflowError traceback) after the run directory
    was made."""
    one_line_error(runner.invoke(app, [*OPENAI, "--base-url", url, "-o", "run"]), message)
    assert list(cwd.iterdir()) == []


def _outputs(run: Path, value: str) -> dict[str, list[str]]:
    return {
        "sweep": ["sweep", "--suites", "smoke", "-o", value],
        "align": ["align", "-o", value],
        "analyze": ["analyze", str(run), "-o", value],
        "report": ["report", str(run), "-o", value],
        "merge": ["merge", str(run), "-o", value],
        "gate": ["gate", str(run), "--junit", value],
    }


@pytest.mark.parametrize("command", ["sweep", "align", "analyze", "report", "merge", "gate"])
@pytest.mark.parametrize(
    "value, message",
    [
        ("", "is empty"),
        (" ", "is empty"),
        (f"x/{LONG}", "is 300 bytes long; the filesystem takes at most 255"),
        (f"{LONG}/y", "is 300 bytes long"),
    ],
    ids=["empty", "blank", "long-leaf", "long-parent"],
)
def test_an_output_path_that_cannot_be_made_is_a_usage_error(run, cwd, monkeypatch, command, value, message):
    """Before: `sweep -o ''` wrote the run into the working directory (typer reads '' as '.'); a name
    of 300 characters failed with `File name too long` (a traceback in merge) after the work, leaving
    its parent directories behind."""
    import detaudit.models

    def no_model_work(*args, **kwargs):
        raise AssertionError("model work started")

    monkeypatch.setattr(detaudit.models, "resolve_model", no_model_work)
    before = sorted(p.name for p in run.iterdir())
    one_line_error(runner.invoke(app, _outputs(run, value)[command]), message)
    assert list(cwd.iterdir()) == []  # nothing made: no run, no parent directory
    assert sorted(p.name for p in run.iterdir()) == before


def test_align_refuses_an_output_path_that_is_a_file_before_running_the_model(cwd, monkeypatch):
    import detaudit.models

    def no_model_work(*args, **kwargs):
        raise AssertionError("model work started")

    monkeypatch.setattr(detaudit.models, "resolve_model", no_model_work)
    (cwd / "afile").write_text("mine\n")
    one_line_error(runner.invoke(app, ["align", "-o", "afile"]), "output path afile is not a directory")
    assert (cwd / "afile").read_text() == "mine\n"


@pytest.mark.parametrize(
    "url, message",
    [
        ("https://ci.example/run/1\n# injected heading", "no spaces, control or non-ASCII characters"),
        ("https://ci.example/run/1) ![x](https://evil.example/p.png", "no spaces, control or non-ASCII characters"),
        ("https://ci.example/run/1>", "angle brackets"),
        ("https://ci.example/(x)", "parentheses"),
        ("https://ci.example/`x`", "backticks"),
        ("javascript:alert(1)", "parentheses"),
        ("javascript:void", "expected an http(s)://HOST/... URL"),
        ("ci.example/run/1", "expected an http(s)://HOST/... URL"),
    ],
)
def test_a_report_url_that_would_inject_markdown_is_refused(run, url, message):
    one_line_error(runner.invoke(app, ["gate", str(run), "--format", "markdown", "--report-url", url]), message)


@pytest.mark.parametrize("url", ["https://ci.example/run/1?a=b#c", "http://[::1]:8080/runs/7"])
def test_a_report_url_is_linked_as_given(run, url):
    res = runner.invoke(app, ["gate", str(run), "--format", "markdown", "--report-url", url])
    assert res.exit_code == 0, res.output
    assert f"[the report]({url})" in res.stdout


def test_allow_mismatch_without_a_baseline_is_refused(run):
    """Before: `gate --allow-mismatch` alone passed silently, as if the flag had done something."""
    res = runner.invoke(app, ["gate", str(run), "--allow-mismatch"])
    one_line_error(res, "--allow-mismatch applies to a --baseline")


def test_api_key_env_with_a_server_detaudit_starts_is_refused(cwd, monkeypatch):
    require("httpx", "server")
    monkeypatch.setenv("MY_KEY", "sk-abc")
    res = runner.invoke(app, ["sweep", "--engine", "vllm-server", "--api-key-env", "MY_KEY", "-o", "run"])
    if "needs vLLM" in res.output:
        pytest.skip("vLLM is not installed")
    one_line_error(res, "--api-key-env applies to --engine openai")
    assert list(cwd.iterdir()) == []


# ---- a task name no cell file can be named after


def test_a_task_name_too_long_for_a_cell_id_is_refused_by_its_name():
    """Before: a 300-character `task:` was blamed on the manifest, after the run directory was made."""
    from detaudit.config import SweepConfig
    from detaudit.sweep import check_cell_ids

    check_cell_ids(SweepConfig(model="m", suites=("t" * 150,), backends=("bio+tbik",), tp=(8,), batch_sizes=(100,)))
    cfg = SweepConfig(model="m", suites=("t" * 300,), backends=("bf16",), tp=(1,), batch_sizes=(1,))
    with pytest.raises(DetauditError, match=r"its task name \(300 characters\) makes cell ids of 316") as e:
        check_cell_ids(cfg)
    assert "shorten `task:`" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow  # loads a (tiny) model and tokenizes the suite
def test_a_sweep_of_a_task_named_too_long_leaves_no_run_directory(tiny_sweep_model, tmp_path):
    suite = tmp_path / "evals" / "long.yaml"
    suite.parent.mkdir()
    suite.write_text(f"task: {'t' * 300}\ndocs: [{{question: 'What is 2+3?', answer: '5'}}]\ndoc_to_text: question\n")
    args = ["sweep", "--model", str(tiny_sweep_model), "--suites", str(suite), "--backends", "bf16", "--tp", "1"]
    res = runner.invoke(app, [*args, "--batch-sizes", "1", "--max-new-tokens", "2", "-o", str(tmp_path / "run")])
    assert res.exit_code == 2 and "its task name (300 characters)" in res.output, res.output
    assert "Traceback" not in res.output and not (tmp_path / "run").exists()


# ---- gate --junit: written atomically


def test_junit_is_replaced_whole_or_not_at_all(run, tmp_path):
    """A write that fails part way (here: files may not grow past 1 KiB, as on a full disk) leaves the
    previous JUnit file as it was. Before: it was truncated, then written in place, half a file."""
    junit = tmp_path / "gate.xml"
    res = runner.invoke(app, ["gate", str(run), "--junit", str(junit)])
    assert res.exit_code == 0 and junit.stat().st_size > 1024, res.output
    previous = junit.read_bytes()

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", "from detaudit.cli import main; main()", "gate", str(run), "--junit", str(junit)],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        env=env,
    )
    assert proc.returncode == 2 and "cannot write --junit" in proc.stderr and "Traceback" not in proc.stderr
    assert junit.read_bytes() == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gate.xml", "run"]  # no temporary file left


# ---- what the server client asks for


def test_vllm_and_sglang_requests_turn_the_models_repetition_penalty_off():
    """vLLM and SGLang apply a model's generation_config (Qwen2.5's repetition_penalty 1.05) to any field a
    request leaves out: a greedy answer would then not be the top-1 of the log-probabilities they return
    (raw ones), and detaudit refuses such an answer. The request says 1.0; a generic server gets only
    OpenAI's fields."""
    from detaudit.config import DecodingParams
    from detaudit.server import wire

    d = DecodingParams(temperature=0)
    assert wire.completion_body("m", [1], d, "p", "vllm")["repetition_penalty"] == 1.0
    assert wire.chat_body("m", "hi", d, "p", "sglang")["repetition_penalty"] == 1.0
    assert "repetition_penalty" not in wire.completion_body("m", [1], d, "p", "generic")
