"""Run directory: atomic cell files, resume, lock, comparability."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest

from detaudit.errors import DetauditError
from detaudit.store import RunDir, load_run


def _row(cell_id, i, tokens=(1, 2)):
    return {"cell_id": cell_id, "model": "m", "suite": "s", "backend": "bf16", "tp": 1, "batch_size": 1,
            "tp_mode": "real", "engine": "builtin", "prompt_index": i, "prompt_id": str(i), "prompt_hash": "h",
            "prompt_tokens": 3, "output_token_ids": list(tokens), "output_text": "x", "finish_reason": "length",
            "token_logprobs": [-0.1] * len(tokens), "topk_ids": [[1] * 5] * len(tokens),
            "topk_logprobs": [[-0.1] * 5] * len(tokens), "reference_answer": "1", "predicted_answer": "1",
            "correct": True, "tf_reference_cell": None, "tf_token_logprobs": None}


def _manifest(key="k", cells=("a", "b")):
    return {"comparable_key": key, "config": {}, "environment": {}, "backends": {},
            "cells": {c: {"backend": "bf16", "tp": 1, "batch_size": 1, "suite": "s", "state": "pending", "prompts": 2} for c in cells}}


def test_write_and_resume(tmp_path):
    run = RunDir(tmp_path / "r")
    with run.locked():
        assert run.init_or_check(_manifest()) == []
        run.write_cell("a", [_row("a", 0), _row("a", 1)], {"wall_s": 1.0})
    run2 = RunDir(tmp_path / "r")
    with run2.locked():
        assert run2.init_or_check(_manifest()) == ["a"]
    manifest, records = load_run(tmp_path / "r")
    assert manifest["cells"]["a"]["state"] == "done" and len(records) == 2


def test_cell_file_without_manifest_update_is_recovered(tmp_path):
    """Killed between writing the cell file and the manifest: the valid file counts as done."""
    run = RunDir(tmp_path / "r")
    with run.locked():
        run.init_or_check(_manifest())
        run.write_cell("a", [_row("a", 0), _row("a", 1)], {})
        run.manifest["cells"]["a"]["state"] = "pending"
        run.save()
    with RunDir(tmp_path / "r").locked() as r:
        assert r.init_or_check(_manifest()) == ["a"]


def test_truncated_cell_is_recomputed_not_read(tmp_path):
    run = RunDir(tmp_path / "r")
    with run.locked():
        run.init_or_check(_manifest())
        run.write_cell("a", [_row("a", 0), _row("a", 1)], {})
    p = run.cell_path("a")
    p.write_bytes(p.read_bytes()[:100])
    with pytest.raises(DetauditError, match="unreadable or truncated"):
        load_run(tmp_path / "r")
    with RunDir(tmp_path / "r").locked() as r:
        assert r.init_or_check(_manifest()) == []
        assert r.manifest["cells"]["a"]["state"] == "pending"


def test_different_sweep_refused(tmp_path):
    with RunDir(tmp_path / "r").locked() as r:
        r.init_or_check(_manifest("k1"))
    with pytest.raises(DetauditError, match="different sweep"):
        with RunDir(tmp_path / "r").locked() as r:
            r.init_or_check(_manifest("k2"))


def _hold(path, ready):
    with RunDir(path).locked():
        ready.set()
        time.sleep(30)


def test_lock_refuses_second_writer_and_dies_with_holder(tmp_path):
    ctx = mp.get_context("fork")
    ready = ctx.Event()
    p = ctx.Process(target=_hold, args=(tmp_path / "r", ready))
    p.start()
    assert ready.wait(10)
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
        load_run(tmp_path / "r")
