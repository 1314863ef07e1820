"""numba's caches of the compiled kernels follow every kernel module's source, not only the caller's own
file (`numba_cache`: a caller's cached code holds what it inlined from the others)."""

from __future__ import annotations

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
        assert "numba_cache.fresh()" in (folder / f"{name}.py").read_text(), name
