"""Where a suite file may read (suite files are untrusted, shared like data).

Every path a task file names (`include:`, `dataset_kwargs.data_files` / `data_dir`, a local
`dataset_path`) must resolve, symlinks included, inside the directory of the YAML file the user named;
URLs only as `hf://`, `https://`, `http://` (no `file://`, no fsspec `::` chains). `--trust-suite-paths`
lifts this (the manifest records it): then the file reads what it names, as lm-eval does.

A `data_files` pattern is expanded here, bounded whatever the trust: only below its leading part without
glob characters, which must itself lie in the suite's directory unless trusted (`/**/x*.jsonl` is refused
before anything is walked), without entering a symlinked directory under `**` (no cycles), and visiting at
most MAX_GLOB_ENTRIES directory entries.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from detaudit.errors import DetauditError

PACKAGED_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "xml", "sql", "webdataset")
REMOTE_SCHEMES = ("hf://", "https://", "http://")
TRUST_FLAG = "--trust-suite-paths"
# dataset_kwargs that select data; anything else (cache_dir, download_mode, storage_options, token, ...)
# would make `datasets.load_dataset` write, read or authenticate somewhere the suite chooses
MAX_GLOB_ENTRIES = 100_000  # directory entries a `data_files` pattern or a `data_dir` may make detaudit visit
DATASET_KWARGS = ("data_files", "data_dir", "name", "revision", "field", "sep", "delimiter", "column_names")


@dataclass(frozen=True)
class Scope:
    """Where a suite file may read: the directory of the YAML file the user named (symlinks resolved), and
    `hf://` / `https://` / `http://` URLs. `--trust-suite-paths` (recorded in the manifest) lifts it:
    then `include:`, `data_files`, `data_dir` and `dataset_path` read what they name, as lm-eval does."""

    root: Path
    trusted: bool = False

    def _refuse(self, where: Path, what: str, why: str) -> DetauditError:
        return DetauditError(f"{where}: {what} {why} (pass {TRUST_FLAG} to let suite files read anywhere)")

    def local(self, path: Path, what: str, where: Path) -> Path:
        resolved = path.expanduser().resolve()
        if not self.trusted and not resolved.is_relative_to(self.root):
            raise self._refuse(where, what, f"resolves to {resolved}, outside the suite's directory {self.root}")
        return resolved

    def url(self, url: str, what: str, where: Path) -> str:
        if not self.trusted and ("::" in url or not url.startswith(REMOTE_SCHEMES)):
            raise self._refuse(where, what, f"is refused: only {', '.join(REMOTE_SCHEMES)} URLs are read")
        return url

    def in_repo(self, item: str, what: str, where: Path) -> str:
        """A path inside a hub dataset's repository (`datasets` would read an absolute one locally)."""
        parts = PurePosixPath(item).parts
        if not self.trusted and (item.startswith(("/", "~", "\\")) or ".." in parts or "\\" in item):
            raise self._refuse(where, what, "must be a relative path inside the dataset's repository")
        return item


def _split_magic(path: Path) -> tuple[Path, list[str]]:
    """(the longest leading part of `path` without glob characters, the pattern's remaining components)."""
    parts = path.parts
    for i, part in enumerate(parts):
        if glob.has_magic(part):
            return Path(*parts[:i]), list(parts[i:])
    return path, []


def _matches(name: str, pattern: str) -> bool:
    """glob's rule for one component: `*` and `?` do not match a leading dot."""
    return (pattern.startswith(".") or not name.startswith(".")) and fnmatch.fnmatchcase(name, pattern)


def _entries(directory: Path, counter: list[int], what: str, where: Path) -> list[os.DirEntry]:
    try:
        with os.scandir(directory) as it:
            entries = list(it)
    except OSError:
        return []  # unreadable or gone: glob skips it too
    counter[0] += len(entries)
    if counter[0] > MAX_GLOB_ENTRIES:
        raise DetauditError(
            f"{where}: {what} visits more than {MAX_GLOB_ENTRIES} directory entries; name the files more narrowly"
        )
    return entries


def bounded_glob(pattern: Path, what: str, where: Path) -> list[Path]:
    """The files matching `pattern` (glob's syntax, `**` for any number of directories), found without
    following a symlinked directory under `**` (a link to its own parent would be a cycle) and visiting at
    most MAX_GLOB_ENTRIES directory entries (a pattern rooted at `/` would walk the whole machine)."""
    base, rest = _split_magic(pattern)
    counter = [0]
    found: set[Path] = set()
    seen: set[tuple[Path, int]] = set()
    stack = [(base, 0)]
    while stack:
        directory, i = stack.pop()
        if (directory, i) in seen:
            continue
        seen.add((directory, i))
        if i == len(rest):
            if directory.is_file():
                found.add(directory)
            continue
        part = rest[i]
        if part == "**":
            stack.append((directory, i + 1))  # no directory at all
            for e in _entries(directory, counter, what, where):
                if e.name.startswith("."):
                    continue
                if e.is_dir(follow_symlinks=False):
                    stack.append((directory / e.name, i))
                elif i + 1 == len(rest):  # a final `**` matches files too
                    stack.append((directory / e.name, i + 1))
        elif glob.has_magic(part):
            for e in _entries(directory, counter, what, where):
                if _matches(e.name, part):
                    stack.append((directory / e.name, i + 1))
        elif (directory / part).exists():
            stack.append((directory / part, i + 1))
    return sorted(found)


def bounded_walk(root: Path, what: str, where: Path) -> list[Path]:
    """Every entry under `root`, symlinked directories listed but not entered; at most MAX_GLOB_ENTRIES."""
    counter, out, stack = [0], [], [root]
    while stack:
        directory = stack.pop()
        for e in _entries(directory, counter, what, where):
            out.append(directory / e.name)
            if e.is_dir(follow_symlinks=False):
                stack.append(directory / e.name)
    return sorted(out)


def _local_files(item: str, base: Path, scope: Scope, what: str, where: Path) -> list[str]:
    p = Path(item).expanduser()
    p = p if p.is_absolute() else base / p
    if glob.has_magic(str(p)):
        root, _ = _split_magic(p)
        scope.local(root, what, where)  # a pattern reaching out of the suite's directory is never walked
        matches = [str(m) for m in bounded_glob(p, what, where)]
    else:
        matches = [str(p)] if p.is_file() else []
    if not matches:
        raise DetauditError(
            f"{where}: `dataset_kwargs.data_files` names no existing file ({item}; relative names are read "
            "from the YAML's directory)"
        )
    return [str(scope.local(Path(m), what, where)) for m in matches]


def resolve_data_files(value: object, base: Path, local: bool, scope: Scope, where: Path) -> dict[str, list[str]]:
    """`data_files` as {split: [entries]} (a string or a list is datasets' `train` split). For a packaged
    builder (json, csv, ...) local entries are relative to the YAML that names them, their globs are
    expanded here and every file must lie in the suite's scope; for a hub dataset they are paths inside
    its repository."""
    if isinstance(value, dict):
        splits = {str(k): (v if isinstance(v, list) else [v]) for k, v in value.items()}
    else:
        splits = {"train": value if isinstance(value, list) else [value]}
    out: dict[str, list[str]] = {}
    for split, items in splits.items():
        out[split] = []
        for item in items:
            if not isinstance(item, str) or not item:
                raise DetauditError(f"{where}: `dataset_kwargs.data_files` entries must be file names (got {item!r})")
            what = f"`dataset_kwargs.data_files` entry {item!r}"
            if "://" in item or "::" in item:
                out[split].append(scope.url(item, what, where))
            elif local:
                out[split] += _local_files(item, base, scope, what, where)
            else:
                out[split].append(scope.in_repo(item, what, where))
    return out


def resolve_data_dir(value: object, base: Path, local: bool, scope: Scope, where: Path) -> str:
    what = f"`dataset_kwargs.data_dir: {value}`"
    if not isinstance(value, str) or not value:
        raise DetauditError(f"{where}: `dataset_kwargs.data_dir` must be a directory name (got {value!r})")
    if "://" in value or "::" in value:
        return scope.url(value, what, where)
    if not local:
        return scope.in_repo(value, what, where)
    d = Path(value).expanduser()
    d = d if d.is_absolute() else base / d
    if not d.is_dir():
        raise DetauditError(f"{where}: {what} names no directory ({d})")
    resolved = scope.local(d, what, where)
    for f in bounded_walk(resolved, what, where):  # a symlink inside the directory may point anywhere
        scope.local(f, f"{what} (its entry {f.relative_to(resolved)})", where)
    return str(resolved)


def check_dataset_path(value: str, scope: Scope, where: Path) -> None:
    """A hub id, not a local path: `datasets.load_dataset` reads an existing path (relative to the working
    directory) as a local dataset."""
    if value in PACKAGED_BUILDERS or scope.trusted:
        return
    if value.startswith(("/", ".", "~")) or "\\" in value or ".." in value.split("/") or "://" in value:
        local = True
    else:
        local = Path(value).exists()
    if local:
        raise DetauditError(
            f"{where}: `dataset_path: {value}` names a local path, which `datasets` would read; name a hub "
            f"dataset, or use `dataset_path: json` (csv, parquet) with `dataset_kwargs.data_files` beside the "
            f"YAML (or pass {TRUST_FLAG})"
        )
