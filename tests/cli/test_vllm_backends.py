"""The backend `vllm-bi` (vLLM's own batch-invariant mode) by name: accepted by the vLLM engines only, on
CUDA only, refused by name elsewhere before any work; listed by `backends ls`; and `doctor`'s one line
on vLLM and the torch it pins (no vLLM is started here)."""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

import pytest
from helpers import cli_json, one_line_error
from typer.testing import CliRunner

from detaudit.cli import app

runner = CliRunner()


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["sweep", "--engine", "builtin", "--backends", "bf16,vllm-bi"],
            "runs under --engine vllm or vllm-server only",
        ),
        (["sweep", "--engine", "openai", "--backends", "vllm-bi"], "not --engine openai"),
        (
            ["sweep", "--engine", "vllm", "--backends", "vllm-bi", "--device", "cpu"],
            "--backends vllm-bi needs --device cuda",
        ),
        (["bench", "vllm", "--backends", "vllm-bi", "--device", "cpu"], "--backends vllm-bi needs --device cuda"),
        (["sweep", "--engine", "vllm", "--backends", "vllm-bi,vllm-bi"], "lists a value twice"),
        (["bench", "vllm", "--workloads", "both"], "--workloads 'both': expected prefill or decode"),
    ],
)
def test_vllm_bi_is_refused_by_name_outside_the_vllm_engines(tmp_path, args, message):
    res = runner.invoke(app, [*args, "--output-path", str(tmp_path / "r")] if args[0] == "sweep" else args)
    one_line_error(res, message)
    assert not (tmp_path / "r").exists()


def test_backends_ls_lists_vllm_bi_with_where_it_runs():
    rows = {r["name"]: r for r in cli_json(runner.invoke(app, ["backends", "ls", "--json"]))}
    assert {"bf16", "bio", "bio+tbik", "vllm-bi"} <= set(rows)
    assert (
        "VLLM_BATCH_INVARIANT=1" in rows["vllm-bi"]["matmul"]
        and "--engine vllm / vllm-server" in rows["vllm-bi"]["matmul"]
    )


def test_doctor_says_in_one_line_whether_vllm_matches_torch(monkeypatch):
    from detaudit.vllm import torch_match

    line = cli_json(runner.invoke(app, ["doctor", "--json"]))["checks"]["vllm"]
    assert line == torch_match() and "\n" not in line
    if "not installed" in line:
        pytest.skip("no vLLM here: the line says how to install it")
    assert line.endswith("matches"), line  # this environment's vLLM and torch were installed together
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: "2.9.1" if d == "torch" else real(d))
    line = torch_match()
    assert (
        line.startswith("MISMATCH: ")
        and "torch 2.9.1 is installed" in line
        and "vllm==0.25.1 for torch==2.11.0" in line
    )


@pytest.mark.parametrize("backend,want", [("bf16", "0"), ("vllm-bi", "1"), ("bio", "0"), ("bio+tbik", "0")])
def test_an_inherited_batch_invariant_switch_never_reaches_vllm(monkeypatch, backend, want):
    from detaudit.vllm.host import BACKEND_ENV, engine_env

    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0" if want == "1" else "1")
    env = engine_env(backend, 2, "cuda", "/tmp/m")
    assert env["VLLM_BATCH_INVARIANT"] == want and env[BACKEND_ENV] == backend


def test_without_flashinfer_vllms_gpu_sampler_is_told_not_to_use_it(monkeypatch):
    """vLLM 0.25.1 on an H200 without FlashInfer failed every plugin cell ("No module named
    'flashinfer'") until VLLM_USE_FLASHINFER_SAMPLER=0; with FlashInfer, or on CPU, nothing is set, and a
    value the user set is kept."""
    import importlib.util

    from detaudit.vllm import host

    real = importlib.util.find_spec
    monkeypatch.delenv(host.FLASHINFER_SAMPLER_ENV, raising=False)
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "flashinfer" else real(n, *a))
    assert host.engine_env("bio+tbik", 1, "cuda", "/tmp/m")[host.FLASHINFER_SAMPLER_ENV] == "0"
    assert host.FLASHINFER_SAMPLER_ENV not in host.engine_env("bio+tbik", 1, "cpu", "/tmp/m")
    monkeypatch.setenv(host.FLASHINFER_SAMPLER_ENV, "1")
    assert host.engine_env("bf16", 1, "cuda", "/tmp/m")[host.FLASHINFER_SAMPLER_ENV] == "1"
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: object() if n == "flashinfer" else real(n, *a))
    assert host.FLASHINFER_SAMPLER_ENV not in host.engine_env("bio+tbik", 1, "cuda", "/tmp/m")


def test_the_plugins_backends_run_vllms_v1_model_runner_on_gpus(monkeypatch):
    """vLLM 0.25.1's model runner V2 scores and samples without the sampler the plugin patches: bio /
    bio+tbik on CUDA always get the V1 runner (an inherited V2 switch included); bf16 / vllm-bi keep
    whatever vLLM or the user chose; on CPU vLLM has no V2 runner and nothing is set."""
    from detaudit.vllm import host

    monkeypatch.setenv(host.V2_RUNNER_ENV, "1")
    for b in ("bio", "bio+tbik"):
        assert host.engine_env(b, 1, "cuda", "/tmp/m")[host.V2_RUNNER_ENV] == "0"
        assert host.V2_RUNNER_ENV not in host.engine_env(b, 1, "cpu", "/tmp/m")
    for b in ("bf16", "vllm-bi"):
        assert host.V2_RUNNER_ENV not in host.engine_env(b, 1, "cuda", "/tmp/m")


def test_execution_mode_per_backend_and_device():
    from detaudit.server.launch import server_command
    from detaudit.vllm.host import engine_mode

    for b in ("bio", "bio+tbik"):
        graphed, eager = engine_mode(b, "cuda", True), engine_mode(b, "cuda", False)
        assert graphed["attention_backend"] == eager["attention_backend"] == "CUSTOM"
        # decode steps as whole CUDA graphs, never torch.compile (inductor rounds elsewhere)
        assert graphed["enforce_eager"] is False
        assert graphed["compilation_config"] == {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
        assert eager["enforce_eager"] is True and "compilation_config" not in eager
        assert engine_mode(b, "cpu", True) == {"enforce_eager": True, "enforce_eager_reason": "CPU"}
        cmd = server_command(Path("/m"), 1, 1, "bfloat16", 4, "cuda", 20, graphed)
        assert "--enforce-eager" not in cmd
        assert json.loads(cmd[cmd.index("--compilation-config") + 1]) == graphed["compilation_config"]
        assert "--compilation-config" not in server_command(Path("/m"), 1, 1, "bfloat16", 4, "cuda", 20, eager)
    for b in ("bf16", "vllm-bi"):
        assert engine_mode(b, "cuda", True)["enforce_eager"] is False
        assert "compilation_config" not in engine_mode(b, "cuda", True)  # vLLM's default: compiled
        assert engine_mode(b, "cuda", False)["enforce_eager"] is True
        assert engine_mode(b, "cpu", True)["enforce_eager"] is True
        assert "attention_backend" not in engine_mode(b, "cuda", True)


def test_a_plugin_that_did_not_load_is_named():
    from detaudit.vllm.host import plugin_missing

    assert "entry point (vllm.general_plugins) is missing" in plugin_missing("bio", [], ran=False)
    assert "entry point" in plugin_missing("bf16", [], ran=True)
    idle = [{"pid": 1, "ops": [], "seen": {}}]
    assert plugin_missing("bio+tbik", idle, ran=True)  # loaded but patched nothing: not the plugin's numbers
    assert plugin_missing("bio+tbik", idle, ran=False) is None
    assert plugin_missing("vllm-bi", idle, ran=True) is None  # records only
    assert plugin_missing("bio", [{"ops": ["linear"]}], ran=True) is None
