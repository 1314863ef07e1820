"""Where detaudit keeps its cache (prepared models), its built-in suites and where the suite mirror lives."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs


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
