"""Files that would break a reader: suite YAML and gate policies with scalars the YAML loader cannot build,
nesting deeper than any reader should walk, lone surrogates; data rows (a suite's `data_files`, a
`--data-dir` mirror) with huge integers, deep nesting, lone surrogates; `data_files` patterns that walk
symlink cycles or the whole machine; files too large to parse, FIFOs. Each is one line, exit 2, quickly:
refused before the work that would hang."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detaudit.cli import app
from detaudit.errors import DetauditError
from detaudit.inputs import suite_paths, user_files
from detaudit.inputs.suites import load_suite

runner = CliRunner()

ROW_TASK = "task: t\ndataset_path: json\ndataset_kwargs: {data_files: %s}\ntest_split: train\ndoc_to_text: q\n"
MIRROR_TASK = "task: m\nlocal_file: rows.jsonl\ndoc_to_text: q\n"


def _one_line(args: list[str]) -> str:
    res = runner.invoke(app, args)
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert res.exit_code == 2 and len(lines) == 1 and "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    return lines[0]


# ---------------------------------------------------------------- YAML the loader cannot build

YAML_CASES = {
    "date of month 13": ("metadata: {version: 2024-13-45}\n", "cannot read '2024-13-45' as a timestamp"),
    "5000-digit int": ("metadata: {version: " + "9" * 5000 + "}\n", "an integer of 5000 digits (at most 4300)"),
    # refused by the loader's own bound, quickly, not by Python's recursion limit (seconds to unwind)
    "20000 deep": ("metadata: " + "[" * 20000 + "]" * 20000 + "\n", "nested too deeply (more than 100 levels)"),
    "150 deep": ("metadata: " + "[" * 150 + "]" * 150 + "\n", "nested too deeply (more than 100 levels)"),
    "lone surrogate": ('metadata: {description: "\\ud800"}\n', "lone surrogate '\\ud800'"),
}


@pytest.mark.parametrize("name", sorted(YAML_CASES))
def test_suite_yaml_the_loader_cannot_build(tmp_path, name):
    body, message = YAML_CASES[name]
    path = tmp_path / "s.yaml"
    path.write_text("task: s\ndocs: [{q: x}]\ndoc_to_text: q\n" + body)
    assert message in _one_line(["suites", "show", str(path)])


@pytest.mark.parametrize("name", sorted(YAML_CASES))
def test_policy_the_loader_cannot_build(tmp_path, name):
    from unit.test_analyze import invariant_cells, make_run

    body, message = YAML_CASES[name]
    policy = tmp_path / "p.yaml"
    policy.write_text("backends: {}\n" + body.replace("metadata:", "description:"))
    run = make_run(tmp_path / "run", invariant_cells(), backends=("bio+tbik",))
    line = _one_line(["gate", str(run), "--policy", str(policy)])
    assert message in line and "policy" in line


def test_top_level_date_in_a_suite(tmp_path):
    path = tmp_path / "v.yaml"
    path.write_text("task: v\nversion: 2024-13-45\ndocs: [{q: x}]\ndoc_to_text: q\n")
    line = _one_line(["suites", "show", str(path)])
    assert "refused YAML at line 2, column 10" in line


def test_a_deep_template_is_refused_when_parsed(tmp_path):
    path = tmp_path / "j.yaml"
    path.write_text('task: j\ndocs: [{q: x}]\ndoc_to_text: "{{ ' + "[" * 300 + "]" * 300 + ' }}"\n')
    assert "`doc_to_text` is refused: its template is nested too deeply" in _one_line(["suites", "show", str(path)])


def test_a_template_that_renders_a_lone_surrogate(tmp_path):
    path = tmp_path / "j.yaml"
    path.write_text("task: j\ndocs: [{q: x}]\ndoc_to_text: \"{{ '\\\\ud800' }}x\"\n")
    assert "renders a lone surrogate" in _one_line(["suites", "show", str(path)])


# ---------------------------------------------------------------- data rows

ROWS = {
    "5000-digit int": ('{"q": "a", "n": ' + "9" * 5000 + "}", "an integer of 5000 digits"),
    "100k deep": ('{"q": "a", "n": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
    "150 deep": ('{"q": "a", "n": ' + "[" * 150 + "]" * 150 + "}", "nested too deeply (more than 100 levels)"),
    "lone surrogate": ('{"q": "\\ud800"}', "renders a lone surrogate '\\ud800'"),
}


@pytest.mark.parametrize("layout", ["jsonl", "json-array", "mirror"])
@pytest.mark.parametrize("name", sorted(ROWS))
def test_rows_that_break_a_json_reader(tmp_path, name, layout):
    row, message = ROWS[name]
    if layout == "mirror":
        (tmp_path / "mirror").mkdir()
        (tmp_path / "mirror" / "rows.jsonl").write_text('{"q": "fine"}\n' + row + "\n")
        (tmp_path / "m.yaml").write_text(MIRROR_TASK)
        args = ["suites", "show", str(tmp_path / "m.yaml"), "--data-dir", str(tmp_path / "mirror")]
    else:
        rows = f"[{row}]" if layout == "json-array" else '{"q": "fine"}\n' + row + "\n"
        (tmp_path / "rows.json").write_text(rows)
        (tmp_path / "t.yaml").write_text(ROW_TASK % "rows.json")
        args = ["suites", "show", str(tmp_path / "t.yaml")]
    line = _one_line(args)
    assert message in line and "rows" in line


def test_a_mirror_file_that_is_a_fifo_is_refused_unread(tmp_path):
    (tmp_path / "mirror").mkdir()
    os.mkfifo(tmp_path / "mirror" / "rows.jsonl")  # no writer ever comes: a blocking open would hang
    (tmp_path / "m.yaml").write_text(MIRROR_TASK)
    line = _one_line(["suites", "show", str(tmp_path / "m.yaml"), "--data-dir", str(tmp_path / "mirror")])
    assert "is not a regular file" in line


@pytest.mark.parametrize("command", ["suites", "gate"])
def test_a_suite_or_policy_that_is_a_fifo_is_refused_unread(tmp_path, command):
    os.mkfifo(tmp_path / "f.yaml")
    args = ["suites", "show", str(tmp_path / "f.yaml")]
    if command == "gate":
        from unit.test_analyze import invariant_cells, make_run

        args = ["gate", str(make_run(tmp_path / "run", invariant_cells())), "--policy", str(tmp_path / "f.yaml")]
    assert "is not a regular file" in _one_line(args)


# ---------------------------------------------------------------- size first


def test_a_suite_file_over_the_cap_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    path = tmp_path / "big.yaml"
    body = "task: big\ndocs: [{q: x}]\ndoc_to_text: q\n"
    path.write_text(body + "#" * (user_files.MAX_YAML_BYTES + 1 - len(body)) + "\n")

    def never(*a, **k):
        raise AssertionError("the oversized file was parsed")

    monkeypatch.setattr("yaml.load", never)
    line = _one_line(["suites", "show", str(path)])
    assert f"more than the {user_files.MAX_YAML_BYTES} read" in line


def test_a_policy_over_the_cap_is_refused(tmp_path):
    from unit.test_analyze import invariant_cells, make_run

    policy = tmp_path / "p.yaml"
    policy.write_text("backends: {}\n" + "#" * user_files.MAX_YAML_BYTES + "\n")
    line = _one_line(["gate", str(make_run(tmp_path / "run", invariant_cells())), "--policy", str(policy)])
    assert "policy file" in line and "bytes, more than the" in line


# ---------------------------------------------------------------- globbing bounded


def test_glob_through_a_self_symlink_finds_each_file_once(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "rows.jsonl").write_text('{"q": "a"}\n')
    (tmp_path / "loop").symlink_to(".")  # glob.glob follows it level after level: one row found 40 times
    (tmp_path / "t.yaml").write_text(ROW_TASK % "'**/*.jsonl'")
    suite = load_suite(str(tmp_path / "t.yaml"))
    assert [p.text for p in suite.prompts] == ["a"]


def test_glob_visits_at_most_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_paths, "MAX_GLOB_ENTRIES", 50)
    for i in range(60):
        (tmp_path / f"r{i}.txt").write_text("")
    (tmp_path / "rows.jsonl").write_text('{"q": "a"}\n')
    (tmp_path / "t.yaml").write_text(ROW_TASK % "'**/*.jsonl'")
    with pytest.raises(DetauditError, match="visits more than 50 directory entries"):
        load_suite(str(tmp_path / "t.yaml"))
    (tmp_path / "t.yaml").write_text(ROW_TASK % "'*.jsonl'")  # (narrower patterns list the same folder)
    with pytest.raises(DetauditError, match="visits more than 50"):
        load_suite(str(tmp_path / "t.yaml"))


def test_a_pattern_rooted_outside_the_suite_is_refused_before_any_walk(tmp_path, monkeypatch):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x1.jsonl").write_text('{"q": "a"}\n')
    (tmp_path / "suite").mkdir()
    (tmp_path / "suite" / "t.yaml").write_text(ROW_TASK % "'../other/**/x*.jsonl'")
    walked = []
    real = os.scandir
    monkeypatch.setattr(os, "scandir", lambda p=".": (walked.append(p) if "suites" not in str(p) else None) or real(p))
    with pytest.raises(DetauditError, match="outside the suite's directory"):
        load_suite(str(tmp_path / "suite" / "t.yaml"))
    assert walked == []
    (tmp_path / "suite" / "t.yaml").write_text(ROW_TASK % "'/**/x*.jsonl'")  # the whole machine: not walked
    line = _one_line(["suites", "show", str(tmp_path / "suite" / "t.yaml")])
    assert "resolves to /, outside the suite's directory" in line and walked == []


def test_a_trusted_pattern_rooted_at_slash_stops_at_the_cap(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_paths, "MAX_GLOB_ENTRIES", 2000)
    (tmp_path / "t.yaml").write_text(ROW_TASK % "'/**/x*.jsonl'")
    line = _one_line(["suites", "show", str(tmp_path / "t.yaml"), "--trust-suite-paths"])
    assert "visits more than 2000 directory entries" in line


def test_glob_semantics_kept(tmp_path):
    """What glob.glob(recursive=True) finds, bounded_glob finds: `**` spans zero or more directories, `*`
    skips hidden names."""
    import glob

    for rel in ("a.jsonl", "d/b.jsonl", "d/e/c.jsonl", ".h/x.jsonl", "d/.y.jsonl", "d/e/no.txt"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    for pattern in ("**/*.jsonl", "*.jsonl", "d/**/*.jsonl", "*/*.jsonl", "d/e/?.jsonl", "**", "d/[be]*/*"):
        expected = sorted(Path(m) for m in glob.glob(str(tmp_path / pattern), recursive=True) if Path(m).is_file())
        assert suite_paths.bounded_glob(tmp_path / pattern, "w", tmp_path) == expected, pattern


def test_data_dir_walk_is_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(suite_paths, "MAX_GLOB_ENTRIES", 20)
    (tmp_path / "data").mkdir()
    for i in range(30):
        (tmp_path / "data" / f"{i}.csv").write_text("q\nx\n")
    (tmp_path / "t.yaml").write_text("task: t\ndataset_path: csv\ndataset_kwargs: {data_dir: data}\n"
                                     "test_split: train\ndoc_to_text: q\n")  # fmt: skip
    with pytest.raises(DetauditError, match="visits more than 20 directory entries"):
        load_suite(str(tmp_path / "t.yaml"))


# ---------------------------------------------------------------- the mirror key with a packaged builder


def test_local_file_with_dataset_path_json_loads_from_the_mirror(tmp_path):
    """detaudit's mirror key beside `dataset_path: json` (no data_files): --data-dir gives the rows; without
    it the suite is refused, naming both ways to give rows."""
    (tmp_path / "mirror").mkdir()
    (tmp_path / "mirror" / "rows.jsonl").write_text(json.dumps({"q": "from the mirror"}) + "\n")
    (tmp_path / "m.yaml").write_text(
        "task: m\ndataset_path: json\ntest_split: train\nlocal_file: rows.jsonl\ndoc_to_text: q\n"
    )
    suite = load_suite(str(tmp_path / "m.yaml"), data_dir=tmp_path / "mirror")
    assert [p.text for p in suite.prompts] == ["from the mirror"] and suite.source == "mirror:rows.jsonl"
    line = _one_line(["suites", "show", str(tmp_path / "m.yaml")])
    assert "needs `dataset_kwargs.data_files`" in line and "--data-dir" in line and "rows.jsonl" in line
