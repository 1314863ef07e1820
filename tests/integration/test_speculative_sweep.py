"""`detaudit sweep --speculative` end to end on a tiny random Llama with the embedded tokenizer (what is
checked here, the run directory, does not depend on the model): cell ids, the manifest's settings and
draft checksum, the records' counts, the report and gate, resume (adding a setting widens the grid; a
different draft under the same name is refused) and `diff`."""

from __future__ import annotations

import json
import shutil

import pytest
from helpers import cli_json, one_line_error, sweep_args
from typer.testing import CliRunner

from detaudit.cli import app
from detaudit.runs.rundir import RunDir

pytestmark = pytest.mark.slow  # sweeps

runner = CliRunner()


def test_sweep_with_the_speculative_axis(tmp_path, tiny_sweep_model):
    draft = tmp_path / "models" / "tiny-draft"
    res = runner.invoke(app, ["models", "truncate", str(tiny_sweep_model), "--layers", "1", "-o", str(draft)])
    assert res.exit_code == 0, res.output
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    out = tmp_path / "run"
    grid = sweep_args(limit=3, max_new_tokens=8, backends="bf16,bio+tbik", tp=1, batch_sizes="1,3", output_path=out)
    base = ["sweep", "--model", str(tiny_sweep_model), *grid]
    res = runner.invoke(app, [*base, "--speculative", f"off,ngram:3,draft:{draft}:2", "--no-analyze"])
    assert res.exit_code == 0, res.output
    run = RunDir(out)
    m = run.load()
    assert set(m.cells) == {
        f"smoke__{b}__tp1__bs{bs}{s}"
        for b in ("bf16", "bio-tbik")
        for bs in (1, 3)
        for s in ("", "__ngram3", "__draft2-tiny-draft")
    }
    assert all(c.state == "done" for c in m.cells.values())
    assert m.speculative["ngram3"]["setting"] == "ngram:3"
    d = m.speculative["draft2-tiny-draft"]
    assert d["setting"] == f"draft:{draft}:2" and d["path"] == str(draft.resolve()) and len(d["checksum"]) == 64
    table = run.read_table("smoke__bio-tbik__tp1__bs3__draft2-tiny-draft")
    assert set(table.column("speculative").to_pylist()) == {f"draft:{draft}:2"}
    assert sum(table.column("spec_drafted").to_pylist()) > 0
    plain = run.read_table("smoke__bio-tbik__tp1__bs3")
    assert set(plain.column("speculative").to_pylist()) == {None}
    assert set(plain.column("spec_drafted").to_pylist()) == {None}

    rows = {r["backend"]: r for r in cli_json(runner.invoke(app, ["analyze", str(out), "--json"]))}
    assert rows["bio+tbik"]["spec_bitwise_diff_records"] == 0 and rows["bio+tbik"]["bitwise_diff_records"] == 0
    res = runner.invoke(app, ["report", str(out), "--format", "md,csv"])
    assert res.exit_code == 0, res.output
    assert "## Speculative decoding" in (out / "report.md").read_text() and (out / "speculative.csv").exists()
    assert runner.invoke(app, ["gate", str(out)]).exit_code == 0

    # resume: nothing recomputed; a new setting adds its cells only
    res = runner.invoke(app, [*base, "--speculative", f"off,ngram:3,draft:{draft}:2", "--no-analyze"])
    assert res.exit_code == 0 and "12 skipped" in res.output, res.output
    res = runner.invoke(app, [*base, "--speculative", "off,ngram:1", "--no-analyze"])
    assert res.exit_code == 0 and "4 cell(s) computed" in res.output, res.output
    assert "smoke__bio-tbik__tp1__bs1__ngram1" in run.load().cells
    # another checkpoint under the draft's name: refused, nothing lost
    other = shutil.copytree(draft, tmp_path / "elsewhere" / "tiny-draft")
    gen = json.loads((other / "generation_config.json").read_text())  # (a file of the checksum)
    (other / "generation_config.json").write_text(json.dumps({**gen, "top_k": 7}))
    res = runner.invoke(app, [*base, "--speculative", f"off,draft:{other}:2", "--no-analyze"])
    one_line_error(res, "holds cells of another draft model or n-gram lookup under the same name (draft2-tiny-draft")
    assert len(run.load().done_cells()) == 16

    # diff matches the speculative cells by id
    copy = shutil.copytree(out, tmp_path / "copy")
    res = runner.invoke(app, ["diff", str(out), str(copy), "--json"])
    assert res.exit_code == 0, res.output
    assert {c["cell"] for c in cli_json(res)["cells"]} >= {"smoke__bf16__tp1__bs1__ngram3"}
