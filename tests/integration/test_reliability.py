"""Reliability with real processes (no mocks of the failures): SIGKILL and resume, the run-directory
lock, TP worker crash / hang, sharded sweeps and merge. The sweeps run a tiny random Llama with the
embedded tokenizer (conftest's `tiny_sweep_model`): what is checked is the run directory and the
processes, and the real model's compute cost minutes of CI on a CPU without AVX-512."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
from helpers import cli_json, stopped_sweep, sweep_args
from typer.testing import CliRunner

from detaudit.cli import app

pytestmark = pytest.mark.slow  # the real embedded model and/or worker processes

runner = CliRunner()
GRID_OPTIONS = dict(max_new_tokens=32, backends="bf16,bio", tp=1, batch_sizes="1,2,4")
GRID = sweep_args(**GRID_OPTIONS)


def _workers() -> list[psutil.Process]:
    """TP worker processes started by this test process (never other sweeps on the machine)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            if any("detaudit.builtin.rank" in part for part in p.cmdline()):
                out.append(p)
        except psutil.Error:
            pass
    return out


def _sweep_cmd(model: Path, out: Path, *extra: str, grid: list[str] = GRID) -> list[str]:
    return [
        sys.executable,
        "-c",
        "from detaudit.cli import main; main()",
        "sweep",
        "--model",
        str(model),
        *grid,
        "--output-path",
        str(out),
        "--no-analyze",
        *extra,
    ]


@pytest.fixture(scope="module")
def clean_run(tiny_sweep_model, tmp_path_factory) -> Path:
    """The GRID swept once, uninterrupted: what a killed-and-resumed or sharded run must reproduce."""
    out = tmp_path_factory.mktemp("clean") / "run"
    subprocess.run(_sweep_cmd(tiny_sweep_model, out), check=True, capture_output=True)
    return out


def _same_records(run: Path, reference: Path) -> None:
    """Every cell of `run` holds the records of the same cell of `reference`, bit for bit in every recorded
    number (`detaudit diff`), and the two runs have the same cells."""
    res = runner.invoke(app, ["diff", str(reference), str(run), "--json"])
    diff = cli_json(res)
    assert diff["equal"] and diff["cells"], diff
    assert {c["status"] for c in diff["cells"]} == {"equal"}, [c for c in diff["cells"] if c["status"] != "equal"]


def _cell_files(out: Path) -> dict[str, float]:
    return {p.name: p.stat().st_mtime_ns for p in (out / "cells").glob("*.parquet")} if (out / "cells").exists() else {}


def _stopping_sweep(model: Path, out: Path, point: str):
    return stopped_sweep(_sweep_cmd(model, out)[3:], out.parent / f"{out.name}-{point}.log", point)


def test_kill_and_resume(clean_run, tiny_sweep_model, tmp_path):
    """SIGKILL three times, each once one more cell is complete: with the manifest updated, with the cell
    file written but the manifest not yet updated, and with the next cell's generation begun; then resume:
    no completed cell is recomputed and the result is the uninterrupted run's."""
    out = tmp_path / "killed"
    recomputed = 0
    for point in ("cell-done", "file-written", "computing"):
        before = _cell_files(out)
        proc = _stopping_sweep(tiny_sweep_model, out, point)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        after = _cell_files(out)
        assert len(after) == len(before) + 1 and set(before) <= set(after), (point, before, after)
        recomputed += sum(1 for name, mtime in before.items() if after.get(name) != mtime)
        manifest = json.loads((out / "manifest.json").read_text())
        (new,) = set(after) - set(before)
        assert (manifest["cells"][new.removesuffix(".parquet")]["state"] == "done") == (point != "file-written")
    before = _cell_files(out)
    assert len(before) == 3, before
    done = subprocess.run(_sweep_cmd(tiny_sweep_model, out), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    after = _cell_files(out)
    recomputed += sum(1 for name, mtime in before.items() if after.get(name) != mtime)
    assert recomputed == 0  # no completed cell is ever recomputed
    assert len(after) == 6 and not list(out.rglob("*.tmp*"))
    _same_records(out, clean_run)


def test_second_sweep_into_same_dir_is_refused_and_lock_does_not_outlive_a_kill(tiny_sweep_model, tmp_path):
    out = tmp_path / "run"
    first = _stopping_sweep(tiny_sweep_model, out, "cell-done")  # it holds the lock, stopped mid-grid
    try:
        second = subprocess.run(_sweep_cmd(tiny_sweep_model, out), capture_output=True, text=True)
        assert first.poll() is None, "the first sweep ended before the second was refused"
        assert second.returncode == 2, second.stderr
        assert "another sweep is writing to" in second.stderr, second.stderr
        assert "Traceback" not in second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # the lock died with its holder: a new sweep resumes
    third = subprocess.run(_sweep_cmd(tiny_sweep_model, out), capture_output=True, text=True)
    assert third.returncode == 0, third.stderr


@pytest.mark.parametrize("fault", ["crash:1", "hang:0"])
def test_tp_worker_failure_fails_the_cell_and_the_sweep_goes_on(tiny_sweep_model, tmp_path, monkeypatch, fault):
    out = tmp_path / "run"
    monkeypatch.setenv("DETAUDIT_FAULT_INJECT", fault)
    res = runner.invoke(
        app,
        [
            "sweep",
            "--model",
            str(tiny_sweep_model),
            *sweep_args(backends="bio", tp="1,2", batch_sizes=2, hang_timeout=10, output_path=out),
        ],
    )
    assert res.exit_code == 1, res.output
    assert ("died" in res.output) if fault.startswith("crash") else ("hung" in res.output)
    manifest = json.loads((out / "manifest.json").read_text())
    states = {c: m.get("state") for c, m in manifest["cells"].items()}
    assert states["smoke__bio__tp1__bs2"] == "done" and states["smoke__bio__tp2__bs2"] == "failed"
    assert "failed" in (out / "report.md").read_text().lower()
    assert not _workers()  # no orphans


def test_shards_merge_to_the_whole(clean_run, tiny_sweep_model, tmp_path):
    parts = []
    for i in (1, 2):
        part = tmp_path / f"part{i}"
        subprocess.run(_sweep_cmd(tiny_sweep_model, part, "--shard", f"{i}/2"), check=True, capture_output=True)
        parts.append(str(part))
    merged = tmp_path / "merged"
    res = runner.invoke(app, ["merge", *parts, "--output-path", str(merged)])
    assert res.exit_code == 0, res.output
    _same_records(merged, clean_run)
    assert (merged / "prompts.parquet").read_bytes() == (clean_run / "prompts.parquet").read_bytes()
    other = tmp_path / "other"  # another seed (one cell is enough: merge compares the settings first)
    one_cell = sweep_args(**{**GRID_OPTIONS, "backends": "bio", "batch_sizes": 1})
    subprocess.run(_sweep_cmd(tiny_sweep_model, other, "--seed", "1", grid=one_cell), check=True, capture_output=True)
    bad = runner.invoke(app, ["merge", parts[0], str(other), "--output-path", str(tmp_path / "m2")])
    assert bad.exit_code == 2 and "decoding" in bad.output.lower()


def test_resume_refuses_cells_computed_with_other_numerics(clean_run, tiny_sweep_model, tmp_path):
    """A run directory whose cells an older detaudit computed with another RMSNorm (the manifest records
    each backend's description): resuming it with more cells is refused in one line before any engine
    runs, and nothing in it changes; merging it with a run of this detaudit is refused the same way."""
    import shutil

    from helpers import one_line_error

    old = tmp_path / "old"
    shutil.copytree(clean_run, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest["backends"]["bio@tp1"]["backend"]["rms_norm"] = "an older definition"
    (old / "manifest.json").write_text(json.dumps(manifest))
    before = _cell_files(old)
    more = [*sweep_args(**{**GRID_OPTIONS, "batch_sizes": "1,2,4,8"}), "--model", str(tiny_sweep_model)]
    res = runner.invoke(app, ["sweep", *more, "--output-path", str(old), "--no-analyze"])
    one_line_error(res, "computed with other numerics")
    assert "bio@tp1 (rms_norm)" in res.output and _cell_files(old) == before
    res = runner.invoke(app, ["merge", str(clean_run), str(old), "--output-path", str(tmp_path / "merged")])
    one_line_error(res, "other numerics (differing: bio@tp1 (rms_norm))")
