"""`detaudit sweep --executor ray` on a private Ray runtime (started by the executor on 127.0.0.1).

One local sweep and one Ray sweep of the same tiny grid (TP 1/2 x batch 1/2 x bf16 / bio+tbik, 2 smoke
prompts, 3 new tokens) on a tiny random Llama with the embedded tokenizer (the executor is under test,
not the model: conftest's `tiny_sweep_model`); in the Ray sweep the actor of a TP 2 group exits
(os._exit) after computing one cell and before returning it (DETAUDIT_RAY_FAULT), so that cell is
retried on a new actor and placement group. The Ray run's records equal the local run's bit for bit,
the analysis is the same, and no Ray process the test started outlives the sweep."""

from __future__ import annotations

import json
import sys
import time

import psutil
import pyarrow.parquet as pq
import pytest
from helpers import cli_json, one_line_error, require, sweep_args
from typer.testing import CliRunner

from detaudit.cli import app
from detaudit.executors.ray import FAULT_ENV, safe_address

runner = CliRunner()
GRID = sweep_args(max_new_tokens=3, backends="bf16,bio+tbik", tp="1,2", batch_sizes="1,2", no_analyze=True)
KILLED = "smoke__bio-tbik__tp2__bs1"  # a TP 2 cell (real rank processes), not a reference cell
RECORD_COLUMNS = [
    "cell_id",
    "prompt_id",
    "output_token_ids",
    "finish_reason",
    "token_logprobs",
    "topk_ids",
    "topk_logprobs",
    "tf_reference_cell",
    "tf_token_logprobs",
    "output_text",
    "predicted_answer",
]


def _ray_children(before: set[int]) -> list[str]:
    """Ray processes among this test process's descendants that were not there before the sweep."""
    out = []
    for p in psutil.Process().children(recursive=True):
        if p.pid in before:
            continue
        try:
            name, cmd = p.name(), " ".join(p.cmdline())
        except psutil.Error:  # already gone
            continue
        if p.status() == psutil.STATUS_ZOMBIE:
            continue
        if name.startswith(("ray::", "raylet", "gcs_server")) or "/ray/" in cmd or "detaudit" in cmd:
            out.append(f"{p.pid} {name} {cmd[:120]}")
    return out


def _ray_left(before: set[int], guard_s: float = 120.0) -> list[str]:
    """`_ray_children` once Ray's shutdown has reaped them, polled until none is left; `guard_s` only stops
    a hang (Ray takes seconds), it does not measure anything."""
    deadline = time.monotonic() + guard_s
    while (left := _ray_children(before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="module")
def grid(tiny_sweep_model) -> list[str]:
    return [*GRID, "--model", str(tiny_sweep_model)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, grid):
    require("ray", "ray")
    base = tmp_path_factory.mktemp("ray")
    local, remote = base / "local", base / "ray"
    t0 = time.monotonic()
    res = runner.invoke(app, ["sweep", *grid, "--output-path", str(local)])
    assert res.exit_code == 0, res.output
    t1 = time.monotonic()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    mp = pytest.MonkeyPatch()
    mp.setenv(FAULT_ENV, f"kill:{KILLED}")
    try:
        res = runner.invoke(
            app, ["sweep", *grid, "--output-path", str(remote), "--executor", "ray", "--max-retries", "1"]
        )
    finally:
        mp.undo()
    assert res.exit_code == 0, res.output
    t2 = time.monotonic()
    leftover = _ray_left(before)
    print(f"local sweep {t1 - t0:.0f} s, ray sweep {t2 - t1:.0f} s")
    return local, remote, res.output, leftover


def _records(run) -> dict[str, list[dict]]:
    cells = json.loads((run / "manifest.json").read_text())["cells"]
    return {cid: pq.read_table(run / "cells" / f"{cid}.parquet", columns=RECORD_COLUMNS).to_pylist() for cid in cells}


@pytest.mark.slow
def test_ray_records_equal_local_bit_for_bit(runs):
    local, remote, _, _ = runs
    a, b = _records(local), _records(remote)
    assert sorted(a) == sorted(b) and len(a) == 8
    for cid in a:
        assert a[cid] == b[cid], cid  # token ids, logprobs and top-k (floats compared exactly)


@pytest.mark.slow
def test_killed_actor_retries_its_cell_and_the_analysis_is_the_same(runs, grid):
    local, remote, output, _ = runs
    m = json.loads((remote / "manifest.json").read_text())
    assert m["executor"]["name"] == "ray" and m["executor"]["max_retries"] == 1 and m["executor"]["ray_version"]
    assert all(c["state"] == "done" for c in m["cells"].values()), m["cells"]
    placements = {cid: c["placement"] for cid, c in m["cells"].items()}
    assert placements[KILLED]["attempt"] == 2, placements[KILLED]
    assert placements["smoke__bio-tbik__tp2__bs2"]["group_actor_restarts"] == 1  # the group's next cell: new actor
    assert all(p["attempt"] == 1 for cid, p in placements.items() if cid != KILLED)
    for p in placements.values():  # where each cell ran
        assert p["node_ip"] == "127.0.0.1" and p["node_id"] and p["cpu_cores"] >= 1 and p["gpu_ids"] == []
    assert "8 cell(s) computed, 0 skipped" in output and "0 failed" in output
    rows = [cli_json(runner.invoke(app, ["analyze", str(run), "--json"])) for run in (local, remote)]
    assert rows[0] == rows[1]
    # resuming the Ray run computes nothing (and starts no Ray runtime)
    res = runner.invoke(app, ["sweep", *grid, "--output-path", str(remote), "--executor", "ray"])
    assert res.exit_code == 0 and "0 cell(s) computed, 8 skipped" in res.output, res.output


@pytest.mark.slow
def test_no_ray_process_outlives_the_sweep(runs):
    assert runs[3] == []


def test_executor_ray_without_the_extra_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    res = runner.invoke(app, ["sweep", "--executor", "ray", "--output-path", str(tmp_path / "r")])
    one_line_error(res, "pip install 'detaudit[ray]'")


def test_ray_options_need_the_ray_executor(tmp_path):
    res = runner.invoke(app, ["sweep", "--ray-address", "10.0.0.1:6379", "--output-path", str(tmp_path / "r")])
    one_line_error(res, "apply to --executor ray only")


def test_recorded_address_has_no_credentials():
    assert safe_address("ray://user:secret@head:10001?token=abc") == "ray://head:10001"
    assert safe_address("10.0.0.1:6379") == "10.0.0.1:6379"
    assert safe_address(None) is None


@pytest.mark.slow
def test_ctrl_c_kills_actors_removes_placement_groups_and_stops_ray(tiny_sweep_model):
    """KeyboardInterrupt in the driver once a group's actor and placement group exist: both are gone before
    the executor shuts down the Ray runtime it started, and no Ray process is left."""
    ray = require("ray", "ray")
    from helpers import engine_options

    from detaudit.config import DecodingParams
    from detaudit.executors import CellGroup, CellJob
    from detaudit.executors.ray import RayExecutor

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    opts = engine_options(tiny_sweep_model, "bio+tbik", 2)
    groups = [CellGroup(opts, [CellJob("c1", 1, ["p"], [[1, 2]], "c1", DecodingParams(greedy=True, max_new_tokens=2))])]
    ex = RayExecutor(num_cpus=2)
    seen: dict = {}
    real_shutdown = ex._shutdown

    def shutdown():
        if ray.is_initialized():
            seen["pgs"] = {pg["state"] for pg in ray.util.placement_group_table().values()}
            seen["alive"] = [a for a in ray._private.state.actors().values() if a["State"] != "DEAD"]
        real_shutdown()

    def progress(cell_id, event, n):
        if event == "engine":
            raise KeyboardInterrupt

    ex._shutdown = shutdown
    with pytest.raises(KeyboardInterrupt):
        ex.run(groups, lambda _: None, lambda out: None, progress)
    assert seen["pgs"] == {"REMOVED"} and seen["alive"] == []
    assert not ray.is_initialized()
    assert _ray_left(before) == []


def _ray_sweep_in_subprocess(out, model_path, timeout_s: float, hang_timeout: float = 300.0, env=None):
    """A Ray sweep through the library (`run_sweep`) in a child process bounded by `timeout_s`: a sweep
    that hangs fails the test instead of hanging it. bf16 and bio+tbik at TP 1 and 2 (one batch size):
    four groups, the TP-2 ones waiting for their TP-1 reference cells. Every group is placed on GPU
    bundles of two logical Ray GPUs (`accelerator="GPU"`: the GPU scheduling path, probes included,
    with the engines on the CPU)."""
    import os
    import subprocess

    code = f"""
import json
from pathlib import Path
from detaudit.config import DecodingParams, EngineSettings, SweepConfig
from detaudit.sweep import run_sweep
cfg = SweepConfig(model={str(model_path)!r}, suites=("smoke",), backends=("bf16", "bio+tbik"), tp=(1, 2),
                  batch_sizes=(2,), decoding=DecodingParams(greedy=True, max_new_tokens=3), limit=2,
                  executor="ray", engine=EngineSettings(hang_timeout={hang_timeout}))
res = run_sweep(cfg, Path({str(out)!r}),
                executor_options=dict(accelerator="GPU", num_gpus=2, num_cpus=2, max_retries=1))
print("RESULT", json.dumps(dict(done=sorted(res.done), failed=res.failed)))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


HUNG = "smoke__bio-tbik__tp1__bs2"  # its first attempt stops producing tokens in the GPU-path sweep


@pytest.fixture(scope="module")
def gpu_path_sweep(tmp_path_factory, tiny_sweep_model):
    """One Ray sweep on the GPU scheduling path (two logical GPUs) in which HUNG's actor hangs on its
    first attempt: both claims below are read from it (one sweep, not two: this is CI's time)."""
    require("ray", "ray")
    out = tmp_path_factory.mktemp("ray-gpu") / "r"
    env = {FAULT_ENV: f"hang:{HUNG}"}
    res = _ray_sweep_in_subprocess(out, tiny_sweep_model, timeout_s=600, hang_timeout=20, env=env)
    return res, json.loads((out / "manifest.json").read_text())["cells"]


@pytest.mark.slow
def test_tp1_and_tp2_groups_share_gpus_without_deadlock(gpu_path_sweep):
    """Two logical GPUs, TP-1 groups holding them while a TP-2 group waits for both: every cell lands.
    (The executor used to wait for the TP-2 group's GPU probes while blocking the loop that would collect
    the TP-1 groups' finished cells and free their GPUs: this sweep never ended.)"""
    res, cells = gpu_path_sweep
    assert res["failed"] == {} and len(res["done"]) == 4, res
    gpus = {cid: c["placement"]["gpu_ids"] for cid, c in cells.items()}
    assert all(len(ids) == (2 if "__tp2__" in cid else 1) for cid, ids in gpus.items()), gpus


@pytest.mark.slow
def test_a_hung_actor_is_killed_and_its_cell_retried(gpu_path_sweep):
    """An actor that stops producing tokens (DETAUDIT_RAY_FAULT=hang:CELL on the cell's first attempt)
    is killed once the hang timeout passes without a token, and the cell lands on a new actor."""
    res, cells = gpu_path_sweep
    assert res["failed"] == {} and HUNG in res["done"], res
    placement = cells[HUNG]["placement"]
    assert placement["attempt"] == 2 and placement["group_actor_restarts"] == 1, placement
    assert all(c["placement"]["attempt"] == 1 for cid, c in cells.items() if cid != HUNG)
