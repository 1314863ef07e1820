"""Run directories are untrusted input (they are committed, shared and merged): path-like cell ids,
type-corrupted manifests, a cell file of another cell, and merge's own writes.
Every case exits 2 with one line and no traceback, and nothing outside the output directory is touched."""

from __future__ import annotations

import json
import resource
import shutil
import signal
import subprocess
import sys

import pytest
from helpers import one_line_error
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner
from unit.test_analyze import TBIK, invariant_cells, make_run

from detaudit.cli import app

runner = CliRunner()


@pytest.fixture
def run(tmp_path):
    return make_run(tmp_path / "run", invariant_cells(), backends=("bio+tbik",))


def _manifest(run):
    return json.loads((run / "manifest.json").read_text())


def _write(run, m):
    (run / "manifest.json").write_text(json.dumps(m))


def test_merge_and_analyze_refuse_path_like_cell_ids(run, tmp_path):
    """A manifest listing cell `../../x` with a matching Parquet file: refused, nothing written outside OUT."""
    m = _manifest(run)
    evil = "../../x"
    m["cells"][evil] = m["cells"][TBIK[1]]
    _write(run, m)
    (run / "cells" / "x.parquet").write_bytes((run / "cells" / f"{TBIK[1]}.parquet").read_bytes())
    out = tmp_path / "deep" / "er" / "out"
    for args in (
        ["merge", str(run), "-o", str(out)],
        ["analyze", str(run)],
        ["gate", str(run)],
        ["report", str(run), "-o", str(tmp_path / "rep")],
    ):
        one_line_error(runner.invoke(app, args), "not a detaudit cell id")
    assert not out.exists() and not (tmp_path / "deep" / "x.parquet").exists()
    assert list(tmp_path.rglob("x*.parquet*")) == [run / "cells" / "x.parquet"]  # only the one planted


def test_cell_file_of_another_cell_is_a_corrupt_cell(run, tmp_path):
    """bio+tbik tp1 copied over tp2: every reader says so instead of counting it."""
    a, b = (run / "cells" / f"{c}.parquet" for c in (TBIK[1], TBIK[2]))
    b.write_bytes(a.read_bytes())
    for args in (["analyze", str(run)], ["gate", str(run)], ["report", str(run)]):
        one_line_error(runner.invoke(app, args), "is corrupt: it holds cell")
    res = runner.invoke(app, ["merge", str(run), "-o", str(tmp_path / "m")])  # merge keeps it out of "done"
    assert res.exit_code == 0, res.output
    merged = json.loads((tmp_path / "m" / "manifest.json").read_text())
    assert merged["cells"][TBIK[2]]["state"] == "pending" and "corrupt" in merged["cells"][TBIK[2]]["error"]
    assert not (tmp_path / "m" / "cells" / f"{TBIK[2]}.parquet").exists()


def test_merge_of_a_garbage_cell_does_not_record_it_done(run, tmp_path):
    (run / "cells" / f"{TBIK[2]}.parquet").write_bytes(b"PAR1 garbage")
    res = runner.invoke(app, ["merge", str(run), "-o", str(tmp_path / "m")])
    assert res.exit_code == 0, res.output
    assert "1 done" in res.output
    assert json.loads((tmp_path / "m" / "manifest.json").read_text())["cells"][TBIK[2]]["state"] == "pending"


def test_merge_on_a_full_disk_leaves_the_output_as_it_was(run, tmp_path):
    """A real write failure (RLIMIT_FSIZE: files cannot grow past 1 KiB): one line, exit 2, no OUT."""
    out = tmp_path / "m"

    def limit():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))

    proc = subprocess.run(
        [sys.executable, "-c", "from detaudit.cli import main; main()", "merge", str(run), "-o", str(out)],
        capture_output=True,
        text=True,
        preexec_fn=limit,
    )
    assert proc.returncode == 2, proc.stderr
    assert "cannot write" in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["run"]


# ---- type fuzzing: any field of the manifest replaced by a value of another type
VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 3),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.floats(allow_nan=True),
)


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))


@pytest.fixture(scope="module")
def fuzz_base(tmp_path_factory):
    return make_run(tmp_path_factory.mktemp("fuzz") / "run", invariant_cells(), backends=("bio+tbik",))


@pytest.mark.slow  # 60 examples x 3 commands
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_type_fuzzed_manifest_never_gives_a_traceback(fuzz_base, tmp_path_factory, data):
    base = json.loads((fuzz_base / "manifest.json").read_text())
    paths = [p for p in _paths(base) if p and p[0] not in ("environment", "environment_history", "updated", "created")]
    path = data.draw(st.sampled_from(paths))
    value = data.draw(VALUES)
    m = json.loads(json.dumps(base))
    node = m
    for k in path[:-1]:
        node = node[k]
    node[path[-1]] = value
    run = tmp_path_factory.mktemp("f") / "run"
    shutil.copytree(fuzz_base, run)
    _write(run, m)
    for args in (["analyze", str(run)], ["gate", str(run)], ["merge", str(run), "-o", str(run.parent / "m")]):
        res = runner.invoke(app, args)
        assert res.exception is None or isinstance(res.exception, SystemExit), (path, value, res.output)
        assert "Traceback" not in res.output, (path, value)
        assert res.exit_code in (0, 1, 2), (path, value, res.output)
        if res.exit_code == 2:
            assert len([line for line in res.output.splitlines() if line.strip()]) <= 2, res.output
