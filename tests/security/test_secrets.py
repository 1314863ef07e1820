"""No secret from the environment lands in a run directory.

Manifests are committed and shared; they used to record every VLLM_* / NCCL_* / TORCH_* / CUDA_* /
DETAUDIT_* variable verbatim (`VLLM_API_KEY` included). Now one function, `fingerprint.knob_env`,
records an allow-list of knobs that change the computation and redacts any whose name looks like a
secret."""

from __future__ import annotations

import json
import os

import pytest
from helpers import find_secrets, secret_pieces, sweep_args

from detaudit.runs import fingerprint
from detaudit.runs.fingerprint import REDACTED, knob_env

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
        ["sweep", *sweep_args(limit=1, max_new_tokens=2, backends="bio", tp=1, batch_sizes=1, output_path=out)],
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


# ------------------------------------------------------------------ a server's API key (--api-key-env)

KEY = "sk-Hw3nQ8vTz5LpX2cR7mYb4KdF9gJs6aE1"


@pytest.mark.parametrize(
    "value, why",
    [
        (KEY + "\n", "whitespace at its start or end"),
        (KEY + "\r\n", "whitespace at its start or end"),
        (" " + KEY, "whitespace at its start or end"),
        (KEY[:10] + " " + KEY[10:], "a space or control character"),
        (KEY[:10] + "\x1b" + KEY[10:], "a space or control character"),
        (KEY[:10] + "é" + KEY[10:], "a non-ASCII character"),
        (KEY[:10] + "\u200b" + KEY[10:], "a non-ASCII character"),
        ("x" * 5000, "longer than 4096 characters"),
    ],
    ids=["trailing-newline", "crlf", "leading-space", "space", "escape", "non-ascii", "zero-width", "5000-chars"],
)
def test_a_key_no_header_can_carry_is_refused_without_showing_it(monkeypatch, tmp_path, value, why):
    """Before: a trailing newline printed the key whole (`Illegal header value b'Bearer sk-...\\n'`), a
    non-ASCII key gave a traceback. Now: one line naming the variable, before any work or request."""
    from typer.testing import CliRunner

    from detaudit.cli import app

    monkeypatch.setenv("MY_SERVER_KEY", value)
    args = ["sweep", "--engine", "openai", "--base-url", "http://127.0.0.1:9/v1", "--api-key-env", "MY_SERVER_KEY"]
    res = CliRunner().invoke(app, [*args, "-o", str(tmp_path / "run")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    lines = [x for x in res.output.splitlines() if x.strip()]
    assert len(lines) == 1 and "--api-key-env MY_SERVER_KEY" in lines[0] and why in lines[0], res.output
    assert secret_pieces(res.output, value.strip()[:40]) == [], res.output
    assert not (tmp_path / "run").exists()


def test_a_valid_key_is_read_as_given(monkeypatch):
    from detaudit.server.urls import read_api_key

    monkeypatch.setenv("MY_SERVER_KEY", KEY)
    assert read_api_key("MY_SERVER_KEY") == KEY and read_api_key(None) is None


@pytest.mark.parametrize(
    "echo",
    [
        f"Bearer {KEY}",  # whole
        f"token {KEY[:26]}...",  # a prefix of 26 characters
        f"tail {KEY[-9:]}",  # a suffix of 9
        f"mid {KEY[5:14]} end",  # 9 characters from the middle
        "\x00".join(KEY[i : i + 5] for i in range(0, len(KEY), 5)),  # split by a control character
        " ".join(KEY),  # a space between every two characters
        "\u200b".join(KEY),  # zero-width spaces
        "\u202e" + KEY + "\u202c",  # bidi overrides around it
        f"{KEY}{KEY}",  # twice, adjoining
        "x" * 70_000 + KEY,  # past the scanned length
        "\x01" * (2**16 - 7) + KEY,  # straddling it
    ],
)
def test_redact_removes_every_piece_of_8_characters(echo):
    from detaudit.server.urls import redact

    for limit in (40, 300, 100_000):
        shown = redact(echo, KEY, limit)
        assert secret_pieces(shown, KEY) == [], (echo[:60], shown[:200])
        assert len(shown) <= limit


def test_redact_keeps_what_is_not_the_key():
    from detaudit.server.urls import redact, redact_secret

    assert redact(f"vllm 0.9 ({KEY[:7]})", KEY) == f"vllm 0.9 ({KEY[:7]})"  # 7 characters: not a piece
    assert redact(f"key={KEY[:12]}; next", KEY) == "key=***; next"
    assert redact_secret("no key here", KEY) == "no key here" and redact_secret("", KEY) == ""
    assert redact("line one\nline two\u200b!", None) == "line one line two!"
