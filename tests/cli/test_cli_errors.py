"""Bad input: one clear line, exit code 2, no traceback. These cases fail before any model work."""

from __future__ import annotations

import pytest
import torch
from helpers import one_line_error
from typer.testing import CliRunner

from detaudit.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tp", "3"], "TP size must be one of 1, 2, 4, 8"),
        (["--tp", "16"], "TP size must be one of 1, 2, 4, 8"),
        (["--tp", "a,b"], "comma-separated integers"),
        (["--batch-sizes", "0"], "batch size must be between 1 and"),
        (["--batch-sizes", "-4"], "batch size must be between 1 and"),
        (["--max-new-tokens", "0"], "--max-new-tokens must be between 1 and"),
        (["--backends", "bf16,nope"], "unknown backend 'nope'"),
        (["--suites", "nope"], "unknown suite"),
        (["--logprobs", "3"], "--logprobs must be >= 5"),
        (["--tp-mode", "fake"], "Invalid value for '--tp-mode'"),
        (["--dtype", "float16"], "Invalid value for '--dtype'"),
        (["--limit", "0"], "--limit must be between 1 and"),
        (["--temperature", "-1"], "--temperature must be >= 0"),
        (["--tp", "1,1"], "lists a value twice"),
        (["--engine", "sglang"], "unknown engine"),
    ],
)
def test_sweep_bad_input(tmp_path, args, message):
    result = runner.invoke(app, ["sweep", "--output-path", str(tmp_path / "run"), *args])
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert "Traceback" not in result.output
    assert len([l for l in result.output.strip().splitlines() if l.strip()]) <= 2


def test_cuda_refusal_matches_the_machine(tmp_path):
    """`--device cuda` with more real TP ranks than GPUs: refused before any work, with what is visible.
    Without a GPU: no CUDA device; with fewer than 8: TP 8 needs 8."""
    n = torch.cuda.device_count()
    if n >= 8:
        pytest.skip("8 GPUs are visible: every TP size fits, nothing to refuse")
    result = runner.invoke(app, ["sweep", "--output-path", str(tmp_path / "run"), "--device", "cuda", "--tp", "8"])
    message = "no CUDA device is visible" if n == 0 else f"--tp 8 needs 8 GPUs in real TP mode but {n} are visible"
    one_line_error(result, message)


def test_analyze_missing_dir(tmp_path):
    result = runner.invoke(app, ["analyze", str(tmp_path / "none")])
    assert result.exit_code == 2 and "does not exist" in result.output


def test_unknown_model(tmp_path):
    result = runner.invoke(app, ["sweep", "--model", "no-such-model", "--output-path", str(tmp_path / "r")])
    assert result.exit_code == 2 and "no-such-model" in result.output


def test_listings_have_json():
    """Each listing is a JSON list naming what ships: the built-in suites, the three backends, the models."""
    import json

    want = {
        "suites": {"smoke", "aime24", "amc23"},
        "backends": {"bf16", "bio", "bio+tbik"},
        "models": {"smollm2-135m", "qwen3-8b-shaped"},
    }
    for kind, names in want.items():
        result = runner.invoke(app, [kind, "ls", "--json"])
        assert result.exit_code == 0, result.output
        rows = json.loads(result.stdout)
        assert isinstance(rows, list) and names <= {r["name"] for r in rows}, (kind, rows)
        assert all(r.get("description") or r.get("attention") for r in rows), (kind, rows)  # described


def test_doctor_prints_the_fingerprint():
    import json

    result = runner.invoke(app, ["doctor", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    env, checks = data["environment"], data["checks"]
    assert env["torch_threads"] >= 1 and env["cpu_cores"] >= 1 and "torch" in env["versions"]
    assert "cpu_capability" in env["torch_build"] and env["hardware_key"]
    assert "bio+tbik" in checks["backends"] and "smollm2-135m" in checks["models"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["merge"], "merge needs at least one run directory"),
        (["merge", "somewhere"], "merge needs --output-path"),
        (["sweep", "--no-such-flag"], "No such option: --no-such-flag"),
        (["gate"], "Missing argument"),
        (["sweep", "--tp-mode", "sideways"], "Invalid value for '--tp-mode'"),
    ],
)
def test_usage_errors_are_one_line(args, message):
    """Usage errors (click's boxed usage text before) are one line and exit 2, like all bad input."""
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert message in result.output and "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) == 1, result.output


def test_version():
    from detaudit import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"detaudit {__version__}"


def _helps(group=None, path=()):
    """`--help` of every command and group of the CLI."""
    import typer.main

    group = group or typer.main.get_command(app)
    yield path
    for name, cmd in getattr(group, "commands", {}).items():
        yield from _helps(cmd, (*path, name)) if hasattr(cmd, "commands") else [(*path, name)]


def test_help_shows_no_value_placeholder_for_flags():
    """Flags (--json, --greedy, --cuda-graphs/--no-cuda-graphs, --help, ...) take no value: their help
    row shows none (typer printed `<bool>` for each, as if it took one); options with values keep theirs."""
    seen = 0
    for path in _helps():
        result = runner.invoke(app, [*path, "--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (path, result.output)
        assert "<bool>" not in result.output, path
        assert "--help" in result.output
        seen += 1
    assert seen >= 20
    sweep_help = runner.invoke(app, ["sweep", "--help"], env={"COLUMNS": "200"}).output
    assert "<int>" in sweep_help and "<float>" in sweep_help  # value placeholders stay


def test_doctor_says_which_engines_cannot_run(monkeypatch):
    """An engine whose extra is missing is listed with why (a registered engine whose `requires` fails,
    as vLLM's does where vLLM is not installed)."""
    import json

    from detaudit.engines import ENGINES, EngineInfo
    from detaudit.errors import DetauditError

    def missing():
        raise DetauditError("--engine absent needs the absent extra: pip install 'detaudit[absent]'")

    monkeypatch.setitem(ENGINES, "absent", EngineInfo("absent", lambda o: None, "test engine", requires=missing))
    result = runner.invoke(app, ["doctor", "--json"])
    engines = json.loads(result.stdout)["checks"]["engines"]
    assert "builtin," in engines and "absent (unavailable: --engine absent needs the absent extra" in engines
    text = runner.invoke(app, ["doctor"], env={"COLUMNS": "300"}).output
    assert "absent (unavailable" in text
    # the table prints the extra whole (rich read `[absent]` as markup and ate it: `pip install 'detaudit'`)
    assert "pip install 'detaudit[absent]'" in text and "'detaudit'" not in text


def test_console_width_follows_columns_at_each_use(monkeypatch):
    """The CLI's console reads COLUMNS when it prints, not when it was made: made under COLUMNS=80 (a test
    runner's worker), a command invoked with COLUMNS=300 prints 300 wide; without COLUMNS and a terminal,
    160."""
    from detaudit.cli.common import _Console

    monkeypatch.setenv("COLUMNS", "80")
    console = _Console()
    assert console.width == 80
    monkeypatch.setenv("COLUMNS", "300")
    assert console.width == 300
    monkeypatch.delenv("COLUMNS")
    assert console.width == 160
    assert _Console(width=100).width == 100  # (a width asked for stays)


def test_doctor_prints_the_cpu_extra_whole(monkeypatch):
    """As on a machine without numba (the describe() of one, since numba is installed here)."""
    from detaudit.backends.kernels import cpu_calls

    monkeypatch.setattr(cpu_calls, "describe", lambda: "numba not installed: pip install 'detaudit[cpu]'")
    text = runner.invoke(app, ["doctor"], env={"COLUMNS": "300"}).output
    assert "pip install 'detaudit[cpu]'" in text


@pytest.mark.parametrize(
    "args, pointer",
    [
        (["sweep", "--tasks", "gsm8k"], "that is lm-eval's flag; detaudit's is --suites"),
        (["sweep", "--gen_kwargs", "temperature=0"], "detaudit's is --temperature / --top-p / --top-k / --greedy"),
        (["sweep", "--num_fewshot", "5"], "lm-eval's flag; detaudit has no equivalent (detaudit runs zero-shot"),
        (["sweep", "--tensor-parallel-size", "2"], "that is vLLM's flag; detaudit's is --tp"),
        (["sweep", "--tensor-parallel-size=2"], "that is vLLM's flag; detaudit's is --tp"),
        (["align", "--tasks", "smoke"], "detaudit's is --suite "),
        (["bench", "engine", "--batch_size", "4"], "detaudit's is --batch-size"),
        (["gate", "run", "--tasks", "x"], "`detaudit gate` has no equivalent (`detaudit sweep` takes --suites)"),
    ],
)
def test_other_tools_flags_point_to_detaudits(args, pointer):
    """lm-eval's and vLLM's flag names, typed out of habit: one line naming detaudit's flag."""
    result = runner.invoke(app, args, prog_name="detaudit")
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    flag = next(a for a in args if a.startswith("--")).split("=")[0]
    assert f"No such option: {flag}: that is " in lines[0]
    assert pointer in lines[0], lines[0]


@pytest.mark.parametrize("columns", ["80", "120"])
def test_help_shows_every_flag_name_whole(columns):
    """At 80 columns rich's help table cut `--apply-chat-template / --no-apply-chat-template` to
    `--apply-chat-templa…`: where the names do not fit beside the help text, help takes click's plain
    layout (a long name on its own line), grouped by the same panels."""
    import typer.main
    from helpers import build_cli_once

    root = typer.main.get_command(app)
    with build_cli_once(app):
        _every_name_whole(root, columns)


def _every_name_whole(root, columns: str) -> None:
    import re

    for path in _helps():
        cmd = root
        for name in path:
            cmd = cmd.commands[name]
        text = runner.invoke(app, [*path, "--help"], env={"COLUMNS": columns, "TERMINAL_WIDTH": None}).output
        names = [o for p in cmd.params if not getattr(p, "hidden", False) for o in (*p.opts, *p.secondary_opts)]
        for name in (n for n in names if n.startswith("-")):
            assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-]|…)", text), (path, columns, name, text)
        if path == ("sweep",):
            assert ("╭" in text) == (columns != "80")  # rich panels where they fit
            assert "model and suites" in text and "decoding" in text  # the panels' grouping either way
