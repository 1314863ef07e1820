"""The bad-input matrix at the CLI, with the real embedded model where the case needs one: each case
prints one clear line, exits 2, shows no traceback, and loses nothing already written."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from detaudit.cli import app

runner = CliRunner()


def small(batch_sizes: str = "1") -> list[str]:
    return [
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
        batch_sizes,
        "--no-analyze",
    ]


SMALL = small()


def _bad(result, message):
    assert result.exit_code == 2, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert len([line for line in result.output.splitlines() if line.strip()]) <= 2


@pytest.fixture(scope="module")
def done_run(smollm, tmp_path_factory):
    out = tmp_path_factory.mktemp("done") / "run"
    res = runner.invoke(app, ["sweep", *SMALL, "--output-path", str(out)])
    assert res.exit_code == 0, res.output
    return out


def _copy(run, tmp_path):
    dst = tmp_path / "copy"
    shutil.copytree(run, dst)
    return dst


def test_malformed_suite_yaml_and_jsonl(tmp_path, smollm):
    y = tmp_path / "bad.yaml"
    y.write_text("task: bad\ndocs: [unclosed\n")
    _bad(runner.invoke(app, ["sweep", "--suites", str(y), "--output-path", str(tmp_path / "r")]), "bad.yaml")
    d = tmp_path / "mirror"
    d.mkdir()
    (d / "aime24.jsonl").write_text('{"id": 1, "problem": "x", "answer": "1"}\n{oops\n')
    _bad(
        runner.invoke(app, ["sweep", "--suites", "aime24", "--data-dir", str(d), "--output-path", str(tmp_path / "r")]),
        "line 2",
    )


def test_missing_data_dir(tmp_path):
    _bad(
        runner.invoke(
            app,
            ["sweep", "--suites", "aime24", "--data-dir", str(tmp_path / "nope"), "--output-path", str(tmp_path / "r")],
        ),
        "nope",
    )


def test_conflicting_flags(tmp_path):
    _bad(
        runner.invoke(app, ["sweep", "--greedy", "--temperature", "0.9", "--output-path", str(tmp_path / "r")]),
        "conflicting flags",
    )
    _bad(runner.invoke(app, ["sweep", "--shard", "3/2", "--output-path", str(tmp_path / "r")]), "--shard")


def test_model_directory_missing_files(tmp_path, smollm):
    broken = tmp_path / "model"
    shutil.copytree(smollm.path, broken)
    (broken / "model.safetensors").unlink()
    _bad(
        runner.invoke(app, ["sweep", *SMALL, "--model", str(broken), "--output-path", str(tmp_path / "r")]),
        "no *.safetensors",
    )


def test_prepared_model_checksum_mismatch(tmp_path, smollm, monkeypatch):
    home = tmp_path / "home"
    shutil.copytree(smollm.path, home / "models" / "smollm2-135m")
    with open(home / "models" / "smollm2-135m" / "tokenizer_config.json", "a") as f:
        f.write("\n")
    monkeypatch.setenv("DETAUDIT_HOME", str(home))
    _bad(
        runner.invoke(app, ["sweep", *SMALL, "--output-path", str(tmp_path / "r")]),
        "does not match its recorded sha256",
    )


def test_output_dir_holding_another_sweep(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    before = {p.name: p.read_bytes() for p in (run / "cells").iterdir()}
    _bad(runner.invoke(app, ["sweep", *SMALL, "--seed", "7", "--output-path", str(run)]), "different sweep")
    assert {p.name: p.read_bytes() for p in (run / "cells").iterdir()} == before


def test_truncated_cell_file(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    cell = next((run / "cells").glob("*.parquet"))
    cell.write_bytes(cell.read_bytes()[:100])
    _bad(runner.invoke(app, ["analyze", str(run)]), "unreadable or truncated")


def test_corrupt_manifest(done_run, tmp_path):
    run = _copy(done_run, tmp_path)
    (run / "manifest.json").write_text("{not json")
    _bad(runner.invoke(app, ["analyze", str(run)]), "corrupt")
    _bad(runner.invoke(app, ["gate", str(run)]), "corrupt")


def test_unwritable_output_path(tmp_path, smollm):
    if os.geteuid() == 0:
        target = "/proc/detaudit-run"  # root ignores file modes; /proc refuses new entries even to root
    else:
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        target = str(ro / "run")
    _bad(runner.invoke(app, ["sweep", *SMALL, "--output-path", target]), "not writable")


def test_disk_full_while_writing_a_cell_loses_nothing(done_run, tmp_path):
    """A real write failure (RLIMIT_FSIZE: the kernel refuses to grow a file past 1 KiB) while the sweep
    adds a cell: one line, exit 2, and the completed cell is intact and still analyzable."""
    run = _copy(done_run, tmp_path)
    before = {p.name: p.read_bytes() for p in (run / "cells").iterdir()}

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "from detaudit.cli import main; main()",
            "sweep",
            *small("1,2"),
            "--output-path",
            str(run),
        ],
        capture_output=True,
        text=True,
        preexec_fn=limit,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cannot write" in proc.stderr and "Traceback" not in proc.stderr
    assert {p.name: p.read_bytes() for p in (run / "cells").iterdir() if p.suffix == ".parquet"} == {
        k: v for k, v in before.items() if k.endswith(".parquet")
    }
    assert runner.invoke(app, ["analyze", str(run)]).exit_code == 0
    json.loads((run / "manifest.json").read_text())  # never left half-written
