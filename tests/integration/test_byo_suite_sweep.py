"""A user's own lm-eval task file through `detaudit sweep`: a json `data_files` task runs,
cells are named by the task, an ungraded row is kept, counted in the manifest and named in one warning
line, and a non-interactive log gets one line per finished cell."""

from __future__ import annotations

import json

import pytest
from helpers import sweep_args
from typer.testing import CliRunner

from detaudit.cli import app

pytestmark = pytest.mark.slow  # the real embedded model

TASK = """\
task: my_task
dataset_path: json
dataset_kwargs: {data_files: {test: data/test.jsonl}}
test_split: test
output_type: generate_until
doc_to_text: "Question: {{question}}\\nAnswer:"
doc_to_target: answer
metric_list: [{metric: exact_match}]
num_fewshot: 0
"""


def test_sweep_runs_a_json_task_file(smollm, tmp_path, monkeypatch):
    evals = tmp_path / "evals"
    (evals / "data").mkdir(parents=True)
    (evals / "my_task.yaml").write_text(TASK)
    rows = [
        {"question": "What is 2+3?", "answer": "5"},
        {"question": "What is 7*6?", "answer": ""},
        {"question": "What is 10-4?", "answer": "6"},
    ]
    (evals / "data" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.chdir(tmp_path / "..")  # data_files resolve relative to the YAML, not the working directory
    out = tmp_path / "run"
    suite = evals / "my_task.yaml"
    args = sweep_args(suites=suite, limit=None, max_new_tokens=2, backends="bio", tp=1, batch_sizes="1,3")
    res = CliRunner().invoke(app, ["sweep", *args, "--output-path", str(out), "--no-analyze"])
    assert res.exit_code == 0, res.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert sorted(manifest["cells"]) == ["my_task__bio__tp1__bs1", "my_task__bio__tp1__bs3"]
    assert manifest["suites"]["my_task"]["ungraded"] == 1
    assert manifest["suites"]["my_task"]["ignored_keys"] == ["metric_list", "num_fewshot"]
    warning = [line for line in res.output.splitlines() if "no answer" in line]
    assert len(warning) == 1 and "kept ungraded: 1" in warning[0], res.output
    finished = [line for line in res.output.splitlines() if " finished in " in line]  # CliRunner: not a terminal
    assert [line.split()[0] for line in finished] == ["[1/2]", "[2/2]"], res.output
