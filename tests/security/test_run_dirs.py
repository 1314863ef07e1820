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
from detaudit.errors import DetauditError

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


@pytest.mark.slow  # a detaudit process with a file-size limit
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


# ---- a cell's coordinates come from its id


@pytest.mark.parametrize(
    "field, value",
    [("backend", "nope"), ("tp", 3), ("tp", 2), ("batch_size", -1), ("suite", "other"), ("engine", "vllm")],
)
def test_a_cell_contradicting_its_id_is_refused_everywhere(run, tmp_path, field, value):
    """Before: `tp: 3` under `..__tp1__..` passed validation, analyze dropped the cell from its backend,
    the gate passed on fewer cells and merge copied the values. Now every reader refuses the manifest."""
    m = _manifest(run)
    m["cells"][TBIK[1]][field] = value
    _write(run, m)
    for args in (
        ["analyze", str(run)],
        ["gate", str(run)],
        ["report", str(run), "-o", str(tmp_path / "rep")],
        ["merge", str(run), "-o", str(tmp_path / "m")],
        ["diff", str(run), str(run)],
    ):
        res = runner.invoke(app, args)
        one_line_error(res, TBIK[1])
        assert "not the cell its id names" in res.output or "engine" in res.output
    assert not (tmp_path / "m").exists() and not (tmp_path / "rep").exists()


def test_a_cell_outside_the_configured_grid_is_refused(run):
    m = _manifest(run)
    m["cells"]["smoke__bio-tbik__tp4__bs1"] = {**m["cells"][TBIK[1]], "tp": 4}
    _write(run, m)
    one_line_error(runner.invoke(app, ["gate", str(run)]), "is not in the configured grid")


def test_a_configured_grid_out_of_range_is_refused(run):
    m = _manifest(run)
    m["config"]["tp"] = [1, 2, 3]
    _write(run, m)
    one_line_error(runner.invoke(app, ["analyze", str(run)]), "TP size must be one of 1, 2, 4, 8")


# ---- JSON that parses into something no detaudit file holds


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"cells": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested deeper than any detaudit file"),
        ('{"cells": {}, "config": {}, "x": ' + "[" * 40 + "]" * 40 + "}", "nested more than 32 levels"),
        ('{"cells": {}, "config": {"limit": ' + "9" * 5000 + "}}", "Exceeds the limit (4300 digits)"),
        ('{"cells": {}, "config": {}, "command": "\\ud800"}', "lone surrogate"),
    ],
    ids=["nesting-bomb", "nested-40", "int-5000-digits", "lone-surrogate"],
)
def test_json_bombs_are_one_line(run, tmp_path, text, message):
    (run / "manifest.json").write_text(text)
    for args in (
        ["analyze", str(run)],
        ["gate", str(run)],
        ["report", str(run)],
        ["merge", str(run), "-o", str(tmp_path / "m")],
        ["diff", str(run), str(run)],
    ):
        one_line_error(runner.invoke(app, args), message)


def test_huge_integers_that_parse_are_refused_by_value(run):
    m = _manifest(run)
    m["cells"][TBIK[1]]["wall_s"] = 10**4000  # parses (under 4300 digits), overflows float()
    _write(run, m)
    one_line_error(runner.invoke(app, ["gate", str(run)]), "a finite number of seconds")


# ---- symlinks never redirect a read or a write outside the run directory


def _link_cells_outside(run, tmp_path):
    outside = tmp_path / "outside"
    shutil.move(str(run / "cells"), outside)
    (run / "cells").symlink_to(outside)
    return outside


def test_a_symlinked_cells_directory_is_refused_for_reads_and_writes(run, tmp_path):
    from detaudit.runs.rundir import RunDir

    outside = _link_cells_outside(run, tmp_path)
    before = sorted(p.name for p in outside.iterdir())
    for args in (["analyze", str(run)], ["gate", str(run)], ["merge", str(run), "-o", str(tmp_path / "m")]):
        one_line_error(runner.invoke(app, args), "resolves outside the run directory")
    rd = RunDir(run)
    with pytest.raises(DetauditError, match="resolves outside"):
        with rd.locked():
            pass
    with pytest.raises(DetauditError, match="resolves outside"):
        rd.write_cell_bytes(TBIK[1], b"x")
    assert sorted(p.name for p in outside.iterdir()) == before


def test_a_resumed_sweep_refuses_a_symlinked_cells_directory_before_any_work(run, tmp_path, monkeypatch):
    """The sweep into a run directory whose cells/ points elsewhere: refused before the model is read."""
    import detaudit.models

    outside = _link_cells_outside(run, tmp_path)
    before = {p.name: p.read_bytes() for p in outside.iterdir()}

    def no_model_work(*args, **kwargs):
        raise AssertionError("model work started")

    monkeypatch.setattr(detaudit.models, "resolve_model", no_model_work)
    args = ["sweep", "--suites", "smoke", "--backends", "bio+tbik", "--tp", "1,2", "--batch-sizes", "1", "-o", str(run)]
    one_line_error(runner.invoke(app, args), "resolves outside the run directory")
    assert {p.name: p.read_bytes() for p in outside.iterdir()} == before


def test_a_symlinked_cell_file_is_refused(run, tmp_path):
    cell = run / "cells" / f"{TBIK[1]}.parquet"
    target = tmp_path / "elsewhere.parquet"
    shutil.move(str(cell), target)
    cell.symlink_to(target)
    one_line_error(runner.invoke(app, ["analyze", str(run)]), "resolves outside the run directory")


def test_a_symlinked_lock_file_is_never_truncated(run, tmp_path):
    from detaudit.runs.rundir import RunDir

    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(victim)
    with pytest.raises(DetauditError):
        with RunDir(run).locked():
            pass
    assert victim.read_text() == "precious\n"


# ---- merge's own paths


def test_merge_refuses_a_run_given_twice(run, tmp_path):
    one_line_error(
        runner.invoke(app, ["merge", str(run), str(tmp_path / "run" / "."), "-o", str(tmp_path / "m")]),
        "is given twice",
    )
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("inside", ["cells/sub", "sub", "."])
def test_merge_refuses_an_output_inside_an_input(run, inside):
    before = sorted(p.name for p in run.rglob("*"))
    one_line_error(runner.invoke(app, ["merge", str(run), "-o", str(run / inside)]), "lies inside the input run")
    assert sorted(p.name for p in run.rglob("*")) == before


# ---- read-only run directories (a downloaded CI artifact) are analysable


def _read_only_cli(run, tmp_path):
    """A command line that runs `detaudit ...` with `run` read-only: chmod for a normal user; for root,
    whom file modes do not stop, a read-only bind mount in a private mount namespace (it vanishes with
    the process). Skips where neither is possible."""
    import os

    cli = [sys.executable, "-c", "from detaudit.cli import main; main()"]
    if os.geteuid() != 0:
        for p in [run, *run.rglob("*")]:
            p.chmod(0o555 if p.is_dir() else 0o444)
        return cli
    if shutil.which("unshare") is None:
        pytest.skip("root without unshare: cannot make a read-only directory")
    probe = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "mount", "--bind", "-o", "ro", str(run), str(run)],
        capture_output=True,
    )
    if probe.returncode != 0:
        pytest.skip("root without mount namespaces: cannot make a read-only directory")
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(run), *cli]


@pytest.mark.slow  # four detaudit processes
def test_a_read_only_run_directory_is_analysed_and_printed(run, tmp_path):
    import os

    cli = _read_only_cli(run, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    before = sorted(p.name for p in run.rglob("*"))
    res = subprocess.run([*cli, "analyze", str(run)], capture_output=True, text=True, env=env)
    assert res.returncode == 0, res.stderr
    assert "bio+tbik" in res.stdout and "report files not written" in res.stderr and "-o DIR" in res.stderr
    res = subprocess.run(
        [*cli, "analyze", str(run), "-o", str(tmp_path / "out")], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "out" / "report.md").exists()
    res = subprocess.run([*cli, "report", str(run)], capture_output=True, text=True, env=env)
    assert res.returncode == 2 and "pass -o DIR" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not res.stdout.strip()
    res = subprocess.run(
        [*cli, "report", str(run), "-o", str(tmp_path / "rep")], capture_output=True, text=True, env=env
    )
    assert res.returncode == 0 and (tmp_path / "rep" / "report.html").exists(), res.stderr
    assert sorted(p.name for p in run.rglob("*")) == before


# ---- files follow the umask (run directories are shared as CI artifacts)


@pytest.mark.parametrize("mask", [0o022, 0o077, 0o002])
def test_written_files_follow_the_umask(run, tmp_path, mask):
    import os
    import stat

    old = os.umask(mask)
    try:
        res = runner.invoke(app, ["merge", str(run), "-o", str(tmp_path / "m")])
        assert res.exit_code == 0, res.output
        res = runner.invoke(app, ["analyze", str(tmp_path / "m")])
        assert res.exit_code == 0, res.output
    finally:
        os.umask(old)
    merged = tmp_path / "m"
    files = [merged / "manifest.json", merged / "report.md", *(merged / "cells").glob("*.parquet")]
    assert len(files) == 4
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o666 & ~mask, f
    assert stat.S_IMODE(merged.stat().st_mode) == 0o777 & ~mask
