"""Helpers shared by the test modules (importable as `helpers`: pytest puts tests/ on sys.path)."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path


def cli_json(result):
    """The JSON a `--json` command printed: stdout only (typer's CliRunner keeps stderr apart)."""
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# what a sweep logs once its input passed the checks: each suite's decoding (and the flags overriding its
# file), resumed cells, cells started and finished (off a terminal): an error found while cells run (a
# server without logprobs, a resumed run of other numerics) comes after these lines
SWEEP_LOG = re.compile(
    r"^(suite \S+: (chat template|plain text); |note: suite \S+: the command line overrides |"
    r"\d+ completed cell\(s\) found in |\[\d+/\d+\] \S+ (started|finished in \S+ s)$)"
)


# the grid most sweeps in the tests start from: the smoke suite's first 2 prompts, 4 new tokens
SWEEP = {"suites": "smoke", "limit": 2, "max_new_tokens": 4}


def sweep_args(**options) -> list[str]:
    """A sweep's options as command-line arguments: `SWEEP`, then `options`, one `--name value` per
    keyword (`max_new_tokens=8` -> `--max-new-tokens 8`). A keyword of `SWEEP` replaces its value in
    place, None drops it, True makes a bare switch (`no_analyze=True` -> `--no-analyze`); a list or
    tuple is comma-joined (`tp=(1, 2)` -> `--tp 1,2`); other values are str()-ed."""
    out: list[str] = []
    for name, value in {**SWEEP, **options}.items():
        assert value is not False, f"{name}=False: name the switch itself (no_{name}=True)"
        flag = "--" + name.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is not None:
            out += [flag, ",".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)]
    return out


def error_lines(output: str) -> list[str]:
    """The non-empty lines of `output` less the sweep's log lines."""
    return [line for line in output.splitlines() if line.strip() and not SWEEP_LOG.match(line)]


def one_line_error(result, message: str, code: int = 2) -> None:
    """Bad input: exit `code`, the message, one line (two with a warning), no traceback."""
    assert result.exit_code == code, result.output
    assert message in result.output, result.output
    assert "Traceback" not in result.output
    assert len(error_lines(result.output)) <= 2, result.output


def engine_options(
    model,
    backend: str,
    tp: int = 1,
    tp_mode: str = "real",
    *,
    engine: str = "builtin",
    eos_ids=(),
    max_batch_size: int = 0,
    **settings,
):
    """`EngineOptions` for a test: `model` a ModelRef (a fixture's) or a checkpoint directory; `settings`
    the `EngineSettings` fields (dtype, device, cuda_graphs, hang_timeout)."""
    from detaudit.config import EngineOptions, EngineSettings, ModelRef
    from detaudit.models import resolve_model

    ref = model if isinstance(model, ModelRef) else resolve_model(str(model))
    return EngineOptions(
        EngineSettings(name=engine, **settings), ref, backend, tp, tp_mode, tuple(eos_ids), max_batch_size
    )


def local_engine(model, backend: str, tp: int = 1, *, emulated: bool = False, **kw):
    """The built-in engine in this process (TP 1, or emulated TP)."""
    from detaudit.builtin.local import LocalEngine

    return LocalEngine(engine_options(model, backend, tp, "emulated" if emulated else "real", **kw))


def builtin_engine(model, backend: str, tp: int = 1, tp_mode: str = "real", **kw):
    """The built-in engine as the sweep opens it (worker processes for real TP > 1)."""
    from detaudit.builtin import start

    return start(engine_options(model, backend, tp, tp_mode, **kw))


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "generation_config.json",
)


def with_embedded_tokenizer(dest: Path) -> Path:
    """Copy the embedded model's tokenizer (vocab 49152, a chat template) into a checkpoint directory, so
    the CLI can tokenize suites for a tiny random checkpoint of that vocabulary."""
    from detaudit.models import resolve_model

    tok = resolve_model("smollm2-135m", auto_prepare=True).path
    for f in TOKENIZER_FILES:
        if (tok / f).exists():
            shutil.copy(tok / f, dest / f)
    return dest


def build_cli_once(app):
    """A context in which `CliRunner.invoke(app, ...)` reuses one click command: typer rebuilds it on every
    invoke (about 0.1 s, most of the time of a refused case), where the real CLI builds it once per process."""
    import contextlib

    import pytest
    import typer.main
    import typer.testing

    @contextlib.contextmanager
    def ctx():
        cmd = typer.main.get_command(app)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(typer.testing, "_get_command", lambda a: cmd if a is app else typer.main.get_command(a))
            yield

    return ctx()


def generation_difference(a, b):
    """Where two engines' outputs (lists of `Generation`, one per prompt) first differ as the cells would
    record them, bit for bit in every numeric field, the routing of MoE models included
    (`records.first_difference`); None when they are equal."""
    import pyarrow as pa

    from detaudit.runs.records import SCHEMA, first_difference

    routing = ("route_experts", "route_gates", "route_margins")
    fields = ("prompt_id", "prompt_index", "output_token_ids", "token_logprobs", "topk_ids", "topk_logprobs", *routing)
    schema = pa.schema([SCHEMA.field(f) for f in fields])

    def table(gens):
        rows = [
            dict(
                prompt_id=str(i),
                prompt_index=i,
                output_token_ids=g.token_ids,
                token_logprobs=g.token_logprobs,
                topk_ids=g.topk_ids,
                topk_logprobs=g.topk_logprobs,
                **{f: getattr(g, f) for f in routing},
            )
            for i, g in enumerate(gens)
        ]
        return pa.Table.from_pylist(rows, schema=schema)

    return first_difference(table(a), table(b))


# ---------------------------------------------------------------- what a run leaves behind


def file_texts(path):
    """Every representation of a file a secret could hide in: its bytes, plus the decoded contents of
    Parquet (compressed pages, file metadata) and gzip files."""
    import gzip

    raw = path.read_bytes()
    out = [raw]
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        out.append(repr(pq.read_table(path).to_pylist()).encode())
        out.append(repr(pq.read_metadata(path).metadata).encode())
    elif raw[:2] == b"\x1f\x8b":
        out.append(gzip.decompress(raw))
    return out


def find_secrets(root, values) -> list[tuple[str, str]]:
    """(file relative to `root`, secret) for every secret value found in any file under `root`."""
    hits = []
    files = [p for p in root.rglob("*") if p.is_file()]
    assert files, f"nothing under {root}"
    for p in files:
        for blob in file_texts(p):
            hits += [(str(p.relative_to(root)), v) for v in values if v.encode() in blob]
    return sorted(set(hits))


def is_loopback(ip: str) -> bool:
    import ipaddress

    addr = ipaddress.ip_address(ip.split("%", 1)[0])
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        addr = addr.ipv4_mapped
    return addr.is_loopback


def listening(pids) -> list[tuple[int, str, int]]:
    """(pid, ip, port) of every listening inet socket of the processes `pids` and their descendants."""
    import psutil

    procs = []
    for pid in pids:
        p = psutil.Process(pid)
        procs += [p, *p.children(recursive=True)]
    out = []
    for p in procs:
        try:
            conns = p.net_connections(kind="inet")
        except psutil.NoSuchProcess:
            continue
        out += [(p.pid, c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN]
    return out


def assert_loopback_only(socks: list[tuple[int, str, int]]) -> None:
    assert socks, "no listening socket seen: the check would prove nothing"
    bad = [s for s in socks if not is_loopback(s[1])]
    assert not bad, f"sockets listening on a non-loopback address: {bad} (all: {socks})"


# ---------------------------------------------------------------- optional extras


def installed(module: str) -> bool:
    """Whether `module` is installed at all (found, not imported)."""
    import importlib.util

    return importlib.util.find_spec(module) is not None


def require(module: str, extra: str):
    """`module`, imported for real; the test (or, at module level, the module) is skipped only when it is
    not installed at all (`pip install 'detaudit[EXTRA]'`). An extra installed but broken (a missing or
    incompatible dependency, an import that raises) fails instead: `pytest.importorskip` would skip it,
    and a broken install would read as a passing run."""
    import importlib

    import pytest

    if not installed(module):
        pytest.skip(f"{module} is not installed (pip install 'detaudit[{extra}]')", allow_module_level=True)
    return importlib.import_module(module)


# ---------------------------------------------------------------- a sweep killed at a chosen step

# `detaudit ARGS` run by this code stops itself (SIGSTOP) at one point of a sweep's work, once one more
# cell is complete: `cell-done` (the cell file written and the manifest saying so), `file-written` (the
# cell file written, the manifest not yet updated) or `computing` (the built-in engine's next generation
# begun). A test then kills it there: where a kill lands follows the sweep's own steps, not how fast this
# machine runs them.
STOP_AT_ENV = "DETAUDIT_TEST_STOP_AT"
STOPPING_MAIN = """
import os, signal
from detaudit.builtin.local import LocalEngine
from detaudit.runs.rundir import RunDir

point, done = os.environ["DETAUDIT_TEST_STOP_AT"], []
stop = lambda: os.kill(os.getpid(), signal.SIGSTOP)
write_bytes, write, generate = RunDir.write_cell_bytes, RunDir.write_cell, LocalEngine.generate

def write_bytes_then_stop(self, *a, **k):
    write_bytes(self, *a, **k)
    if point == "file-written":
        stop()

def write_then_stop(self, *a, **k):
    write(self, *a, **k)
    done.append(1)
    if point == "cell-done":
        stop()

def generate_after_a_cell(self, *a, **k):
    if point == "computing" and done:
        stop()
    return generate(self, *a, **k)

RunDir.write_cell_bytes, RunDir.write_cell = write_bytes_then_stop, write_then_stop
LocalEngine.generate = generate_after_a_cell
from detaudit.cli import main
main()
"""


def stopped_sweep(args: list[str], log, point: str, **popen):
    """`detaudit *args` (a sweep) started with `STOPPING_MAIN`, returned (a Popen) once it has stopped
    itself at `point`; its output goes to the file `log` (a full pipe would block it before its stop). A
    sweep that ends first fails the test: it never reached the point it was to be killed at."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    env = {**os.environ, STOP_AT_ENV: point, **popen.pop("env", {})}
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", STOPPING_MAIN, *args], env=env, stdout=f, stderr=f, **popen)
    while psutil.Process(proc.pid).status() != psutil.STATUS_STOPPED:
        if proc.poll() is not None:
            tail = open(log, errors="replace").read()[-2000:]
            raise AssertionError(f"the sweep ended (exit {proc.returncode}) before {point}: {tail}")
        time.sleep(0.02)  # polling only: the sweep decides when it stops
    return proc


# ---------------------------------------------------------------- matrices: no hang, no traceback, no leak


class Hung(BaseException):
    """Raised in the main thread when a command outlives its deadline: a BaseException, so no `except
    Exception` on the way (a reader's own error handling) can swallow it."""


def deadline(seconds: float):
    """A context that raises `Hung` after `seconds` (SIGALRM, main thread): a blocking read of a FIFO is
    interrupted and the test fails instead of hanging. Generous on purpose: it catches hangs, it does not
    time anything."""
    import contextlib
    import signal

    @contextlib.contextmanager
    def ctx():
        def fire(signum, frame):
            raise Hung(f"still running after {seconds} s: a hang")

        old = signal.signal(signal.SIGALRM, fire)
        signal.setitimer(signal.ITIMER_REAL, seconds)
        try:
            yield
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, old)

    return ctx()


def secret_pieces(blob: bytes | str, secret: str, n: int = 8) -> list[str]:
    """The pieces of `secret` of `n` characters found in `blob` once its control, format and whitespace
    characters are removed (a server can split the key with them): what a reader could reassemble."""
    import unicodedata

    text = blob.decode("utf-8", "replace") if isinstance(blob, bytes) else blob
    visible = "".join(ch for ch in text if unicodedata.category(ch) not in ("Cc", "Cf", "Zs", "Zl", "Zp"))
    return sorted({secret[i : i + n] for i in range(len(secret) - n + 1) if secret[i : i + n] in visible})


def leaked_pieces(root, secret: str, n: int = 8) -> list[tuple[str, str]]:
    """(file, piece) for every piece of `secret` of `n` characters in any file under `root` (Parquet and
    gzip decoded, as `find_secrets` reads them)."""
    hits = []
    for p in sorted(q for q in root.rglob("*") if q.is_file()):
        for blob in file_texts(p):
            hits += [(str(p.relative_to(root)), piece) for piece in secret_pieces(blob, secret, n)]
    return sorted(set(hits))


def tree_state(root: Path) -> dict[str, tuple]:
    """Every path under root with its type, size and mtime (what a write would change)."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            st = p.lstat()
            out[str(p.relative_to(root))] = (st.st_mode, st.st_size, st.st_mtime_ns)
    return out
