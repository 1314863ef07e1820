"""`--model` as a Hugging Face hub id: resolved from a fake hub cache laid out as huggingface_hub lays it
out (`models--org--name/refs/main`, `snapshots/<commit>/...` linking to `blobs/<etag>`). No test reaches
the network: the offline ones set HF_HUB_OFFLINE=1, the others point the hub at a closed local port."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest

from detaudit import models
from detaudit.errors import DetauditError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(hub: Path, repo_id: str, checkpoint: Path, commit: str = COMMIT) -> Path:
    """Lay `checkpoint`'s files out as a hub cache entry; returns the snapshot directory. LFS files
    (safetensors) are blobs named by their sha256, the others by a git-sha1-like etag, as on the hub."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snap = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(checkpoint.iterdir()):
        data = f.read_bytes()
        etag = hashlib.sha256(data).hexdigest() if f.suffix == ".safetensors" else hashlib.sha1(data).hexdigest()
        shutil.copy(f, repo / "blobs" / etag)
        os.symlink(f"../../blobs/{etag}", snap / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "hf"
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


@pytest.fixture
def dead_hub(monkeypatch):
    """Online mode, but the hub is a local port this test holds bound and never listens on: connection
    refused at once (never the real network, never a server another program runs on a fixed port)."""
    import socket

    from huggingface_hub import constants

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{held.getsockname()[1]}")
        yield


def test_cached_hub_id_resolves_offline(tiny_qwen3, hf_home):
    snap = fake_hub_cache(hf_home / "hub", "org/tiny-qwen3", tiny_qwen3)
    ref = models.resolve_model("org/tiny-qwen3")
    assert ref.name == "org/tiny-qwen3" and ref.path == snap and ref.architecture == "Qwen3ForCausalLM"
    # the blob names stand in for hashing the weights: the same checksum as the same files in a directory
    assert ref.checksum == models.resolve_model(str(tiny_qwen3)).checksum
    # and the built-in engine runs it
    from helpers import local_engine

    assert local_engine(ref, "bf16", 1, dtype="float32").model.cfg.model_type == "qwen3"


def test_hf_hub_cache_and_revision(tiny_qwen3, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    snap = fake_hub_cache(tmp_path / "elsewhere", "org/tiny", tiny_qwen3)
    assert models.resolve_model("org/tiny").path == snap
    assert models.resolve_model(f"org/tiny@{COMMIT}").path == snap
    with pytest.raises(DetauditError, match="org/tiny@v9"):
        models.resolve_model("org/tiny@v9")


def test_cache_comes_first_no_network_needed(tiny_qwen3, hf_home, dead_hub):
    snap = fake_hub_cache(hf_home / "hub", "org/tiny", tiny_qwen3)
    assert models.resolve_model("org/tiny").path == snap


def test_missing_id_offline_is_one_clear_line(hf_home):
    with pytest.raises(DetauditError) as e:
        models.resolve_model("org/not-cached")
    msg = str(e.value)
    assert "'org/not-cached'" in msg and "HF_HUB_OFFLINE=1" in msg and str(hf_home / "hub") in msg
    assert "\n" not in msg


def test_missing_id_with_unreachable_hub(hf_home, dead_hub):
    with pytest.raises(DetauditError, match=r"'org/not-cached'.*the hub cannot be reached") as e:
        models.resolve_model("org/not-cached")
    assert "\n" not in str(e.value)


def test_incomplete_cached_snapshot_is_not_used(tiny_qwen3, hf_home, tmp_path):
    """A snapshot holding only config.json (another tool fetched just that) is not a checkpoint."""
    partial = tmp_path / "partial"
    partial.mkdir()
    shutil.copy(tiny_qwen3 / "config.json", partial / "config.json")
    fake_hub_cache(hf_home / "hub", "org/partial", partial)
    with pytest.raises(DetauditError, match="'org/partial'.*not in the Hugging Face cache"):
        models.resolve_model("org/partial")
    # a sharded checkpoint whose index names a shard that is missing is incomplete too
    shutil.copy(tiny_qwen3 / "model.safetensors", partial / "model-00001-of-00002.safetensors")
    (partial / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    fake_hub_cache(hf_home / "hub", "org/sharded", partial)
    with pytest.raises(DetauditError, match="'org/sharded'"):
        models.resolve_model("org/sharded")


@pytest.mark.parametrize("spec", ["a/b/c", "./no/such/dir", "-x"])
def test_not_a_hub_id(spec, hf_home):
    with pytest.raises(DetauditError, match="not a Hugging Face hub id"):
        models.resolve_model(spec)


def test_resolution_does_not_judge_the_architecture(tiny_qwen3, tmp_path, hf_home):
    """Which architectures run is the engine's call (`--engine vllm` runs what vLLM runs): a checkpoint of an
    architecture the built-in engine lacks still resolves, and `ModelConfig.of` refuses it by name."""
    from detaudit.builtin.arch import ModelConfig

    gpt = tmp_path / "gpt"
    gpt.mkdir()
    shutil.copy(tiny_qwen3 / "model.safetensors", gpt / "model.safetensors")
    (gpt / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    fake_hub_cache(hf_home / "hub", "org/gpt", gpt)
    assert models.resolve_model("org/gpt").architecture == "GPT2LMHeadModel"
    with pytest.raises(DetauditError, match="model_type 'gpt2' is not supported by the built-in engine"):
        ModelConfig.of(models.resolve_model("org/gpt"))


def test_cli_missing_hub_id_exits_2_with_one_line(hf_home, tmp_path):
    from typer.testing import CliRunner

    from detaudit.cli import app

    result = CliRunner().invoke(
        app,
        [
            "sweep",
            "--model",
            "org/not-cached",
            "--suites",
            "smoke",
            "--limit",
            "1",
            "--output-path",
            str(tmp_path / "run"),
        ],
    )
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "org/not-cached" in lines[0], result.output
