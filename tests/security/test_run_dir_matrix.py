"""Run directories probed as an attacker (or a broken disk) would leave them, each variant through the
five commands that read one (analyze, gate, report, merge, diff) and through a resumed sweep's reads:
cell files whose columns have another Arrow type, lack a column, contradict their cell or hold numbers
no engine computes; manifests whose config no sweep wrote (a temperature "hot", a device "tpu") or
that declare a grid of millions of cells in a few bytes; FIFOs, sockets and symlinks where files belong.

Every variant runs under a deadline (a hang fails the test instead of stalling it) and must end with
exit 0, 1 or 2 and no traceback; a refused one with one line. A variant refused by the manifest is
refused by all five commands; a corrupt cell file is refused by the four that read records, and merge
keeps it out of the merged run's done cells. Variants are generated from the record schema and the
config's fields, so a new column or option is probed without a new line here. The variants of
`test_manifest_fuzz.py` (manifest types, nesting, ids, symlinks) add to these.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import socket
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import build_cli_once, deadline, tree_state
from typer.testing import CliRunner
from unit.test_analyze import TBIK, invariant_cells, make_run

from detaudit.cli import app
from detaudit.config import MAX_GRID_CELLS
from detaudit.errors import DetauditError
from detaudit.runs.records import COLUMNS, LOGPROB_COLUMNS, OPTIONAL_COLUMNS, SCHEMA

runner = CliRunner()
A, B = TBIK[1], TBIK[2]
REFUSED = "refused"  # every command exits 2
CELL = "cell"  # cell A is corrupt: the record readers exit 2; merge keeps it out of the done cells
ANY = "any"  # exit 0, 1 or 2, never a traceback
DEADLINE_S = 60  # per command: far past any normal one (a hang is forever)


@pytest.fixture(scope="module", autouse=True)
def _cli():
    with build_cli_once(app):
        yield


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("base") / "run", invariant_cells(), backends=("bio+tbik",))


# ---------------------------------------------------------------- cell file variants (a function of A's table)


def _replaced(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, pa.field(name, array.type), array)


def _other_type(name: str, n: int) -> pa.Array:
    """Column `name` as a value of another Arrow type than the schema's."""
    want = SCHEMA.field(name).type
    if pa.types.is_list(want):
        return pa.array(["1, 2, 3"] * n, pa.string())  # a list written as text
    if pa.types.is_string(want):
        return pa.array([7] * n, pa.int64())
    if pa.types.is_boolean(want):
        return pa.array(["yes"] * n, pa.string())
    return pa.array(["1"] * n, pa.string())  # a number written as text


# columns whose element type is close to the schema's but not it (what another writer could produce)
NEAR_TYPES = {
    "output_token_ids": pa.list_(pa.int64()),
    "token_logprobs": pa.list_(pa.float64()),
    "topk_ids": pa.list_(pa.int32()),  # one nesting level short
    "topk_logprobs": pa.list_(pa.list_(pa.float64())),
    "tp": pa.int64(),
    "prompt_index": pa.float64(),
}


def _near(name: str):
    def mutate(t: pa.Table) -> pa.Table:
        if name == "topk_ids":
            array = pa.array([[0, 1]] * t.num_rows, NEAR_TYPES[name])
        else:
            array = t.column(name).cast(NEAR_TYPES[name])
        return _replaced(t, name, array)

    return mutate


def _retype(name: str):
    return lambda t: _replaced(t, name, _other_type(name, t.num_rows))


def _null_type(name: str):
    return lambda t: _replaced(t, name, pa.nulls(t.num_rows))


def _drop(name: str):
    return lambda t: t.drop_columns([name])


def _row_value(name: str, value, rows: int | None = None):
    """Every row's (or the first `rows` rows') `name` set to `value`."""

    def mutate(t: pa.Table) -> pa.Table:
        values = t.column(name).to_pylist()
        for i in range(rows or len(values)):
            values[i] = value
        return _replaced(t, name, pa.array(values, SCHEMA.field(name).type))

    return mutate


def _number(name: str, value: float):
    """One value of the log-probability column `name` replaced (position 1 of the first record)."""

    def mutate(t: pa.Table) -> pa.Table:
        rows = t.column(name).to_pylist()
        if name == "topk_logprobs":
            rows[0][1][0] = value
        else:
            rows[0][1] = value
        return _replaced(t, name, pa.array(rows, SCHEMA.field(name).type))

    return mutate


def _rows(pick):
    return lambda t: t.take(pick(t.num_rows))


def _metadata(kv: dict | None):
    return lambda t: t.replace_schema_metadata(kv)


class cell:
    """A variant of cell A's table (schema metadata kept unless the function replaces it)."""

    def __init__(self, mutate) -> None:
        self.mutate = mutate


def _cell_variants() -> list[tuple[str, object, str]]:
    out: list[tuple[str, object, str]] = []
    out += [(f"column-{f.name}-of-another-type", cell(_retype(f.name)), CELL) for f in SCHEMA]
    out += [(f"column-{n}-as-{t}", cell(_near(n)), CELL) for n, t in NEAR_TYPES.items()]
    # all nulls of Arrow's null type: what a writer without the schema makes of a column of None
    out += [(f"column-{f.name}-of-null-type", cell(_null_type(f.name)), CELL) for f in SCHEMA]
    out += [(f"column-{n}-missing", cell(_drop(n)), CELL) for n in COLUMNS]
    out += [(f"optional-column-{n}-missing", cell(_drop(n)), ANY) for n in OPTIONAL_COLUMNS]
    contradictions = {
        "cell_id": B,
        "backend": "bf16",
        "tp": 2,
        "batch_size": 4,
        "suite": "other",
        "engine": "vllm",
        "model": "gpt-5",
    }
    out += [(f"rows-{n}-contradict-the-cell", cell(_row_value(n, v)), CELL) for n, v in contradictions.items()]
    out += [(f"one-row-{n}-contradicts-the-cell", cell(_row_value(n, v, 1)), CELL) for n, v in contradictions.items()]
    out += [
        (f"{n}-holds-{label}", cell(_number(n, v)), CELL)
        for n in LOGPROB_COLUMNS
        for label, v in (("nan", math.nan), ("inf", math.inf), ("minus-inf", -math.inf), ("0.5", 0.5))
    ]
    out += [
        ("a-record-missing", cell(_rows(lambda n: list(range(n - 1)))), CELL),
        ("records-twice", cell(_rows(lambda n: list(range(n)) * 2)), CELL),
        ("no-record", cell(lambda t: t.slice(0, 0)), CELL),
        ("metadata-of-cell-b", cell(_metadata({b"detaudit.cell_id": B.encode()})), CELL),
        ("no-metadata", cell(_metadata(None)), CELL),
        ("metadata-of-another-sweep", cell(lambda t: t.replace_schema_metadata(_other_run(t))), CELL),
        ("rows-reordered", cell(_rows(lambda n: list(reversed(range(n))))), ANY),
    ]
    return out


def _other_run(t: pa.Table) -> dict:
    kv = dict(t.schema.metadata)
    kv[b"detaudit.run"] = b"0123456789abcdef"
    return kv


# ---------------------------------------------------------------- manifest variants (a function of its dict)


def _set(path: str, value):
    def mutate(m: dict) -> None:
        *head, last = path.split(".")
        node = m
        for k in head:
            node = node[k]
        node[last] = value

    return mutate


# config fields a sweep writes, each with values no sweep writes (type or range)
CONFIG_VALUES: dict[str, tuple] = {
    "decoding.temperature": ("hot", -1, 10**400, True, [0.6]),
    "decoding.top_p": (0, 2, "x"),
    "decoding.top_k": (-1, 2**40, 1.5),
    "decoding.max_new_tokens": (0, "64", 2**30),
    "decoding.seed": (-1, 2**64, "42"),
    "decoding.greedy": ("yes", 1),
    "decoding.logprobs": (3, 21, True),
    "decoding.stop": ([1], "x", [""]),
    "dtype": ("float8", "float16", 1),
    "device": ("tpu", "cuda:999", "", "cpu;rm -rf /"),
    "cuda_graphs": ("yes",),
    "hang_timeout": (0, -1, "x", 10**400),
    "server": ({"api": "x"}, {"prompt_format": "x"}, {"server_kind": "x"}, {"background_prompts": "x"}),
    "server.request_timeout": (0, -1, 10**400),
    "server.base_url": (1,),
}


def _config_variants() -> list[tuple[str, object, str]]:
    out = []
    for path, values in CONFIG_VALUES.items():
        for value in values:
            if path.startswith("server."):
                key = path.split(".", 1)[1]
                how = _set("config.server", {key: value})
            else:
                how = _set(f"config.{path}", value)
            out.append((f"config-{path}={json.dumps(value)[:24]}", how, REFUSED))
    return out


def _grid(**axes):
    def mutate(m: dict) -> None:
        m["config"].update(axes)

    return mutate


GRID_VARIANTS = [
    ("grid-one-cell-past-the-bound", _grid(batch_sizes=list(range(1, MAX_GRID_CELLS // 2 + 2))), REFUSED),
    ("grid-999000-cells", _grid(batch_sizes=list(range(1, 1000)), background_load=list(range(500))), REFUSED),
    ("grid-6000-suites", _grid(suites=["smoke"] + [f"s{i}" for i in range(5999)]), REFUSED),
    ("grid-20000-loads", _grid(background_load=list(range(20_000))), REFUSED),
    (
        "grid-a-trillion-cells",
        _grid(
            suites=[f"s{i}" for i in range(1000)],
            batch_sizes=list(range(1, 1001)),
            background_load=list(range(1000)),
        ),
        REFUSED,
    ),
]

MODEL_VARIANTS = [
    ("model-name-edited", _set("model.name", "gpt-5"), CELL),  # its rows name the model the run ran
    ("model-checksum-not-the-identity", _set("model.checksum", "edited"), REFUSED),
    ("model-checksum-the-identity-s", lambda m: m["model"].update(checksum="tiny-ck"), ANY),
    (
        "identity-and-model-checksums-differ",
        lambda m: (m["model"].update(checksum="tiny-ck"), m["comparable"].update(model_checksum="other")),
        REFUSED,
    ),
    ("cell-prompts-not-its-records", _set(f"cells.{A}.prompts", 99), CELL),
    ("cell-prompts-zero", _set(f"cells.{A}.prompts", 0), ANY),  # written before prompts were counted
]


# ---------------------------------------------------------------- file layouts (a function of the run directory)


@contextlib.contextmanager
def _in(directory: Path):
    here = os.getcwd()
    os.chdir(directory)
    try:
        yield
    finally:
        os.chdir(here)


def _fifo(rel: str):
    def make(run: Path, scratch: Path) -> None:
        p = run / rel
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
        os.mkfifo(p)

    return make


def _socket(rel: str):
    """A unix socket file where `rel` belongs (bound by a relative name: socket paths are short)."""

    def make(run: Path, scratch: Path) -> None:
        p = run / rel
        p.unlink(missing_ok=True)
        with _in(p.parent), socket.socket(socket.AF_UNIX) as s:
            s.bind(p.name)

    return make


def _link(rel: str, target):
    def make(run: Path, scratch: Path) -> None:
        p = run / rel
        to = target(run, scratch)
        p.unlink(missing_ok=True)
        p.symlink_to(to)

    return make


def _fifo_at(where: str):
    def target(run: Path, scratch: Path) -> Path:
        p = (run if where == "run" else scratch) / "a-fifo"
        if not p.exists():
            os.mkfifo(p)
        return p

    return target


def _bytes(rel: str, data):
    def make(run: Path, scratch: Path) -> None:
        p = run / rel
        old = p.read_bytes()
        p.unlink()
        p.write_bytes(data(old))

    return make


CELL_FILE = f"cells/{A}.parquet"
LAYOUTS = [
    ("manifest-a-fifo", _fifo("manifest.json"), REFUSED),
    ("manifest-a-socket", _socket("manifest.json"), REFUSED),
    ("manifest-links-to-a-fifo-inside", _link("manifest.json", _fifo_at("run")), REFUSED),
    ("manifest-links-to-a-fifo-outside", _link("manifest.json", _fifo_at("scratch")), REFUSED),
    ("manifest-links-to-dev-zero", _link("manifest.json", lambda r, s: Path("/dev/zero")), REFUSED),
    ("cell-a-fifo", _fifo(CELL_FILE), CELL),
    ("both-cells-fifos", lambda r, s: (_fifo(CELL_FILE)(r, s), _fifo(f"cells/{B}.parquet")(r, s)), CELL),
    ("cell-a-socket", _socket(CELL_FILE), CELL),
    ("cell-links-to-a-fifo-inside", _link(CELL_FILE, _fifo_at("run")), CELL),
    ("cell-links-to-dev-zero", _link(CELL_FILE, lambda r, s: Path("/dev/zero")), REFUSED),
    ("cell-a-directory", lambda r, s: ((r / CELL_FILE).unlink(), (r / CELL_FILE).mkdir()), CELL),
    ("cells-a-fifo", _fifo("cells"), ANY),  # no cell file at all: cells missing, the gate fails
    ("prompts-a-fifo", _fifo("prompts.parquet"), ANY),
    ("prompts-links-outside", _link("prompts.parquet", lambda r, s: Path("/etc/hostname")), REFUSED),
    ("lock-a-fifo", _fifo(".lock"), ANY),
    ("report-md-a-fifo", _fifo("report.md"), ANY),
    ("cell-empty-file", _bytes(CELL_FILE, lambda old: b""), CELL),
    ("cell-magic-only", _bytes(CELL_FILE, lambda old: b"PAR1"), CELL),
    ("cell-truncated", _bytes(CELL_FILE, lambda old: old[: len(old) // 2]), CELL),
    ("cell-footer-only", _bytes(CELL_FILE, lambda old: old[-64:]), CELL),
    ("cell-a-json-file", _bytes(CELL_FILE, lambda old: b'{"output_token_ids": [1, 2]}'), CELL),
    ("cell-one-bit-flipped", _bytes(CELL_FILE, lambda old: old[:-12] + bytes([old[-12] ^ 1]) + old[-11:]), ANY),
]

VARIANTS = _cell_variants() + _config_variants() + GRID_VARIANTS + MODEL_VARIANTS + LAYOUTS
# A variant detaudit accepts runs three full analyses (analyze, gate, report): those are `slow`; the refused
# ones stop at the manifest or the first corrupt cell and stay in the fast loop.
CASES = [
    pytest.param(how, expect, id=name, marks=[pytest.mark.slow] if expect == ANY else [])
    for name, how, expect in VARIANTS
]


def test_the_matrix_is_large_and_distinct():
    names = [name for name, _, _ in VARIANTS]
    assert len(names) == len(set(names)) >= 200


def _variant(base: Path, root: Path, how) -> Path:
    """A copy of the base run with the variant applied (cell files copied: a variant rewrites them)."""
    run = root / "run"
    shutil.copytree(base, run)
    if isinstance(how, cell):
        path = run / CELL_FILE
        changed = how.mutate(pq.read_table(path))  # pyarrow keeps the schema's metadata through each change
        path.unlink()
        pq.write_table(changed, path)
    elif how.__code__.co_argcount == 2:
        how(run, root)
    else:
        m = json.loads((run / "manifest.json").read_text())
        how(m)
        (run / "manifest.json").write_text(json.dumps(m))
    return run


COMMANDS = ("analyze", "gate", "report", "merge", "diff")


def _args(command: str, base: Path, run: Path, root: Path) -> list[str]:
    return {
        "analyze": ["analyze", str(run)],
        "gate": ["gate", str(run)],
        "report": ["report", str(run), "--format", "md,csv", "-o", str(root / "rep")],
        "merge": ["merge", str(run), "-o", str(root / "merged")],
        "diff": ["diff", str(base), str(run)],
    }[command]


@pytest.mark.parametrize("how, expect", CASES)
def test_run_dir_variant(base, tmp_path, how, expect):
    run = _variant(base, tmp_path, how)
    before = tree_state(run)
    for command in COMMANDS:
        with deadline(DEADLINE_S):
            res = runner.invoke(app, _args(command, base, run, tmp_path))
        where = (command, res.output)
        assert res.exception is None or isinstance(res.exception, SystemExit), (command, repr(res.exception))
        assert "Traceback" not in res.output, where
        assert res.exit_code in (0, 1, 2), where
        if res.exit_code == 2:
            assert len([x for x in res.output.splitlines() if x.strip()]) <= 2, where
        if expect == REFUSED or (expect == CELL and command != "merge"):
            assert res.exit_code == 2, where
    if expect == CELL:  # merge: the corrupt cell is never recorded as done, nor its file copied
        merged = json.loads((tmp_path / "merged" / "manifest.json").read_text())
        assert merged["cells"][A]["state"] != "done", merged["cells"][A]
        assert not (tmp_path / "merged" / CELL_FILE).exists()
    if expect in (REFUSED, CELL):  # nothing written: no report beside the run, nothing in it
        assert tree_state(run) == before
        assert not (tmp_path / "rep").exists()
    if expect == REFUSED:
        assert not (tmp_path / "merged").exists()


# ---------------------------------------------------------------- a resumed sweep reads the same files

NON_REGULAR = [(name, how) for name, how, _ in LAYOUTS if "fifo" in name or "socket" in name or "dev-zero" in name]


@pytest.mark.parametrize("how", [pytest.param(how, id=name) for name, how in NON_REGULAR])
def test_a_resumed_sweep_never_waits_on_a_non_regular_file(base, tmp_path, how):
    """What a resumed sweep reads of its run directory before any work (`RunDir.preflight`, the lock,
    `init_or_check`: the manifest and every cell file), with a FIFO, socket or device in a file's place:
    refused in one line, or the cell counted as not done (it is recomputed, its file replaced), never a
    wait and never counted done."""
    from detaudit.runs.manifest import Manifest
    from detaudit.runs.rundir import RunDir

    manifest = Manifest.from_dict(json.loads((base / "manifest.json").read_text()))
    run = _variant(base, tmp_path, how)
    rd = RunDir(run)
    with deadline(DEADLINE_S):
        try:
            rd.preflight()
            with rd.locked():
                done = rd.init_or_check(manifest)
        except DetauditError as e:
            assert "\n" not in str(e)
            return
    assert A not in done or (run / CELL_FILE).is_file()
    assert json.loads((run / "manifest.json").read_text())["cells"][A]["state"] == ("done" if A in done else "pending")


def test_a_sweep_into_a_fifo_manifest_is_refused_before_any_work(base, tmp_path, monkeypatch):
    """The CLI: refused by its preflight, before the model is read."""
    import detaudit.models

    run = _variant(base, tmp_path, _fifo("manifest.json"))

    def no_model_work(*args, **kwargs):
        raise AssertionError("model work started")

    monkeypatch.setattr(detaudit.models, "resolve_model", no_model_work)
    args = ["sweep", "--suites", "smoke", "--backends", "bio+tbik", "--tp", "1,2", "--batch-sizes", "1", "-o", str(run)]
    with deadline(DEADLINE_S):
        res = runner.invoke(app, args)
    assert res.exit_code == 2 and "is a FIFO, not a regular file" in res.output, res.output
    assert len(res.output.strip().splitlines()) == 1


def test_the_grid_bound_is_the_sweeps_own():
    """A manifest may declare the largest grid a sweep can run (MAX_GRID_CELLS), and not one cell more:
    the bound is checked from the axes' lengths, before any cell is built."""
    from detaudit.config import SweepConfig
    from detaudit.runs.manifest import Manifest

    axes = dict(model="m", suites=("smoke",), backends=("bio+tbik",), tp=(1, 2))
    SweepConfig(**axes, batch_sizes=tuple(range(1, MAX_GRID_CELLS // 2 + 1)))
    with pytest.raises(DetauditError, match=f"the grid has {MAX_GRID_CELLS + 2} cells .* MAX_GRID_CELLS"):
        SweepConfig(**axes, batch_sizes=tuple(range(1, MAX_GRID_CELLS // 2 + 2)))
    m = json.loads(json.dumps({"config": {"suites": ["smoke"], "backends": ["bio+tbik"], "tp": [1, 2]}, "cells": {}}))
    m["config"]["batch_sizes"] = list(range(1, MAX_GRID_CELLS // 2 + 1))
    assert len(Manifest.from_dict(m).grid()) == MAX_GRID_CELLS
