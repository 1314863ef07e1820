"""Backend registry: "bf16" (native), "bio" (batch-invariant ops), "bio+tbik" (tree-based invariant
row-parallel layers). Built-in backends register on import; third-party ones come from the
`detaudit.backends` entry-point group."""

from __future__ import annotations

import os
from importlib import metadata
from typing import Callable

from detaudit.backends.base import Backend, ProcessGroup
from detaudit.errors import DetauditError

BACKENDS: dict[str, Callable[[], Backend]] = {}
_entry_points_loaded = False


def register_backend(*names: str):
    def deco(factory):
        for name in names:
            BACKENDS[name] = factory
        return factory

    return deco


def _load_builtin() -> None:
    from detaudit.backends import bio, native, tbik  # noqa: F401 (they register on import)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded or os.environ.get("DETAUDIT_NO_PLUGINS"):  # tests: built-in backends only
        return
    _entry_points_loaded = True
    for ep in metadata.entry_points(group="detaudit.backends"):
        ep.load()


def available() -> list[str]:
    _load_builtin()
    _load_entry_points()
    return sorted(BACKENDS)


def get_backend(name: str) -> Backend:
    names = available()
    if name not in BACKENDS:
        raise DetauditError(f"unknown backend {name!r}; known backends: {', '.join(names)}")
    backend = BACKENDS[name]()
    if not isinstance(backend, Backend):  # a plugin written against the old protocol: abilities unknown
        raise DetauditError(f"backend {name!r} does not subclass detaudit.backends.Backend (the backend contract)")
    return backend


def check_backends(names, option: str = "--backends", native: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every name registered (or in `native`: backends an engine computes with its own kernels, checked
    per engine by `engines.check_engine_backends`) and none twice: refused before any model work."""
    known = available() + [n for n in native if n not in BACKENDS]
    for name in names:
        if name not in known:
            raise DetauditError(f"unknown backend {str(name)[:40]!r}; known backends: {', '.join(known)}")
    if len(set(names)) != len(names):
        raise DetauditError(f"{option} lists a value twice: {', '.join(names)}")
    return tuple(names)


def describe_machine() -> dict[str, str]:
    """How this machine's CPU runs the invariant backends' products and row kernels, and why (for
    `doctor`): the product path (`cpu_gemm`) and whether the compiled kernels run (`cpu_kernels`)."""
    from detaudit.backends.kernels import fixed

    d = fixed.describe_cpu()
    return {"cpu_gemm": d["cpu_gemm"], "cpu_kernels": d["cpu_kernels"]}


__all__ = [
    "Backend",
    "ProcessGroup",
    "BACKENDS",
    "register_backend",
    "get_backend",
    "available",
    "check_backends",
    "describe_machine",
]
