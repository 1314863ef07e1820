"""What `detaudit sweep` prints: `--json` (the outcome as JSON on stdout, the log on stderr) and, off a
terminal, a line when each cell starts and when it finishes. A tiny random Llama with the embedded
tokenizer (conftest's `tiny_sweep_model`): what is checked here does not depend on the model."""

from __future__ import annotations

import json

import pytest
from helpers import sweep_args
from typer.testing import CliRunner

from detaudit.cli import app

GRID = sweep_args(max_new_tokens=2, backends="bio", tp=1)


@pytest.mark.slow  # a sweep: two cells through the built-in engine
def test_sweep_json_and_cell_lines(tiny_sweep_model, tmp_path):
    runner = CliRunner()
    args = ["sweep", *GRID, "--model", str(tiny_sweep_model), "--batch-sizes", "1,2", "-o", str(tmp_path / "r")]
    res = runner.invoke(app, [*args, "--json"])
    assert res.exit_code == 0, res.output
    outcome = json.loads(res.stdout)  # stdout is the JSON alone: no table, no log line
    assert outcome["done"] == ["smoke__bio__tp1__bs1", "smoke__bio__tp1__bs2"] and outcome["failed"] == {}
    assert outcome["run_dir"] == str(tmp_path / "r") and outcome["skipped"] == []
    rows = {(r["suite"], r["backend"]): r for r in outcome["summary"]}
    assert rows[("smoke", "bio")]["cells"] == 2
    log = res.stderr.splitlines()  # CliRunner is no terminal: one line per event
    assert [line for line in log if line.endswith(" started")] == [
        "[1/2] smoke__bio__tp1__bs1 started",
        "[2/2] smoke__bio__tp1__bs2 started",
    ]
    assert [line.split(" in ")[0] for line in log if " finished in " in line] == [
        "[1/2] smoke__bio__tp1__bs1 finished",
        "[2/2] smoke__bio__tp1__bs2 finished",
    ]
    again = json.loads(runner.invoke(app, [*args, "--json", "--no-analyze"]).stdout)  # resumed: nothing to do
    assert again["done"] == [] and len(again["skipped"]) == 2 and again["summary"] is None
