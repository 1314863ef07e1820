"""No secret from the environment lands in a run directory.

Manifests are committed and shared; they used to record every VLLM_* / NCCL_* / TORCH_* / CUDA_* /
DETAUDIT_* variable verbatim (`VLLM_API_KEY` included). Now one function, `fingerprint.knob_env`,
records an allow-list of knobs that change the computation and redacts any whose name looks like a
secret."""

from __future__ import annotations

import json
import os

import pytest
from helpers import find_secrets

from detaudit import fingerprint
from detaudit.fingerprint import REDACTED, knob_env

SECRETS = {
    "VLLM_API_KEY": "sk-test-SECRET123",
    "HF_TOKEN": "hf_SECRET456",
    "DETAUDIT_SECRET": "detaudit-SECRET789",
    "NCCL_PASSWORD": "nccl-SECRET000",
    "VLLM_CPU_AUTH_TOKEN": "vllmcpu-SECRET111",  # allow-listed family (VLLM_CPU_*), secret-looking name
    "TORCH_HUB_TOKEN": "torch-SECRET222",
    "CUDA_PRIVATE_KEY_PATH": "/home/u/cuda-SECRET333.pem",
}


# ------------------------------------------------------------------ the function
def test_knob_env_allow_list_and_redaction():
    environ = {
        "OMP_NUM_THREADS": "2",
        "MKL_NUM_THREADS": "1",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "NCCL_ALGO": "Ring",
        "NCCL_PROTO": "Simple",
        "VLLM_BATCH_INVARIANT": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "DETAUDIT_ALLREDUCE": "scatter",
        "CUDA_VISIBLE_DEVICES": "0,1",
        # not knobs: left out entirely (value and name)
        "HOME": "/home/u",
        "PATH": "/usr/bin",
        "DETAUDIT_HOME": "/home/u/.detaudit",
        "TORCH_HOME": "/x",
        "NCCL_DEBUG": "INFO",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "CUDA_CACHE_PATH": "/tmp/c",
        **SECRETS,
    }
    got = knob_env(environ)
    assert got == {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "CUDA_VISIBLE_DEVICES": "0,1",
        "DETAUDIT_ALLREDUCE": "scatter",
        "MKL_NUM_THREADS": "1",
        "NCCL_ALGO": "Ring",
        "NCCL_PROTO": "Simple",
        "OMP_NUM_THREADS": "2",
        "VLLM_BATCH_INVARIANT": "1",
        "VLLM_CPU_AUTH_TOKEN": REDACTED,
        "VLLM_CPU_OMP_THREADS_BIND": "0|1",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    }
    assert list(got) == sorted(got)
    blob = json.dumps(got)
    for value in SECRETS.values():
        assert value not in blob


@pytest.mark.parametrize(
    "name",
    [
        "VLLM_API_KEY",
        "HF_TOKEN",
        "MY_SECRET",
        "DB_PASSWORD",
        "FTP_PASSWD",
        "GCP_CREDENTIALS",
        "NCCL_AUTH",
        "SSH_PASSPHRASE",
        "PRIVATE_KEY",
        "x_api_key",
        "AUTHORIZATION",
        "SESSION_COOKIE",
    ],
)
def test_secret_names(name):
    assert fingerprint.is_secret_name(name)


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "NCCL_ALGO", "VLLM_CPU_KVCACHE_SPACE", "CUDA_VISIBLE_DEVICES"])
def test_knob_names_are_not_secret(name):
    assert not fingerprint.is_secret_name(name)


def test_allow_listed_name_that_looks_secret_is_redacted(monkeypatch):
    """Even a name on the allow-list is redacted when it looks like a secret."""
    monkeypatch.setattr(fingerprint, "KNOB_ENV", fingerprint.KNOB_ENV | {"NCCL_IB_AUTH_KEY"})
    assert knob_env({"NCCL_IB_AUTH_KEY": "hunter2", "NCCL_ALGO": "Tree"}) == {
        "NCCL_IB_AUTH_KEY": REDACTED,
        "NCCL_ALGO": "Tree",
    }


def test_collect_and_vllm_host_use_knob_env(monkeypatch):
    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    env = fingerprint.collect()
    assert env["env"] == knob_env(os.environ)
    assert env["env"]["NCCL_ALGO"] == "Tree" and env["env"]["VLLM_CPU_AUTH_TOKEN"] == REDACTED
    from detaudit.vllm.host import recorded_env

    assert recorded_env() == knob_env(os.environ)
    blob = json.dumps(env)
    for value in SECRETS.values():
        assert value not in blob


# ------------------------------------------------------------------ scanning a run directory
def test_scanner_finds_a_secret_in_a_compressed_parquet_file(tmp_path):
    """The scan below can fail: a secret inside a compressed Parquet column is found."""
    import random

    import pyarrow as pa
    import pyarrow.parquet as pq

    rnd = random.Random(0)
    texts = [
        "".join(rnd.choices("abcdefgh ", k=400)) + "sk-test-SECRET123" + "".join(rnd.choices("abcdefgh ", k=400))
        for _ in range(20)
    ]  # Huffman-coded by deflate: the secret's bytes are not in the file
    pq.write_table(
        pa.table({"text": texts}),
        tmp_path / "c.parquet",
        compression="gzip",
        use_dictionary=False,
        write_statistics=False,
    )
    assert b"sk-test-SECRET123" not in (tmp_path / "c.parquet").read_bytes()  # compressed away
    assert find_secrets(tmp_path, ["sk-test-SECRET123"]) == [("c.parquet", "sk-test-SECRET123")]


@pytest.mark.slow
def test_sweep_run_directory_holds_no_secret(tmp_path, monkeypatch, smollm):
    """A real (tiny) sweep with secrets in the environment: no secret value in any byte of any file of
    the run directory (manifest, cells, reports), while the allow-listed knobs are recorded."""
    from typer.testing import CliRunner

    from detaudit.cli import app

    for k, v in SECRETS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID")  # an allow-listed knob: must be recorded
    out = tmp_path / "run"
    res = CliRunner().invoke(
        app,
        [
            "sweep",
            "--suites",
            "smoke",
            "--limit",
            "1",
            "--max-new-tokens",
            "2",
            "--backends",
            "bio",
            "--tp",
            "1",
            "--batch-sizes",
            "1",
            "--output-path",
            str(out),
        ],
    )
    assert res.exit_code == 0, (res.output, res.exception)
    manifest = json.loads((out / "manifest.json").read_text())
    env = manifest["environment"]["env"]
    assert env.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID"
    assert env.get("VLLM_CPU_AUTH_TOKEN") == REDACTED
    for name in ("VLLM_API_KEY", "HF_TOKEN", "DETAUDIT_SECRET", "NCCL_PASSWORD", "TORCH_HUB_TOKEN"):
        assert name not in env
    assert any(p.suffix == ".parquet" for p in out.rglob("*")), sorted(out.rglob("*"))
    assert find_secrets(out, SECRETS.values()) == []
