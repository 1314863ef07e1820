"""Where detaudit keeps its cache (prepared models), its built-in suites and where the suite mirror lives;
output paths as given, checked before anything is created."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

from detaudit.errors import DetauditError


def home() -> Path:
    """`DETAUDIT_HOME`, or the user's cache dir (e.g. ~/.cache/detaudit)."""
    env = os.environ.get("DETAUDIT_HOME")
    return Path(env).expanduser() if env else Path(platformdirs.user_cache_dir("detaudit"))


def models_dir() -> Path:
    return home() / "models"


def builtin_suites_dir() -> Path:
    """The built-in suite YAML files. They live in the repository's `suites/`; a wheel ships that folder
    as `detaudit/builtin_suites/` (setup.py maps it), found through `importlib.resources`. A source
    checkout (editable install, PYTHONPATH) has no such folder inside the package and reads `suites/`
    beside it."""
    from importlib.resources import files

    packaged = files("detaudit").joinpath("builtin_suites")
    if packaged.is_dir():
        return Path(str(packaged))
    return Path(__file__).resolve().parent.parent / "suites"


def data_dir(explicit: str | os.PathLike | None = None) -> Path | None:
    """The local suite mirror: `--data-dir`, else `DETAUDIT_DATA_DIR`, else None (use the hub)."""
    value = explicit or os.environ.get("DETAUDIT_DATA_DIR")
    return Path(value).expanduser() if value else None


def check_output_path(text: str | os.PathLike) -> Path:
    """An output path as given, checked before anything is created: not empty (typer reads '' as '.',
    the working directory), no NUL byte, and no name longer than its filesystem takes (NAME_MAX, found
    from the nearest existing directory), so a path that cannot be created is refused up front."""
    raw = os.fspath(text)
    if not str(raw).strip():
        raise DetauditError("is empty (give a path; '.' is the working directory)")
    if "\0" in str(raw):
        raise DetauditError("holds a NUL byte")
    path = Path(raw)
    here = next((p for p in path.absolute().parents if os.path.isdir(p)), Path("/"))
    try:
        name_max = os.pathconf(here, "PC_NAME_MAX")
    except (OSError, ValueError):
        name_max = 255
    for part in path.parts:
        if len(os.fsencode(part)) > name_max:
            raise DetauditError(
                f"the name {part[:24]!r}... is {len(os.fsencode(part))} bytes long; the filesystem takes at "
                f"most {name_max}"
            )
    return path
