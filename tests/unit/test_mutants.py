"""The mutation check (`python -m detaudit.devtools.mutants`): its catalogue applies to the tree as it is,
catalogue rot and bad input are refused in one line, a planted mutant never outlives its run, and one
cheap mutant run end to end is reported killed by the test that guards it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from detaudit.devtools import mutants
from detaudit.errors import DetauditError


def test_every_mutant_applies_exactly_once_and_compiles():
    """`load_catalogue` refuses a search text found other than once, a replacement that does not compile
    and a test file that does not exist: loading the shipped catalogue checks all of it on this tree."""
    catalogue = mutants.load_catalogue()
    assert len(catalogue) >= 30
    assert {m.area for m in catalogue} == set(mutants.AREAS)  # every area has mutants
    for m in catalogue:
        text = (mutants.ROOT / m.file).read_text()
        assert text.count(m.search) == 1, m.name
        assert text.replace(m.search, m.replace) != text, m.name


def _tree(tmp_path: Path, entry: str) -> tuple[Path, Path]:
    root = tmp_path / "root"
    (root / "pkg").mkdir(parents=True)
    (root / "tests").mkdir()
    (root / "pkg" / "a.py").write_text("x = 1\ny = x + 1\nz = x + 1\n")
    (root / "tests" / "test_a.py").write_text("def test_a():\n    pass\n")
    catalogue = tmp_path / "mutants.yaml"
    catalogue.write_text(
        "- {name: m, area: numerics, file: pkg/a.py, bug: b, tests: [tests/test_a.py::test_a], %s}\n" % entry
    )
    return catalogue, root


@pytest.mark.parametrize(
    "entry, message",
    [
        ("search: 'w = 2', replace: 'w = 3'", "its search text occurs 0 times in pkg/a.py, not once"),
        ("search: 'x + 1', replace: 'x - 1'", "its search text occurs 2 times in pkg/a.py, not once"),
        ("search: 'y = x + 1', replace: 'y = x +'", "the mutated pkg/a.py does not compile"),
        ("search: 'y = x + 1', replace: 'y = x + 1'", "its replacement is its search text"),
        ("search: 'y = x', replace: 'y = -x', k: ''", "k must be a pytest -k expression"),
        ("search: 'y = x', replace: 'y = -x', size: 3", "unknown key 'size'"),
    ],
)
def test_catalogue_rot_is_refused_naming_the_mutant(tmp_path, entry, message):
    catalogue, root = _tree(tmp_path, entry)
    with pytest.raises(DetauditError, match=message.replace("(", r"\(")):
        mutants.load_catalogue(catalogue, root)


def test_a_missing_test_file_and_a_twice_used_name_are_refused(tmp_path):
    catalogue, root = _tree(tmp_path, "search: 'y = x', replace: 'y = -x'")
    text = catalogue.read_text()
    catalogue.write_text(text.replace("tests/test_a.py::test_a", "tests/test_b.py::test_b"))
    with pytest.raises(DetauditError, match="test tests/test_b.py::test_b names no file"):
        mutants.load_catalogue(catalogue, root)
    for file, message in (("pkg/b.py", "pkg/b.py is not a file of the checkout"), ("../a.py", "outside the checkout")):
        catalogue.write_text(text.replace("pkg/a.py", file))
        with pytest.raises(DetauditError, match=message):
            mutants.load_catalogue(catalogue, root)
    catalogue.write_text(text + text)
    with pytest.raises(DetauditError, match="two mutants are named 'm'"):
        mutants.load_catalogue(catalogue, root)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "no-such-mutant"], "--only: no mutant is named 'no-such-mutant'"),
        (["--min-score", "150"], "--min-score must be a percentage from 0 to 100"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds"),
        (["--fastest"], "unrecognized arguments: --fastest"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    try:
        code = mutants.main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_a_mutant_is_restored_whatever_its_run_does(tmp_path, monkeypatch):
    """The file is mutated while the tests run, then put back byte for byte with its time stamp, also
    when the run is interrupted."""
    m = next(m for m in mutants.load_catalogue() if m.name == "top5-not-sorted")
    copy = tmp_path / "copy"
    (copy / Path(m.file).parent).mkdir(parents=True)
    path = copy / m.file
    path.write_bytes((mutants.ROOT / m.file).read_bytes())
    before, stamp = path.read_bytes(), path.stat().st_mtime_ns
    seen = []

    def interrupted(*args):
        seen.append(m.replace in path.read_text())
        raise KeyboardInterrupt

    monkeypatch.setattr(mutants, "_pytest", interrupted)
    with pytest.raises(KeyboardInterrupt):
        mutants.run_mutant(copy, m, 0, fast=True, timeout=1)
    assert seen == [True]
    assert path.read_bytes() == before and path.stat().st_mtime_ns == stamp


@pytest.mark.slow  # copies the checkout and starts two pytest processes (the baseline and the mutant's run)
def test_one_cheap_mutant_is_killed_by_its_test_and_the_tree_is_untouched(capsys):
    m = next(m for m in mutants.load_catalogue() if m.name == "top5-not-sorted")
    before = (mutants.ROOT / m.file).read_bytes()
    assert mutants.main(["--only", m.name, "--fast", "--json", "--min-score", "100"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["killed"], out["mutants"], out["score"]) == (1, 1, 100.0)
    (row,) = out["outcomes"]
    assert row["status"] == "killed"
    assert row["killed_by"] == "tests/unit/test_analyze.py::test_top5_probs_sorts_truncates_and_pads"
    assert (mutants.ROOT / m.file).read_bytes() == before


def test_the_scratch_copy_holds_every_package_and_leaves_out_run_directories():
    """`runs` is both a run-directory name at the checkout's top (left out) and a package (copied): a copy
    without `detaudit/runs/` broke every mutant whose file is in it."""
    from detaudit.devtools.mutants import ROOT, _not_copied

    assert "runs" in _not_copied(str(ROOT), ["runs", "detaudit", ".carry"])
    assert "runs" not in _not_copied(str(ROOT / "detaudit"), ["runs", "inputs"])
    assert "__pycache__" in _not_copied(str(ROOT / "detaudit" / "runs"), ["__pycache__", "rundir.py"])
