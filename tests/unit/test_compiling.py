"""`detaudit.compiling`: the count of compile spans the hang timers read, and its notices."""

from __future__ import annotations

import pytest

from detaudit import compiling


@pytest.fixture
def heard(monkeypatch):
    monkeypatch.setattr(compiling, "_listeners", [])
    monkeypatch.setattr(compiling, "_depth", 0)
    got: list[bool] = []
    compiling.listen(got.append)
    return got


def test_nested_spans_are_one_notice_each_way(heard):
    compiling.begin()
    compiling.begin()  # a kernel's compile compiling a kernel it calls
    assert compiling.active() and heard == [True]
    compiling.end()
    assert compiling.active() and heard == [True]
    compiling.end()
    assert not compiling.active() and heard == [True, False]
    with pytest.raises(RuntimeError):
        compiling.end()


def test_a_notice_that_cannot_be_delivered_leaves_the_count_balanced(heard):
    def gone(on: bool) -> None:
        raise BrokenPipeError("the controller went away")

    compiling.listen(gone)
    compiling.begin()
    compiling.end()
    assert not compiling.active() and heard == [True, False]


def test_numba_cache_compiles_count_as_compiling(monkeypatch, heard, tmp_path):
    """`one_compiler`'s wrapper spans the lock's wait and the compile, and ends the span when the compile
    raises."""
    from detaudit.backends.kernels import numba_cache

    monkeypatch.setattr(numba_cache, "_compile_lock", lambda: __import__("filelock").FileLock(tmp_path / "l"))
    seen = []

    def compile_fn(sig):
        seen.append(compiling.active())
        if sig == "bad":
            raise TypeError(sig)
        return sig

    wrapped = numba_cache._locked(compile_fn)
    assert wrapped("ok") == "ok"
    with pytest.raises(TypeError):
        wrapped("bad")
    assert seen == [True, True] and not compiling.active() and heard == [True, False, True, False]
