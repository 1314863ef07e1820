"""Run directory (runs.py) and typed manifest (manifest.py): atomic cell files, resume, lock,
comparability, validation on read."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import resource

import pytest

from detaudit.errors import DetauditError
from detaudit.runs.manifest import CellMeta, Manifest
from detaudit.runs.rundir import RunDir

A, B = "s__bf16__tp1__bs1", "s__bf16__tp1__bs2"


def row(cell_id, i, tokens=(1, 2)):
    return {
        "cell_id": cell_id,
        "model": "m",
        "suite": "s",
        "backend": "bf16",
        "tp": 1,
        "batch_size": 1,
        "tp_mode": "real",
        "engine": "builtin",
        "prompt_index": i,
        "prompt_id": str(i),
        "prompt_hash": "h",
        "prompt_tokens": 3,
        "output_token_ids": list(tokens),
        "output_text": "x",
        "finish_reason": "length",
        "token_logprobs": [-0.1] * len(tokens),
        "topk_ids": [[1] * 5] * len(tokens),
        "topk_logprobs": [[-0.1] * 5] * len(tokens),
        "reference_answer": "1",
        "predicted_answer": "1",
        "correct": True,
        "tf_reference_cell": None,
        "tf_token_logprobs": None,
    }


def manifest(key="k", cells=(A, B)) -> Manifest:
    return Manifest(
        config={"backends": ["bf16"], "tp": [1], "batch_sizes": [1, 2], "suites": ["s"]},
        identity={"model_checksum": key},
        cells={c: CellMeta("bf16", 1, int(c[-1]), "s", prompts=2) for c in cells},
    )


def test_write_and_resume(tmp_path):
    run = RunDir(tmp_path / "r")
    with run.locked():
        assert run.init_or_check(manifest()) == []
        run.write_cell(A, [row(A, 0), row(A, 1)], {"wall_s": 1.0})
    run2 = RunDir(tmp_path / "r")
    with run2.locked():
        assert run2.init_or_check(manifest()) == [A]
    assert run2.manifest.cells[A].state == "done" and len(run2.read_cell(A)) == 2
    assert RunDir(tmp_path / "r").load().cells[A].extra["wall_s"] == 1.0


def test_a_cell_holds_token_ids_of_any_vocabulary(tmp_path):
    """Token ids past 2^15 (SmolLM2's vocabulary has 49,152 tokens, Qwen3's 151,936) are written and read
    back as they were, generated and top-k alike."""
    big = (0, 32767, 32768, 49151, 151935)
    run = RunDir(tmp_path / "r")
    with run.locked():
        run.init_or_check(manifest())
        rows = [row(A, 0, big), row(A, 1)]
        rows[0]["topk_ids"] = [list(reversed(big))] * len(big)
        run.write_cell(A, rows, {})
    reread = RunDir(tmp_path / "r")
    reread.load()
    table = reread.read_table(A)
    assert table.column("output_token_ids").to_pylist()[0] == list(big)
    assert table.column("topk_ids").to_pylist()[0] == [list(reversed(big))] * len(big)


def test_cell_file_without_manifest_update_is_recovered(tmp_path):
    """Killed between writing the cell file and the manifest: the valid file counts as done."""
    run = RunDir(tmp_path / "r")
    with run.locked():
        run.init_or_check(manifest())
        run.write_cell(A, [row(A, 0), row(A, 1)], {})
        run.manifest.cells[A].state = "pending"
        run.save()
    with RunDir(tmp_path / "r").locked() as r:
        assert r.init_or_check(manifest()) == [A]


def test_temp_files_of_a_killed_writer_are_removed_on_resume(tmp_path):
    """A writer killed between creating an atomic write's temp file and renaming it leaves the temp
    behind; the next lock holder removes those of the manifest and the cells, and nothing else."""
    run = RunDir(tmp_path / "r")
    with run.locked():
        run.init_or_check(manifest())
        run.write_cell(A, [row(A, 0), row(A, 1)], {})
    stale = [run.path / ".manifest.json.x1y2.tmp", run.path / "cells" / f".{A}.parquet.z3.tmp"]
    others = [run.path / ".report.md.q9.tmp", run.path / "notes.tmp"]
    for p in stale + others:
        p.write_bytes(b"partial")
    with RunDir(tmp_path / "r").locked() as r:
        assert r.init_or_check(manifest()) == [A]
    assert [p.exists() for p in stale + others] == [False, False, True, True]


@contextlib.contextmanager
def files_end_at(size: int):
    """Writes past `size` bytes of any file fail (RLIMIT_FSIZE; Python ignores SIGXFSZ, so the write
    returns EFBIG): a disk that fills, or a writer that dies, in the middle of a file, whatever call
    wrote it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def test_a_manifest_write_that_fails_midway_leaves_the_old_manifest(tmp_path):
    """The manifest is replaced whole or not at all: a write cut off half-way (the disk full, the writer
    gone) leaves the previous manifest byte for byte, and no temp file behind."""
    run = RunDir(tmp_path / "r")
    with run.locked():
        run.init_or_check(manifest())
        before = run.manifest_path.read_bytes()
        run.manifest.cells[A].state = "failed"
        run.manifest.cells[A].error = "x" * len(before)  # the new manifest is twice as long
        with files_end_at(len(before) // 2), pytest.raises(DetauditError, match="nothing already written was lost"):
            run.mark(B, "failed", error="y")
        assert run.manifest_path.read_bytes() == before
        assert not list(run.path.rglob("*.tmp"))
        run.save()  # the same write without the limit: it is the limit that cut it
    assert RunDir(tmp_path / "r").load().cells[A].error == "x" * len(before)


def test_truncated_cell_is_recomputed_not_read(tmp_path):
    run = RunDir(tmp_path / "r")
    with run.locked():
        run.init_or_check(manifest())
        run.write_cell(A, [row(A, 0), row(A, 1)], {})
    p = run.cell_path(A)
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(DetauditError, match="unreadable or truncated"):
        run.read_cell(A)
    with RunDir(tmp_path / "r").locked() as r:
        assert r.init_or_check(manifest()) == []
        assert r.manifest.cells[A].state == "pending"


def test_cell_file_of_another_cell_or_sweep_is_refused(tmp_path):
    run = RunDir(tmp_path / "r")
    with run.locked():
        run.init_or_check(manifest())
        run.write_cell(A, [row(A, 0), row(A, 1)], {})
    run.cell_path(B).write_bytes(run.cell_path(A).read_bytes())  # A's file copied over B's name
    with pytest.raises(DetauditError, match=f"holds cell '{A}'"):
        run.read_cell(B)
    assert not run.cell_is_valid(B)
    other = RunDir(tmp_path / "o")  # same cell id, another sweep's identity
    with other.locked():
        other.init_or_check(manifest("other"))
    other.cell_path(A).write_bytes(run.cell_path(A).read_bytes())
    with pytest.raises(DetauditError, match="another sweep"):
        other.read_cell(A)


def test_different_sweep_refused(tmp_path):
    with RunDir(tmp_path / "r").locked() as r:
        r.init_or_check(manifest("k1"))
    with pytest.raises(DetauditError, match="different sweep .*model_checksum"):
        with RunDir(tmp_path / "r").locked() as r:
            r.init_or_check(manifest("k2"))


def test_manifest_round_trip_keeps_unknown_keys(tmp_path):
    m = manifest()
    d = m.to_dict()
    d["future_field"] = {"x": 1}
    back = Manifest.from_dict(d)
    assert back.to_dict() == d and back.comparable() == m.comparable()


@pytest.mark.parametrize("cell_id", ["../../x", "s__bf16__tp1__bs1/../../y", "a/b", "", ".hidden__b__tp1__bs1"])
def test_cell_ids_that_could_be_paths_are_refused(tmp_path, cell_id):
    d = manifest().to_dict()
    d["cells"][cell_id] = d["cells"].pop(A)
    with pytest.raises(DetauditError, match="not a detaudit cell id"):
        Manifest.from_dict(d)
    with pytest.raises(DetauditError, match="not a detaudit cell id"):
        RunDir(tmp_path).cell_path(cell_id)


def _hold(path, ready, never):
    with RunDir(path).locked():
        ready.set()
        never.wait()  # holds the lock until it is killed


@pytest.mark.slow  # a forked process
def test_lock_refuses_second_writer_and_dies_with_holder(tmp_path):
    ctx = mp.get_context("fork")
    ready, never = ctx.Event(), ctx.Event()
    p = ctx.Process(target=_hold, args=(tmp_path / "r", ready, never))
    p.start()
    while not ready.wait(0.05):  # polling: the holder decides when it holds the lock
        assert p.is_alive(), f"the lock holder died first (exit {p.exitcode})"
    with pytest.raises(DetauditError, match="another sweep is writing"):
        with RunDir(tmp_path / "r").locked():
            pass
    p.kill()  # SIGKILL: the kernel releases the flock, nothing stays stuck
    p.join()
    with RunDir(tmp_path / "r").locked():
        pass


def test_corrupt_manifest(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "manifest.json").write_text("{not json")
    with pytest.raises(DetauditError, match="corrupt"):
        RunDir(tmp_path / "r").load()


def test_numerics_conflicts_name_the_backend_and_field():
    from detaudit.runs.manifest import numerics_conflicts

    bio = {"backend": {"backend": "bio", "rms_norm": "a", "torch": "2.11"}, "workers": 2}
    same_code_other_torch = {"backend": {"backend": "bio", "rms_norm": "a", "torch": "2.13"}, "workers": 1}
    other_norm = {"backend": {"backend": "bio", "rms_norm": "b", "torch": "2.11"}}
    assert numerics_conflicts({"bio@tp1": bio}, {"bio@tp1": same_code_other_torch}) == []
    assert numerics_conflicts({"bio@tp1": bio}, {"bio@tp2": other_norm}) == []  # another key: nothing recorded
    assert numerics_conflicts({"bio@tp1": bio}, {"bio@tp1": other_norm}) == ["bio@tp1 (rms_norm)"]


def test_a_resumed_sweep_that_adds_cells_widens_the_grid(tmp_path):
    """Resuming with another batch size adds its cells: the grid grows with them, so the run directory
    stays valid (a cell outside the configured grid is refused on read)."""
    small = manifest(cells=(A,))
    small.config["batch_sizes"] = [1]
    with RunDir(tmp_path / "r").locked() as run:
        run.init_or_check(small)
    with RunDir(tmp_path / "r").locked() as run:
        run.init_or_check(manifest())
    m = RunDir(tmp_path / "r").load()
    assert m.config["batch_sizes"] == [1, 2] and set(m.grid()) == set(m.cells) == {A, B}


def test_manifest_cells_must_be_the_cells_their_ids_name():
    d = manifest().to_dict()
    d["cells"][A]["batch_size"] = 2  # the fields of B under A's id
    with pytest.raises(DetauditError, match=f"cell {A} records .* not the cell its id names"):
        Manifest.from_dict(d)
