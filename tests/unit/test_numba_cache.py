"""numba's caches of the compiled kernels follow every kernel module's source, not only the caller's own
file (`numba_cache`: a caller's cached code holds what it inlined from the others)."""

from __future__ import annotations

from helpers import require

from detaudit.backends.kernels import numba_cache


def _caches(folder):
    return sorted(p.name for p in (folder / "__pycache__").glob("*.nb*"))


def test_a_changed_callee_removes_every_kernel_cache(tmp_path):
    (tmp_path / "callee.py").write_text("x = 1\n")
    (tmp_path / "caller.py").write_text("y = 2\n")
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    names = ["caller.f-1.py312.nbi", "caller.f-1.py312.1.nbc", "callee.g-3.py312.nbi", "other.h-1.py312.nbi"]
    for name in names:
        (cache / name).write_bytes(b"")
    modules = ("callee", "caller")
    assert numba_cache.refresh(tmp_path, modules)  # no stamp yet: the caches may be from any source
    assert _caches(tmp_path) == ["other.h-1.py312.nbi"]  # a module not named is left alone
    (cache / names[0]).write_bytes(b"")  # numba caches again
    assert not numba_cache.refresh(tmp_path, modules)  # same sources: kept
    assert _caches(tmp_path) == [names[0], "other.h-1.py312.nbi"]
    (tmp_path / "callee.py").write_text("x = 3\n")  # only the callee changes
    assert numba_cache.refresh(tmp_path, modules)
    assert _caches(tmp_path) == ["other.h-1.py312.nbi"]


def test_every_compiled_kernel_module_is_covered():
    """Each module that numba compiles refreshes the caches as it is imported, and is in the digest."""
    from pathlib import Path

    folder = Path(numba_cache.__file__).parent
    compiled = {p.stem for p in folder.glob("*.py") if "numba.njit" in p.read_text() or "@intrinsic" in p.read_text()}
    assert compiled == set(numba_cache.COMPILED)
    for name in compiled:
        source = (folder / f"{name}.py").read_text()
        assert "numba_cache.fresh()" in source, name
        if "numba.njit" in source:  # its dispatchers behind the compile lock, every one defined above it
            assert source.rstrip().splitlines()[-1].startswith("numba_cache.one_compiler(globals())"), name


KERNEL = """
import numba

from detaudit.backends.kernels import numba_cache


@numba.njit(cache=True)
def total(x):
    s = 0.0
    for v in x:
        s += v * v + 1.0
    return s


numba_cache.one_compiler(globals())
"""


def _compile_after(barrier, folder, queue):
    """Import the kernel module in `folder`, wait for every process, call it; report cache misses/hits."""
    import sys

    import numpy as np

    sys.path.insert(0, str(folder))
    import lock_kernel

    barrier.wait()
    lock_kernel.total(np.ones(4))
    stats = lock_kernel.total.stats
    queue.put((sum(stats.cache_misses.values()), sum(stats.cache_hits.values())))


def test_processes_starting_together_compile_a_kernel_once(tmp_path):
    """TP ranks start together on a fresh install: one compiles and saves, the others load its cache."""
    import multiprocessing as mp

    require("numba", "cpu")
    (tmp_path / "lock_kernel.py").write_text(KERNEL)
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(3), ctx.Queue()
    procs = [ctx.Process(target=_compile_after, args=(barrier, tmp_path, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    got = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=30)
    assert got == [(0, 1), (0, 1), (1, 0)], got  # one miss (the compile) and two loads


NOTICE = """
import sys
import types
from numba.core import event
from detaudit.backends.kernels import numba_cache

numba_cache._announce_compiles()
def compile_of(module):
    disp = types.SimpleNamespace(py_func=types.SimpleNamespace(__module__=module))
    event.start_event("numba:compile", data={"dispatcher": disp})
    event.end_event("numba:compile", data={"dispatcher": disp})
compile_of("someone_elses.kernels")
print("after another package's compile", file=sys.stderr, flush=True)
compile_of("detaudit.backends.kernels.cpu_rows")
compile_of("detaudit.backends.kernels.cpu_team")
"""


def test_the_first_kernel_compile_of_a_process_says_so_once():
    """A fresh install's first run compiles for about a minute: one line on stderr at the first compile of
    a detaudit kernel, none for another package's numba function, none again after."""
    import subprocess
    import sys

    require("numba", "cpu")
    done = subprocess.run([sys.executable, "-c", NOTICE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines == ["after another package's compile", numba_cache.NOTE], done.stderr
