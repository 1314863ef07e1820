"""docs/architecture.md is the map of the code, and stays one: its layers table is `LAYERS` entry for entry
(and its private layers `PRIVATE`), every module of the package is named in it, and every repository
path it names exists.

A module or subpackage of detaudit/ is *named* when a backticked span of the page (outside fenced blocks)
is its dotted name relative to detaudit/ (`inputs.suites`, `backends.kernels`) or its path relative to
detaudit/ (`builtin/moe.py`; a package as `builtin/` or `builtin`), with or without a leading
`detaudit/`. A subpackage's `__init__.py` is the subpackage; the package's own is `__init__`. Naming
the parent does not name its modules: each one is on the page by name.

A span *looks like a repository path* when it has no spaces and either contains a `/` or ends in a file
suffix (.py .yaml .yml .sh .md .txt .toml); it must exist at the repository root, under detaudit/ or
under tests/ (the page writes test files relative to tests/, as `unit/test_bio.py`).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from detaudit.devtools.imports import LAYERS, PACKAGE, PRIVATE

REPO = PACKAGE.parent
DOC = REPO / "docs" / "architecture.md"
SUFFIXES = (".py", ".yaml", ".yml", ".sh", ".md", ".txt", ".toml")


def _section(doc: str, title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", doc, flags=re.M | re.S)
    assert m is not None, f"docs/architecture.md has no section '## {title}'"
    return m.group(1)


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def layers_in(doc: str) -> list[tuple[str, ...]]:
    """The layers table: the backticked entries of each row's modules cell, rows in the page's order;
    the layer numbers must count up from 0."""
    rows = [line.split("|")[1:3] for line in _section(doc, "Layers").splitlines() if re.match(r"\|\s*\d", line)]
    numbers = [int(n) for n, _ in rows]
    assert numbers == list(range(len(rows))), f"layer numbers {numbers}"
    return [tuple(_ticked(cell)) for _, cell in rows]


def private_in(doc: str) -> dict[str, tuple[str, ...]]:
    """The private layers: `- `LAYER`: imported only by `A`, `B`, ...` lines of the layers section."""
    found = re.findall(r"^- `([\w.]+)`: imported only by ((?:`[\w.]+`,? ?)+)", _section(doc, "Layers"), re.M)
    return {layer: tuple(_ticked(importers)) for layer, importers in found}


def spans(doc: str) -> set[str]:
    return set(_ticked(re.sub(r"```.*?```", "", doc, flags=re.S)))


def modules(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module and subpackage of `package`: dotted name -> the spans that name it."""
    out: dict[str, set[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.name == "__init__.py" and rel.parent != Path("."):  # a subpackage: named as the package
            parts, paths = rel.parent.parts, [f"{rel.parent.as_posix()}/", rel.parent.as_posix()]
        else:
            parts, paths = rel.with_suffix("").parts, [rel.as_posix()]
        names = {".".join(parts), *paths, *(f"detaudit/{p}" for p in paths)}
        out[".".join(parts)] = names
    return out


def unnamed(doc: str, package: Path = PACKAGE) -> list[str]:
    named = spans(doc)
    return [mod for mod, names in modules(package).items() if not names & named]


def looks_like_path(span: str) -> bool:
    return " " not in span and ("/" in span or span.endswith(SUFFIXES)) and re.fullmatch(r"[\w./-]+", span) is not None


def missing_paths(doc: str, repo: Path = REPO) -> list[str]:
    bases = (repo, repo / "detaudit", repo / "tests")
    return sorted(s for s in spans(doc) if looks_like_path(s) and not any((b / s).exists() for b in bases))


def test_the_layers_table_is_LAYERS():
    assert layers_in(DOC.read_text()) == [tuple(layer) for layer in LAYERS]


def test_the_private_layers_are_PRIVATE():
    assert private_in(DOC.read_text()) == {k: tuple(v) for k, v in PRIVATE.items()}


def test_every_module_is_named():
    assert unnamed(DOC.read_text()) == []


def test_every_path_named_exists():
    assert missing_paths(DOC.read_text()) == []


BREAKAGES = {  # name: (text of the page, its replacement, the check that must see it)
    "order": ("`errors`, `paths`", "`paths`, `errors`", "layers"),  # two entries of a layer swapped
    "layer": ("| `inputs.suites`, `models`,", "| `models`, `inputs.suites`,", "layers"),  # same layer, other order
    "private": ("`backends.kernels`, `bench`.", "`backends.kernels`.", "private"),  # an importer dropped
    "module": ("`server/hooks.py`", "hooks", "named"),  # a module of the package left off the page
    "fake": ("`tools/vllm_bundle.py` |", "`tools/vllm_bundle.py`, `backends/kernels/fake.py` |", "paths"),
}


@pytest.mark.parametrize("name", BREAKAGES)
def test_each_check_catches_a_broken_page(name):
    """The checks above find each kind of drift (so they cannot pass vacuously)."""
    old, new, check = BREAKAGES[name]
    doc = DOC.read_text()
    assert doc.count(old) == 1, f"{old!r} is no longer on the page once: update this breakage"
    bad = doc.replace(old, new)
    if check == "layers":
        assert layers_in(bad) != [tuple(layer) for layer in LAYERS]
    elif check == "private":
        assert private_in(bad) != {k: tuple(v) for k, v in PRIVATE.items()}
    elif check == "named":
        assert unnamed(bad) == ["server.hooks"]
    else:
        assert missing_paths(bad) == ["backends/kernels/fake.py"]


def test_a_module_new_to_the_package_must_be_named(tmp_path):
    pkg = tmp_path / "detaudit"
    (pkg / "runs").mkdir(parents=True)
    for f in ("__init__.py", "errors.py", "runs/__init__.py", "runs/records.py", "runs/extra.py"):
        (pkg / f).write_text("")
    doc = "`__init__`, `errors`, `runs/`, `runs.records`"
    assert unnamed(doc, pkg) == ["runs.extra"]
