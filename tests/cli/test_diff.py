"""`detaudit diff RUN_A RUN_B`: cells compared bitwise between two runs, exit codes like the gate's."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import one_line_error
from typer.testing import CliRunner
from unit.record_flips import CELLS3, FLIPS, LAST, TP3, moe_cells3
from unit.test_analyze import BF16, TBIK, diverging_bf16, invariant_cells, make_run

from detaudit.cli import app

runner = CliRunner()


def cells() -> dict[str, list[dict]]:
    return {**diverging_bf16(), **invariant_cells()}


def one_ulp_later(cells: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """bio+tbik TP 2, prompt p1, position 2: its log-probability moved by one float32 ulp."""
    row = cells[TBIK[2]][1]
    row["token_logprobs"] = list(row["token_logprobs"])
    row["token_logprobs"][2] = float(np.nextafter(np.float32(row["token_logprobs"][2]), np.float32(0)))
    return cells


def diff(*args: str):
    return runner.invoke(app, ["diff", *map(str, args)])


def test_equal_runs_exit_0(tmp_path):
    a, b = make_run(tmp_path / "a", cells()), make_run(tmp_path / "b", cells())
    res = diff(a, b)
    assert res.exit_code == 0, res.output
    assert "4 of 4 cells completed in both runs are bitwise equal." in res.output
    assert "None in the compared fields." in res.output


def test_one_ulp_in_one_cell_exits_1_naming_field_and_position(tmp_path):
    a, b = make_run(tmp_path / "a", cells()), make_run(tmp_path / "b", one_ulp_later(cells()))
    res = diff(a, b)
    assert res.exit_code == 1, res.output
    assert "token_logprobs, prompt p1, position 2" in res.output
    assert "3 of 4 cells completed in both runs are bitwise equal, 1 differ" in res.output

    report = json.loads(diff(a, b, "--json").stdout)
    assert report["equal"] is False
    (cell,) = [c for c in report["cells"] if c["status"] == "differs"]
    assert cell["cell"] == TBIK[2] and cell["records_differ"] == 1 and cell["outputs_differ"] == 0
    want = {"field": "token_logprobs", "prompt_id": "p1", "position": 2, "repeat": 0, "sampled": False}
    assert cell["first_difference"] == want
    assert cell["maxprob_div"] == 0  # the top-k rows did not move


def test_cells_in_one_run_only_are_listed_and_do_not_fail(tmp_path):
    one = {k: v for k, v in cells().items() if k != BF16[2]}
    a, b = make_run(tmp_path / "a", cells()), make_run(tmp_path / "b", one)
    res = diff(a, b, "--json")
    assert res.exit_code == 0, res.output
    status = {c["cell"]: c["status"] for c in json.loads(res.stdout)["cells"]}
    assert status[BF16[2]] == "only in A" and list(status.values()).count("equal") == 3


def test_manifest_differences_come_first(tmp_path):
    a = make_run(tmp_path / "a", cells())
    b = make_run(tmp_path / "b", cells(), identity={"dtype": "float32"}, manifest_extra={"code_version": "0.2.0"})
    res = diff(a, b)
    assert res.exit_code == 0, res.output  # the bits decide the exit code; the differences are listed
    assert res.output.index("| comparable.dtype | bfloat16 | float32 |") < res.output.index("## Cells")
    assert "| code_version | 0.1.0 | 0.2.0 |" in res.output


def test_outputs_that_differ_are_counted_with_their_divergence(tmp_path):
    a = make_run(tmp_path / "a", cells())
    swapped = cells()
    swapped[BF16[1]], swapped[BF16[2]] = swapped[BF16[2]], swapped[BF16[1]]  # bf16 TP 1 <-> TP 2 records
    b = make_run(tmp_path / "b", swapped)
    report = json.loads(diff(a, b, "--json").stdout)
    by_cell = {c["cell"]: c for c in report["cells"]}
    assert by_cell[BF16[1]]["outputs_differ"] == 2  # p1 diverges at 2, p2 is empty in one run
    assert by_cell[BF16[1]]["first_divergence"] == 0
    assert by_cell[BF16[1]]["maxprob_div"] > 0


def bad_dir(tmp_path, kind: str):
    path = tmp_path / kind
    if kind != "missing":
        path.mkdir()
    if kind == "corrupt":
        (path / "manifest.json").write_text("{oops")
    return path


@pytest.mark.parametrize(
    "kind, message",
    [("missing", "does not exist"), ("empty", "is not a detaudit run directory"), ("corrupt", "is corrupt")],
)
def test_bad_input_exits_2_in_one_line(tmp_path, kind, message):
    a, bad = make_run(tmp_path / "a", cells()), bad_dir(tmp_path, kind)
    one_line_error(diff(a, bad), message)
    one_line_error(diff(bad, a), message)


def test_runs_with_no_common_cell_exit_2(tmp_path):
    a = make_run(tmp_path / "a", {k: v for k, v in cells().items() if k in BF16.values()})
    b = make_run(tmp_path / "b", {k: v for k, v in cells().items() if k in TBIK.values()})
    one_line_error(diff(a, b), "no completed cell in common")


def moe_run(path, flip=None):
    """Three agreeing bio+tbik configurations of an MoE run (`unit.record_flips`), with `flip` applied to
    record p1 of the third one."""
    cells = moe_cells3()
    if flip is not None:
        flip.change(cells[LAST][1])
    return make_run(path, cells, backends=("bio+tbik",), tp=TP3)


@pytest.fixture(scope="module")
def moe_a(tmp_path_factory):
    return moe_run(tmp_path_factory.mktemp("moe") / "a")


@pytest.mark.parametrize("flip", FLIPS, ids=[f.id for f in FLIPS])
def test_one_changed_number_of_any_field_in_the_third_cell_exits_1(moe_a, tmp_path, flip):
    """Every numeric field is compared, routing included (expert ids, gates, margins, generated and
    teacher-forced), in every cell: the change sits in the third of three."""
    res = diff(moe_a, moe_run(tmp_path / "b", flip), "--json")
    assert res.exit_code == 1, res.output
    by_cell = {c["cell"]: c for c in json.loads(res.stdout)["cells"]}
    assert {c: d["status"] for c, d in by_cell.items()} == {
        CELLS3[1]: "equal",
        CELLS3[2]: "equal",
        LAST: "differs",
    }
    # a token changed alone leaves the top-k there as it was: the sampler's difference, and said so
    sampled = flip.field == "output_token_ids"
    want = {"field": flip.field, "prompt_id": "p1", "position": flip.position, "repeat": 0, "sampled": sampled}
    assert by_cell[LAST]["first_difference"] == want and by_cell[LAST]["records_differ"] == 1
    assert by_cell[LAST]["outputs_differ"] == (flip.field == "output_token_ids")


def test_three_agreeing_cells_are_equal_and_each_cell_is_compared(moe_a, tmp_path):
    res = diff(moe_a, moe_run(tmp_path / "b"))
    assert res.exit_code == 0 and "3 of 3 cells completed in both runs are bitwise equal." in res.output
    res = diff(moe_a, moe_run(tmp_path / "g", FLIPS[8]))  # a routing gate of the third cell
    assert res.exit_code == 1 and "2 of 3 cells completed in both runs are bitwise equal, 1 differ" in res.output
    assert f"{FLIPS[8].field}, prompt p1, position {FLIPS[8].position}" in res.output
    cells = moe_cells3()
    for cell in CELLS3.values():  # the middle cell too
        cells[cell][2]["token_logprobs"][0] = float(np.nextafter(np.float32(cells[cell][2]["token_logprobs"][0]), 0))
    report = json.loads(diff(moe_a, make_run(tmp_path / "c", cells, backends=("bio+tbik",), tp=TP3), "--json").stdout)
    assert [(c["status"], c["records_differ"]) for c in report["cells"]] == [("differs", 1)] * 3
