"""The repository's own rules: the README stays short, reports/ holds results and not code or run
artifacts, run artifacts are ignored by git, and every detaudit command the docs show exists with the
options they give it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.main import get_command

from detaudit.cli import app

REPO = Path(__file__).resolve().parents[2]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_IN_REPORTS = {".py", ".sh", ".lock", ".gz", ".log", ".parquet"}


def test_readme_is_at_most_150_lines():
    assert len((REPO / "README.md").read_text().splitlines()) <= 150


def test_reports_hold_readmes_and_small_tables_only():
    files = [p for p in (REPO / "reports").rglob("*") if p.is_file()]
    assert len(files) <= 80, len(files)
    assert not [p for p in files if p.suffix in NOT_IN_REPORTS or p.name in ("manifest.json", ".lock")]
    assert not [p for p in (REPO / "reports").rglob("cells") if p.is_dir()]  # no run directories
    folders = {p.parent for p in files}
    assert not [f for f in folders if not (f / "README.md").is_file()]  # every topic says what ran


@pytest.mark.skipif(shutil.which("git") is None or not (REPO / ".git").exists(), reason="needs a git checkout")
@pytest.mark.parametrize(
    "path", ["runs/default/manifest.json", "reports/x/run/.lock", "reports/x/run/cells/a.parquet", "x.log", "x.gz"]
)
def test_run_artifacts_are_ignored_by_git(path):
    assert subprocess.run(["git", "check-ignore", "-q", path], cwd=REPO).returncode == 0, path


def _commands(text: str) -> list[str]:
    """Every `detaudit ...` command line in inline code and fenced blocks (continuations joined,
    comments cut)."""
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S)
    lines = [re.sub(r"(^|\s)#.*", "", line) for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return [m for s in lines + spans for m in re.findall(r"\bdetaudit( [a-z][^`#|\n]*)", s)]


def _options(command) -> set[str]:
    return {o for p in command.params for o in (*p.opts, *p.secondary_opts)}


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_documented_commands_exist_with_their_options(doc):
    root = get_command(app)
    found = _commands(doc.read_text())
    for line in found:
        words, command = line.split(), root
        while words and hasattr(command, "commands") and words[0] in command.commands:
            command = command.commands[words.pop(0)]
        assert command is not root, f"{doc.name}: `detaudit{line}` names no command"
        unknown = set(re.findall(r"--[a-z][a-z0-9-]*", " ".join(words))) - _options(command)
        assert not unknown, f"{doc.name}: `detaudit{line}`: {sorted(unknown)} not options of {command.name}"
    if doc.name == "README.md":
        assert len(found) >= 10  # the commands table and the examples were read


def test_tests_skip_an_extra_only_when_it_is_not_installed():
    """`pytest.importorskip` also skips an extra that is installed but broken (a missing dependency), which
    then reads as a passing run: tests use `helpers.require`, which skips only when the module is absent."""
    call = "importorskip" + "("
    assert [str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("*.py") if call in p.read_text()] == []


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_wheel_recipes_build_detaudits_wheel_alone(doc):
    """`pip wheel .` without --no-deps builds (or downloads) a wheel of every dependency too, torch
    included; the recipes say --no-deps."""
    for recipe in re.findall(r"pip wheel[^`\n]*", doc.read_text()):
        assert "--no-deps" in recipe, (doc.name, recipe)
