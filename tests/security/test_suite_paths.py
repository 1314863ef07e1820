"""Suite files are untrusted: a path they name (include, data_files, data_dir, dataset_path) must stay in
the YAML's own directory, symlinks resolved, unless the user passes --trust-suite-paths (recorded in the
manifest); dataset_kwargs reach `datasets` with data-selection keys only; loading a suite writes nothing
anywhere."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from detaudit.cli import app
from detaudit.errors import DetauditError
from detaudit.inputs.suites import load_suite

SECRET = "s3cr3t-row"


@pytest.fixture
def tree(tmp_path) -> Path:
    """suite/ (the user's task folder) and outside/ (a file the suite must not reach), linked in."""
    outside, suite = tmp_path / "outside", tmp_path / "suite"
    outside.mkdir()
    suite.mkdir()
    (outside / "rows.csv").write_text(f"q,a\n{SECRET},1\n")
    (outside / "base.yaml").write_text("doc_to_text: q\n")
    (suite / "link.csv").symlink_to(outside / "rows.csv")
    (suite / "linkdir").symlink_to(outside)
    (suite / "inside.csv").write_text("q,a\nfine,1\n")
    (suite / "data").mkdir()  # a data_dir inside the suite's directory, one of whose entries leads out
    (suite / "data" / "fine.csv").write_text("q,a\nfine,1\n")
    (suite / "data" / "rows.csv").symlink_to(outside / "rows.csv")
    return suite


def _yaml(suite: Path, body: str) -> Path:
    path = suite / "task.yaml"
    path.write_text("task: t\ndoc_to_text: q\n" + body)
    return path


CSV = "dataset_path: csv\ntest_split: train\ndataset_kwargs: {%s}\n"
ESCAPES = {
    "include-absolute": ("include: OUTSIDE/base.yaml\ndocs: [{q: x}]\n", "include"),
    "include-dotdot": ("include: ../outside/base.yaml\ndocs: [{q: x}]\n", "include"),
    "data_files-absolute": (CSV % "data_files: OUTSIDE/rows.csv", "data_files"),
    "data_files-dotdot": (CSV % "data_files: ../outside/rows.csv", "data_files"),
    "data_files-symlink": (CSV % "data_files: link.csv", "data_files"),
    "data_files-glob-through-symlink": (CSV % "data_files: 'linkdir/*.csv'", "data_files"),
    "data_files-split-dict": (CSV % "data_files: {train: [inside.csv, ../outside/rows.csv]}", "data_files"),
    "data_files-file-url": (CSV % "data_files: 'file://OUTSIDE/rows.csv'", "URLs"),
    "data_files-fsspec-chain": (CSV % "data_files: 'simplecache::file://OUTSIDE/rows.csv'", "URLs"),
    "data_files-https-chained-to-file": (
        CSV % "data_files: 'https://example.com/a.csv::file://OUTSIDE/rows.csv'",
        "URLs",
    ),
    "data_dir-dotdot": (CSV % "data_dir: ../outside", "data_dir"),
    "data_dir-symlink": (CSV % "data_dir: linkdir", "data_dir"),
    "data_dir-symlink-inside": (CSV % "data_dir: data", "its entry rows.csv"),
    "dataset_path-absolute": ("dataset_path: OUTSIDE\ntest_split: train\n", "local path"),
    "dataset_path-dotdot": ("dataset_path: ../outside\ntest_split: train\n", "local path"),
    "hub-data_files-absolute": (
        "dataset_path: org/ds\ntest_split: train\ndataset_kwargs: {data_files: OUTSIDE/rows.csv}\n",
        "inside the dataset's repository",
    ),
}


@pytest.mark.parametrize("name", sorted(ESCAPES))
def test_every_escape_is_refused_without_the_flag(tree, name, monkeypatch):
    body, named = ESCAPES[name]
    path = _yaml(tree, body.replace("OUTSIDE", str(tree.parent / "outside")))
    monkeypatch.chdir(tree.parent)  # a relative dataset_path would be read from here by `datasets`
    result = CliRunner().invoke(app, ["suites", "show", str(path)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert named in lines[0] and "--trust-suite-paths" in lines[0] and SECRET not in result.output


@pytest.mark.parametrize(
    "name", ["include-dotdot", "data_files-dotdot", "data_files-symlink", "data_files-glob-through-symlink"]
)
def test_the_flag_lets_a_suite_read_outside(tree, name):
    body, _ = ESCAPES[name]
    path = _yaml(tree, body.replace("OUTSIDE", str(tree.parent / "outside")))
    result = CliRunner().invoke(app, ["suites", "show", str(path), "--trust-suite-paths", "--json"])
    assert result.exit_code == 0, result.output
    assert SECRET in result.output or name.startswith("include")


def test_paths_inside_the_directory_still_work(tree):
    suite = load_suite(str(_yaml(tree, CSV % "data_files: inside.csv")))
    assert [p.text for p in suite.prompts] == ["fine"]
    (tree / "sub").mkdir()
    (tree / "sub" / "more.csv").write_text("q,a\nmore,2\n")
    suite = load_suite(str(_yaml(tree, CSV % "data_files: [inside.csv, 'sub/*.csv']")))
    assert [p.text for p in suite.prompts] == ["fine", "more"]


@pytest.mark.parametrize("key", ["cache_dir", "download_mode", "storage_options", "token", "num_proc", "split"])
def test_dataset_kwargs_other_than_data_selection_are_refused(tree, key):
    path = _yaml(tree, CSV % f"data_files: inside.csv, {key}: x")
    with pytest.raises(DetauditError) as info:
        load_suite(str(path))
    assert f"key(s) {key} refused" in str(info.value) and "data-selection" in str(info.value)


def test_dataset_path_json_without_data_files_is_refused(tree, monkeypatch):
    monkeypatch.chdir(tree)  # `datasets` would read every file of this directory
    path = _yaml(tree, "dataset_path: json\ntest_split: train\n")
    with pytest.raises(DetauditError, match="`dataset_path: json` needs `dataset_kwargs.data_files`"):
        load_suite(str(path))


def test_hub_id_that_names_a_local_directory_is_refused(tree, monkeypatch):
    (tree / "org" / "ds").mkdir(parents=True)
    monkeypatch.chdir(tree)
    path = _yaml(tree, "dataset_path: org/ds\ntest_split: train\n")
    with pytest.raises(DetauditError, match="names a local path"):
        load_suite(str(path))


def _files(root: Path) -> dict[str, int]:
    return {str(p): p.stat().st_mtime_ns for p in root.rglob("*") if p.is_file() or p.is_symlink()}


@pytest.mark.parametrize("fmt", ["json", "csv", "parquet"])
def test_loading_local_files_writes_nothing(tmp_path, monkeypatch, fmt):
    """No `datasets` cache, no file anywhere: local files are parsed here or streamed."""
    import datasets
    import pandas as pd

    cache, scratch = tmp_path / "hf-cache", tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))  # where a scratch directory would go
    suite_dir = tmp_path / "suite"
    suite_dir.mkdir()
    frame = pd.DataFrame({"q": ["one?", "two?"], "a": ["1", "2"]})
    file = suite_dir / f"rows.{fmt}"
    {"json": lambda: frame.to_json(file, orient="records", lines=True), "csv": lambda: frame.to_csv(file, index=False),
     "parquet": lambda: frame.to_parquet(file)}[fmt]()  # fmt: skip
    path = _yaml(suite_dir, f"dataset_path: {fmt}\ntest_split: train\ndataset_kwargs: {{data_files: rows.{fmt}}}\n")
    monkeypatch.chdir(tmp_path)
    before = _files(tmp_path)
    assert [p.text for p in load_suite(str(path)).prompts] == ["one?", "two?"]
    assert _files(tmp_path) == before and not cache.exists()


def test_trust_flag_is_recorded_in_the_manifest_config():
    from detaudit.config import SweepConfig
    from detaudit.runs.manifest import _config

    config = SweepConfig(model="m", suites=("s",), trust_suite_paths=True, apply_chat_template=False).to_dict()
    assert config["trust_suite_paths"] is True and config["apply_chat_template"] is False
    on_disk = json.loads(json.dumps(config))  # a manifest holding it reads back (the sweep records it end to
    assert _config(on_disk, "manifest")["trust_suite_paths"] is True  # end: test_suite_decoding_sweep.py)


@pytest.fixture
def mirror(tmp_path) -> Path:
    """A --data-dir mirror whose aime24.jsonl is a symlink to a file outside it."""
    outside, mirror = tmp_path / "outside", tmp_path / "mirror"
    outside.mkdir()
    mirror.mkdir()
    (outside / "rows.jsonl").write_text(json.dumps({"id": 1, "problem": SECRET, "answer": "1"}) + "\n")
    (mirror / "aime24.jsonl").symlink_to(outside / "rows.jsonl")
    return mirror


def test_a_data_dir_file_linked_outside_the_data_dir_is_refused(mirror):
    """A mirror is shared like data: its file may not lead the sweep to read, and record as prompts, a
    file from elsewhere on the machine. One line, exit 2; `--trust-suite-paths` lifts it."""
    result = CliRunner().invoke(app, ["suites", "show", "aime24", "--data-dir", str(mirror)])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "outside the data dir" in lines[0] and "--trust-suite-paths" in lines[0], lines
    assert SECRET not in result.output
    with pytest.raises(DetauditError, match="outside the data dir"):
        load_suite("aime24", data_dir=mirror)
    assert [p.text.split("\n")[0] for p in load_suite("aime24", data_dir=mirror, trust_paths=True).prompts] == [SECRET]


def test_a_data_dir_file_linked_inside_the_data_dir_is_read(mirror):
    (mirror / "v2").mkdir()
    (mirror / "aime24.jsonl").unlink()
    (mirror / "v2" / "aime24.jsonl").write_text(json.dumps({"id": 7, "problem": "fine?", "answer": "3"}) + "\n")
    (mirror / "aime24.jsonl").symlink_to(mirror / "v2" / "aime24.jsonl")
    (prompt,) = load_suite("aime24", data_dir=mirror).prompts
    assert prompt.id == "7" and prompt.text.startswith("fine?")
