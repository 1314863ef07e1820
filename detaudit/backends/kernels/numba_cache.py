"""Keeps numba's on-disk caches of the compiled CPU kernels true to the sources beside them.

numba checks a cached function against its own source file only (its modification time and size), but
a kernel's cached machine code also holds what it inlined from other modules: `cpu_team` runs
`cpu_loop`'s, `cpu_attention`'s and `cpu_rows`' kernels, `cpu_attention` inlines `cpu_lanes`'
intrinsics. Editing one of those in a checkout left the callers running the old code from the cache.
Here a digest of every kernel module's source is kept beside the caches, and when it changes the
caches of all of them are removed before any is loaded (numba then compiles afresh and caches again).
An installed wheel replaces every file together, so this matters in checkouts. Not covered: caches numba
keeps elsewhere (`NUMBA_CACHE_DIR`, or its user-wide folder where `__pycache__` cannot be written), and a
process that imported the old sources and saves a cache after another has refreshed (restart it).

`one_compiler` makes the processes of one machine compile a kernel one at a time: the TP ranks of a
fresh install start together and each found no cache, so all compiled every kernel at once (a real
TP-8 bio run on a 2-core VM: 126 s, 15 s with the caches in place). Behind a file lock the first
compiles and saves; the others wait, then load its cache. The first compile of a process says so in one
line on stderr (a fresh install's first run otherwise sits silent for a minute). No numba import at
this module's import."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
import tempfile
from pathlib import Path

import filelock

from detaudit import compiling

STAMP = "detaudit-kernels.sha256"
LOCK = "detaudit-kernels.lock"
COMPILED = ("cpu_lanes", "cpu_attention", "cpu_rows", "cpu_loop", "cpu_team")  # every module numba compiles


@functools.cache
def fresh() -> None:
    """`refresh` of this package's compiled modules, once a process: each of them calls it as it is
    imported, before numba loads any cache (at a kernel's first call)."""
    refresh(Path(__file__).parent, COMPILED)


def refresh(folder: Path, modules: tuple[str, ...]) -> bool:
    """Remove the numba caches (`__pycache__/<module>.*.nbi|nbc`) of `modules` in `folder` where the
    digest of their sources differs from the one recorded there, then record it. True when removed."""
    digest = hashlib.sha256()
    for name in modules:
        digest.update(name.encode() + b"\0" + (folder / f"{name}.py").read_bytes())
    cache = folder / "__pycache__"
    stamp = cache / STAMP
    want = digest.hexdigest()
    try:
        if stamp.read_text() == want:
            return False
    except OSError:
        pass
    try:
        for name in modules:
            for path in (*cache.glob(f"{name}.*.nbi"), *cache.glob(f"{name}.*.nbc")):
                path.unlink(missing_ok=True)
        cache.mkdir(exist_ok=True)
        stamp.write_text(want)
    except OSError:
        return False
    return True


@functools.cache
def _compile_lock() -> filelock.FileLock:
    """The machine-wide lock around a compile: beside the caches, or in the temporary folder where the
    package's `__pycache__` cannot be written (numba then caches in its user-wide folder)."""
    cache = Path(__file__).parent / "__pycache__"
    if not os.access(cache, os.W_OK):
        cache = Path(tempfile.gettempdir())
    # re-entrant within a thread: compiling a kernel compiles the kernels it calls, under the same lock
    return filelock.FileLock(cache / f"{LOCK}.{os.getuid() if hasattr(os, 'getuid') else 0}")


def one_compiler(namespace: dict) -> None:
    """Put each numba dispatcher in `namespace` (a compiled module's globals, after its definitions)
    behind the machine-wide compile lock. numba compiles a dispatcher for new argument types through its
    `compile` method, which first loads the on-disk cache: under the lock a process that waited finds
    the cache the first one saved. Calls of types already compiled never reach `compile`, so a running
    kernel never waits. Meanwhile `detaudit.compiling` says a compile is under way (the hang timers give
    it the engine start's allowance). The lock is always taken before numba's own compiler lock, so it
    cannot deadlock with it (no other code compiles these dispatchers)."""
    _announce_compiles()
    for obj in list(namespace.values()):
        py_func = getattr(obj, "py_func", None)  # a dispatcher's; only this module's (not those it imported)
        if getattr(py_func, "__module__", None) == namespace["__name__"] and hasattr(obj, "overloads"):
            obj.compile = _locked(obj.compile)


def _locked(compile_fn):
    @functools.wraps(compile_fn)
    def compile_one_at_a_time(sig):
        compiling.begin()  # the wait for the lock too: another process's compile is not this one's hang
        try:
            with _compile_lock():
                return compile_fn(sig)
        finally:
            compiling.end()

    return compile_one_at_a_time


NOTE = "detaudit: compiling the CPU kernels (numba; first use, about two minutes on 2 cores; cached for later runs)"


@functools.cache
def _announce_compiles() -> None:
    """One line on stderr at the first compile of a detaudit kernel in this process (numba's compile event
    fires for a compile, not for a cache load; other packages' numba functions are not ours to announce)."""
    from numba.core import event

    class Note(event.Listener):
        said = False

        def on_start(self, ev) -> None:
            module = getattr(getattr(ev.data.get("dispatcher"), "py_func", None), "__module__", "") or ""
            if not self.said and module.startswith("detaudit."):
                self.said = True
                print(NOTE, file=sys.stderr, flush=True)

        def on_end(self, ev) -> None:
            pass

    event.register("numba:compile", Note())
