"""A manifest (and run directory) fuzz: 130+ deterministic variants of a valid run directory, each run
through analyze, gate, report, merge and diff. Wrong types, missing keys, nesting bombs, huge integers,
cells whose fields contradict their id, bad states, unicode, symlinks: never a traceback; a refusal is one
line and exit 2; a variant that must be refused is refused by every command (never analysed as another
cell); and nothing is written outside the run directory except the output a command was given (-o)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import build_cli_once, tree_state
from typer.testing import CliRunner
from unit.test_analyze import TBIK, invariant_cells, make_run

from detaudit.cli import app

runner = CliRunner()
A, B = TBIK[1], TBIK[2]  # smoke__bio-tbik__tp1__bs1, smoke__bio-tbik__tp2__bs1
REFUSED = 2  # every command must exit 2 on this variant
ANY = None  # a variant detaudit may accept (exit 0 / 1) or refuse (2); never a traceback


@pytest.fixture(scope="module", autouse=True)
def _cli():
    with build_cli_once(app):
        yield


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    return make_run(tmp_path_factory.mktemp("base") / "run", invariant_cells(), backends=("bio+tbik",))


# ---- variants: (id, how, expected exit). `how` is bytes (the manifest file as written), a function of
# the manifest dict (mutates it), or a function of (run directory, scratch directory) for file layouts.


def set_at(path: str, value):
    """Set (or, with value DELETE, remove) the key at a dotted path; `@A` / `@B` name the two cells."""
    keys = [{"@A": A, "@B": B}.get(k, k) for k in path.split(".")]

    def mutate(m: dict) -> None:
        node = m
        for k in keys[:-1]:
            node = node[k]
        if value is DELETE:
            del node[keys[-1]]
        else:
            node[keys[-1]] = value

    return mutate


DELETE = object()


def rename_cell(old: str, new):
    def mutate(m: dict) -> None:
        m["cells"][new] = m["cells"].pop(old)

    return mutate


def nested(depth: int, leaf=0):
    v = leaf
    for i in range(depth):
        v = [v] if i % 2 else {"k": v}
    return v


HUGE = 10**4000  # parses (under the 4300-digit limit of int <-> str) but is no count
HUGE_TEXT = "9" * 5000  # over the limit: json.loads raises ValueError


class raw:
    """A variant of the manifest's text (str or bytes), not of its parsed mapping."""

    def __init__(self, transform) -> None:
        self.transform = transform


VARIANTS = [
    # -- not JSON, or not a mapping
    ("empty-file", raw(lambda t: ""), REFUSED),
    ("null", raw(lambda t: "null"), REFUSED),
    ("a-list", raw(lambda t: "[]"), REFUSED),
    ("empty-mapping", raw(lambda t: "{}"), REFUSED),
    ("a-number", raw(lambda t: "0"), REFUSED),
    ("a-string", raw(lambda t: '"manifest"'), REFUSED),
    ("truncated", raw(lambda t: t[: len(t) // 2]), REFUSED),
    ("trailing-garbage", raw(lambda t: t + "}garbage"), REFUSED),
    ("not-json", raw(lambda t: "{not json"), REFUSED),
    ("utf8-bom", raw(lambda t: "\ufeff" + t), REFUSED),
    ("invalid-utf8", raw(lambda t: t.encode()[:20] + b"\xff\xfe\xfa" + t.encode()[20:]), REFUSED),
    ("utf16", raw(lambda t: t.encode("utf-16")), REFUSED),
    ("nul-byte", raw(lambda t: t.replace('"cells"', '"ce\u0000lls"', 1)), REFUSED),
    ("nan-literal-wall-s", raw(lambda t: t.replace('"wall_s": 1.5', '"wall_s": NaN', 1)), REFUSED),
    ("infinity-wall-s", raw(lambda t: t.replace('"wall_s": 1.5', '"wall_s": Infinity', 1)), REFUSED),
    ("1e400-wall-s", raw(lambda t: t.replace('"wall_s": 1.5', '"wall_s": 1e400', 1)), REFUSED),
    # -- nesting bombs and huge integers
    ("nest-array-100000", raw(lambda t: t[:-2] + ', "bomb": ' + "[" * 100_000 + "]" * 100_000 + "}"), REFUSED),
    ("nest-object-20000", raw(lambda t: t[:-2] + ', "bomb": ' + '{"a":' * 20_000 + "1" + "}" * 20_000 + "}"), REFUSED),
    ("nest-unclosed-50000", raw(lambda t: "[" * 50_000), REFUSED),
    ("nest-900-in-extra", set_at("bomb", nested(900)), REFUSED),
    ("nest-40-in-environment", set_at("environment", nested(40)), REFUSED),
    ("nest-40-in-a-cell", set_at("cells.@A.placement", nested(40)), REFUSED),
    ("nest-20-in-extra", set_at("notes", nested(20)), ANY),
    ("int-5000-digits-tp", raw(lambda t: t.replace('"tp": 1,', f'"tp": {HUGE_TEXT},', 1)), REFUSED),
    ("int-5000-digits-extra", raw(lambda t: t[:-2] + f', "big": {HUGE_TEXT}' + "}"), REFUSED),
    (
        "int-5000-digits-version",
        raw(lambda t: t.replace('"format_version": 2', f'"format_version": {HUGE_TEXT}')),
        REFUSED,
    ),
    ("int-4000-digits-tp", set_at("cells.@A.tp", HUGE), REFUSED),
    ("int-4000-digits-batch", set_at("cells.@A.batch_size", HUGE), REFUSED),
    ("int-4000-digits-prompts", set_at("cells.@A.prompts", HUGE), REFUSED),
    ("int-4000-digits-wall-s", set_at("cells.@A.wall_s", HUGE), REFUSED),
    ("int-4000-digits-version", set_at("format_version", HUGE), REFUSED),
    ("int-4000-digits-limit", set_at("config.limit", HUGE), REFUSED),
    ("int-4000-digits-config-tp", set_at("config.tp", [HUGE]), REFUSED),
    ("int-4000-digits-extra", set_at("big", HUGE), ANY),
    ("int-4000-digits-repeats", set_at("config.repeats", HUGE), REFUSED),
    ("int-4000-digits-shard", set_at("config.shard", [1, HUGE]), ANY),
    # -- missing keys
    ("no-cells", set_at("cells", DELETE), REFUSED),
    ("no-config", set_at("config", DELETE), REFUSED),
    ("no-cell-backend", set_at("cells.@A.backend", DELETE), REFUSED),
    ("no-cell-tp", set_at("cells.@A.tp", DELETE), REFUSED),
    ("no-cell-batch-size", set_at("cells.@A.batch_size", DELETE), REFUSED),
    ("no-cell-suite", set_at("cells.@A.suite", DELETE), REFUSED),
    ("no-config-suites", set_at("config.suites", DELETE), REFUSED),
    ("no-config-backends", set_at("config.backends", DELETE), REFUSED),
    ("no-config-tp", set_at("config.tp", DELETE), REFUSED),
    ("no-config-batch-sizes", set_at("config.batch_sizes", DELETE), REFUSED),
    ("no-comparable", set_at("comparable", DELETE), ANY),
    ("no-model", set_at("model", DELETE), ANY),
    ("no-cell-state", set_at("cells.@A.state", DELETE), ANY),
    ("no-cell-engine", set_at("cells.@A.engine", DELETE), ANY),
    ("no-format-version", set_at("format_version", DELETE), ANY),
    ("no-cells-at-all", set_at("cells", {}), ANY),
    # -- wrong types
    ("cells-a-list", set_at("cells", [A, B]), REFUSED),
    ("cells-a-string", set_at("cells", "cells"), REFUSED),
    ("cell-a-list", set_at("cells.@A", [1]), REFUSED),
    ("cell-null", set_at("cells.@A", None), REFUSED),
    ("cell-a-number", set_at("cells.@A", 7), REFUSED),
    ("cell-tp-string", set_at("cells.@A.tp", "1"), REFUSED),
    ("cell-tp-float", set_at("cells.@A.tp", 1.0), REFUSED),
    ("cell-tp-bool", set_at("cells.@A.tp", True), REFUSED),
    ("cell-tp-null", set_at("cells.@A.tp", None), REFUSED),
    ("cell-batch-size-list", set_at("cells.@A.batch_size", [1]), REFUSED),
    ("cell-backend-number", set_at("cells.@A.backend", 5), REFUSED),
    ("cell-suite-mapping", set_at("cells.@A.suite", {"x": 1}), REFUSED),
    ("cell-state-number", set_at("cells.@A.state", 1), REFUSED),
    ("cell-prompts-string", set_at("cells.@A.prompts", "3"), REFUSED),
    ("cell-error-number", set_at("cells.@A.error", 3), REFUSED),
    ("cell-wall-s-string", set_at("cells.@A.wall_s", "1.5s"), REFUSED),
    ("config-a-list", set_at("config", []), REFUSED),
    ("config-tp-string", set_at("config.tp", "1,2"), REFUSED),
    ("config-tp-floats", set_at("config.tp", [1.0, 2.0]), REFUSED),
    ("config-backends-string", set_at("config.backends", "bio+tbik"), REFUSED),
    ("config-suites-numbers", set_at("config.suites", [1]), REFUSED),
    ("config-decoding-list", set_at("config.decoding", []), REFUSED),
    ("config-limit-string", set_at("config.limit", "all"), REFUSED),
    ("config-tp-mode-number", set_at("config.tp_mode", 1), REFUSED),
    ("config-shard-short", set_at("config.shard", [1]), REFUSED),
    ("config-shard-strings", set_at("config.shard", ["a", 1]), REFUSED),
    ("comparable-a-list", set_at("comparable", []), REFUSED),
    ("model-a-string", set_at("model", "tiny"), REFUSED),
    ("model-name-number", set_at("model.name", 1), REFUSED),
    ("suites-a-list", set_at("suites", ["smoke"]), REFUSED),
    ("suites-entry-number", set_at("suites", {"smoke": 1}), REFUSED),
    ("backends-entry-string", set_at("backends", {"bio+tbik@tp1": "x"}), REFUSED),
    ("merged-from-numbers", set_at("merged_from", [1, 2]), REFUSED),
    ("hardware-keys-string", set_at("hardware_keys", "x"), REFUSED),
    ("mixed-hardware-string", set_at("mixed_hardware", "yes"), REFUSED),
    ("format-version-string", set_at("format_version", "2"), REFUSED),
    ("format-version-future", set_at("format_version", 3), REFUSED),
    ("environment-history-mapping", set_at("environment_history", {}), REFUSED),
    ("git-hash-number", set_at("git_hash", 1), REFUSED),
    ("created-number", set_at("created", 5), REFUSED),
    ("command-list", set_at("command", ["detaudit"]), REFUSED),
    # -- a cell whose fields contradict its id (it would vanish from the gate)
    ("contradict-backend-nope", set_at("cells.@A.backend", "nope"), REFUSED),
    ("contradict-backend-bf16", set_at("cells.@A.backend", "bf16"), REFUSED),
    ("contradict-tp-3", set_at("cells.@A.tp", 3), REFUSED),
    ("contradict-tp-2", set_at("cells.@A.tp", 2), REFUSED),
    ("contradict-tp-0", set_at("cells.@A.tp", 0), REFUSED),
    ("contradict-batch-minus-1", set_at("cells.@A.batch_size", -1), REFUSED),
    ("contradict-batch-2", set_at("cells.@A.batch_size", 2), REFUSED),
    ("contradict-suite", set_at("cells.@A.suite", "other"), REFUSED),
    ("contradict-suite-path", set_at("cells.@A.suite", "../x"), REFUSED),
    ("contradict-engine", set_at("cells.@A.engine", "vllm"), REFUSED),
    ("contradict-swapped-ids", lambda m: m["cells"].update({A: m["cells"][B], B: m["cells"][A]}), REFUSED),
    ("cell-outside-grid-tp4", rename_cell(A, "smoke__bio-tbik__tp4__bs1"), REFUSED),
    ("cell-outside-grid-bg", rename_cell(A, A + "__bg1"), REFUSED),
    ("cell-unknown-suffix", rename_cell(A, A + "__rep2"), REFUSED),
    ("cell-id-tp01", rename_cell(A, "smoke__bio-tbik__tp01__bs1"), REFUSED),
    ("cell-id-path", rename_cell(A, "../../x"), REFUSED),
    ("cell-id-slash", rename_cell(A, "smoke/../bio__x__tp1__bs1"), REFUSED),
    ("cell-id-empty", rename_cell(A, ""), REFUSED),
    ("cell-id-unicode", rename_cell(A, "smoke__bïo__tp1__bs1"), REFUSED),
    ("cell-id-300-chars", rename_cell(A, "s" * 280 + "__bio-tbik__tp1__bs1"), REFUSED),
    ("cell-id-newline", rename_cell(A, A + "\n"), REFUSED),
    # -- configured grid out of range
    ("config-tp-3", set_at("config.tp", [1, 2, 3]), REFUSED),
    ("config-tp-twice", set_at("config.tp", [1, 2, 2]), REFUSED),
    ("config-batch-0", set_at("config.batch_sizes", [0, 1]), REFUSED),
    ("config-batch-huge", set_at("config.batch_sizes", [1, 10**9]), REFUSED),
    ("config-backends-empty", set_at("config.backends", []), REFUSED),
    ("config-suites-empty", set_at("config.suites", []), REFUSED),
    ("config-suite-path", set_at("config.suites", ["smoke", "../../x"]), REFUSED),
    ("config-tp-mode-sideways", set_at("config.tp_mode", "sideways"), REFUSED),
    ("config-limit-0", set_at("config.limit", 0), REFUSED),
    ("config-repeats-0", set_at("config.repeats", 0), REFUSED),
    ("config-background-minus-1", set_at("config.background_load", [-1]), REFUSED),
    (
        "config-grid-bomb",
        lambda m: m["config"].update(batch_sizes=list(range(1, 3001)), background_load=list(range(3001))),
        REFUSED,
    ),
    ("config-more-backends", set_at("config.backends", ["bio+tbik", "bf16"]), ANY),
    ("config-unknown-key", set_at("config.future_option", {"x": [1]}), ANY),
    # -- bad or odd states
    ("state-running", set_at("cells.@A.state", "running"), REFUSED),
    ("state-upper-case", set_at("cells.@A.state", "DONE"), REFUSED),
    ("tp-mode-sideways", set_at("cells.@A.tp_mode", "sideways"), REFUSED),
    ("prompts-negative", set_at("cells.@A.prompts", -1), REFUSED),
    ("wall-s-negative-huge", set_at("cells.@A.wall_s", -1e300), REFUSED),
    ("state-failed", set_at("cells.@A.state", "failed"), ANY),
    ("state-pending", set_at("cells.@A.state", "pending"), ANY),
    ("all-failed", lambda m: [c.update(state="failed", error="crash") for c in m["cells"].values()], ANY),
    ("done-with-error", set_at("cells.@A.error", "it failed"), ANY),
    ("failed-without-error", set_at("cells.@B.state", "failed"), ANY),
    ("prompts-mismatch", set_at("cells.@A.prompts", 99), ANY),
    # -- unicode and control characters
    ("unicode-model-name", set_at("model.name", "模型-\u202eevil"), ANY),
    ("unicode-command", set_at("command", "detaudit sweep 🚀 \x1b[31mred\x1b[0m"), ANY),
    ("lone-surrogate", raw(lambda t: t.replace('"command": "', '"command": "\\ud800', 1)), REFUSED),
    ("unicode-extra-key", set_at("ключ", "значение"), ANY),
    ("control-chars-hardware", set_at("hardware_key", "cpu\x00\x07\r\n"), ANY),
    ("unicode-error", lambda m: m["cells"][B].update(state="failed", error="échec \u0000 ✗ " * 50), ANY),
    ("unicode-suite-config", set_at("config.suites", ["smoke", "süite"]), REFUSED),
    ("long-string", set_at("command", "x" * 1_000_000), ANY),
    # -- identity and environment fields of the wrong shape (read by gate --baseline and diff)
    ("comparable-nested", set_at("comparable.decoding", {"temperature": [[[1]]]}), ANY),
    ("backends-describe-odd", set_at("backends", {"bio+tbik@tp1": {"backend": [1, 2]}}), ANY),
    ("environment-odd", set_at("environment", {"versions": "x", "hardware": None}), ANY),
]


def _cells_symlink(run: Path, scratch: Path) -> None:
    outside = scratch / "elsewhere"
    shutil.move(str(run / "cells"), outside)
    (run / "cells").symlink_to(outside)


def _cell_symlink(run: Path, scratch: Path) -> None:
    cell = run / "cells" / f"{A}.parquet"
    target = scratch / "elsewhere.parquet"
    shutil.move(str(cell), target)
    cell.symlink_to(target)


def _manifest_symlink(run: Path, scratch: Path) -> None:
    target = scratch / "elsewhere.json"
    shutil.move(str(run / "manifest.json"), target)
    (run / "manifest.json").symlink_to(target)


def _lock_symlink(run: Path, scratch: Path) -> None:
    (scratch / "victim").write_text("keep me\n")
    (run / ".lock").unlink(missing_ok=True)
    (run / ".lock").symlink_to(scratch / "victim")


def _symlink_loop(run: Path, scratch: Path) -> None:
    shutil.rmtree(run / "cells")
    (run / "cells").symlink_to(run / "cells")


def _cells_a_file(run: Path, scratch: Path) -> None:
    shutil.rmtree(run / "cells")
    (run / "cells").write_text("not a directory")


def _manifest_a_directory(run: Path, scratch: Path) -> None:
    (run / "manifest.json").unlink()
    (run / "manifest.json").mkdir()


def _missing_cell_file(run: Path, scratch: Path) -> None:
    (run / "cells" / f"{A}.parquet").unlink()


def _cell_of_another_cell(run: Path, scratch: Path) -> None:
    (run / "cells" / f"{A}.parquet").unlink()
    shutil.copy(run / "cells" / f"{B}.parquet", run / "cells" / f"{A}.parquet")


def _garbage_cell(run: Path, scratch: Path) -> None:
    (run / "cells" / f"{A}.parquet").unlink()
    (run / "cells" / f"{A}.parquet").write_bytes(b"PAR1" + b"\0" * 64 + b"PAR1")


def _no_manifest(run: Path, scratch: Path) -> None:
    (run / "manifest.json").unlink()


LAYOUTS = [
    ("cells-symlinked-outside", _cells_symlink, REFUSED),
    ("cell-file-symlinked-outside", _cell_symlink, REFUSED),
    ("manifest-symlinked-outside", _manifest_symlink, REFUSED),
    ("lock-symlinked-outside", _lock_symlink, REFUSED),
    ("cells-symlink-loop", _symlink_loop, REFUSED),
    ("cells-a-file", _cells_a_file, ANY),
    ("manifest-a-directory", _manifest_a_directory, REFUSED),
    ("no-manifest", _no_manifest, REFUSED),
    ("cell-file-missing", _missing_cell_file, ANY),
    ("cell-file-of-another-cell", _cell_of_another_cell, ANY),
    ("cell-file-garbage", _garbage_cell, ANY),
]

# A variant detaudit accepts runs three full analyses (analyze, gate, report): those are `slow`; the
# refused ones stop at the manifest and stay in the fast loop.
CASES = [
    pytest.param(how, expect, id=name, marks=[pytest.mark.slow] if expect is ANY else [])
    for name, how, expect in VARIANTS + LAYOUTS
]


def test_the_fuzz_is_large_and_distinct():
    names = [name for name, _, _ in VARIANTS + LAYOUTS]
    assert len(names) == len(set(names)) >= 130


def _variant(base: Path, root: Path, how) -> Path:
    """A copy of the base run (cell files hard-linked: no command rewrites one in place), then the
    variant applied to it."""
    run = root / "run"
    (run / "cells").mkdir(parents=True)
    for f in (base / "cells").iterdir():
        os.link(f, run / "cells" / f.name)
    text = (base / "manifest.json").read_text()
    if isinstance(how, raw):
        data = how.transform(text)
    elif how.__code__.co_argcount == 2:  # a file layout
        (run / "manifest.json").write_text(text)
        how(run, root)
        return run
    else:
        m = json.loads(text)
        how(m)
        data = json.dumps(m)
    (run / "manifest.json").write_bytes(data.encode() if isinstance(data, str) else data)
    return run


@pytest.mark.parametrize("how, expect", CASES)
def test_manifest_variant(base, tmp_path, how, expect):
    run = _variant(base, tmp_path, how)
    before = tree_state(tmp_path)
    outputs = {"rep": tmp_path / "rep", "merged": tmp_path / "merged"}
    for args in (
        ["analyze", str(run)],
        ["gate", str(run)],
        # html (plots) only where the run is read at all: a refused manifest never reaches a renderer
        ["report", str(run), "--format", "md,csv" if expect is REFUSED else "md,csv,html", "-o", str(outputs["rep"])],
        ["merge", str(run), "-o", str(outputs["merged"])],
        ["diff", str(base), str(run)],
    ):
        res = runner.invoke(app, args)
        assert res.exception is None or isinstance(res.exception, SystemExit), (args[0], repr(res.exception))
        assert "Traceback" not in res.output, (args[0], res.output)
        if expect is REFUSED:
            assert res.exit_code == 2, (args[0], res.output)
        assert res.exit_code in (0, 1, 2), (args[0], res.output)
        if res.exit_code == 2:
            assert len([line for line in res.output.splitlines() if line.strip()]) <= 2, (args[0], res.output)
    after = tree_state(tmp_path)
    allowed = {"run", "rep", "merged"}  # the run directory (analyze's reports) and the outputs asked for
    changed = {k for k in set(before) | set(after) if before.get(k) != after.get(k) and k.split("/")[0] not in allowed}
    assert not changed, changed
    if expect is REFUSED:
        assert not outputs["rep"].exists() and not outputs["merged"].exists()
    if (tmp_path / "victim").exists():
        assert (tmp_path / "victim").read_text() == "keep me\n"
