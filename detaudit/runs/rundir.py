"""The run directory: the one owner of run metadata and records on disk.

A run directory holds `manifest.json` (a typed, versioned `Manifest`), one Parquet file per cell
under `cells/`, and `prompts.parquet`: every prompt the run sent, once (`PROMPT_SCHEMA`: the rendered
text, the token ids the model saw and whether they went through the chat template); an alignment
directory holds `alignment.parquet` + `alignment.json`.

Every file is written atomically (temporary file in the same directory, fsync, `os.replace`), so a
killed sweep never leaves a partial file that could be read as a result. A cell's Parquet file is
written before the manifest records it as done; on resume a valid cell file is the authority, so a
completed cell is never recomputed. A lock file (`fcntl.flock`, released by the kernel when the
holder dies) refuses a second writer.

Run directories are shared between machines and committed, so nothing read from one is trusted:
the manifest is validated against its schema (`detaudit.runs.manifest`), cell ids must match the grid's
pattern (they become file names), and a cell file must carry its own cell id and its run's identity.
A JSON file nested deeper than any detaudit file is refused before it is used, and so is a run directory
whose `cells/` (or a cell file, the lock, the logs) resolves outside it: a symlink never redirects a write.
Files are read only when they are regular files (`open_regular`: a FIFO, socket or device in their place
is refused, never waited on), and a cell file's columns, rows and numbers are checked against the cell
the manifest records (`RunDir.read_table`).
Files are created with the mode the umask gives (0644 usually), as any other tool's: run directories
are shared as CI artifacts.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import math
import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from detaudit.errors import DetauditError
from detaudit.runs.manifest import CellMeta, Manifest, check_cell_id, speculative_conflicts, widen_grid
from detaudit.runs.records import COLUMNS, LOGPROB_COLUMNS, LOGPROB_MAX, SCHEMA

MANIFEST = "manifest.json"
CELLS = "cells"
PROMPTS = "prompts.parquet"
LOCK = ".lock"
LOGS = "logs"  # logs of processes an engine starts
ALIGN_FILE = "alignment.parquet"
ALIGN_SUMMARY = "alignment.json"
MAX_JSON_DEPTH = 32  # a manifest nests about 6 levels; deeper is not a detaudit file (and recursion bait)
MAX_JSON_BYTES = 256 * 2**20  # a manifest of 10,000 cells takes a few MB
CELL_KEY = b"detaudit.cell_id"
RUN_KEY = b"detaudit.run"  # the run's comparable key: a cell file of another sweep is refused
PROMPT_SCHEMA = pa.schema(
    [
        ("suite", pa.string()),
        ("prompt_index", pa.int32()),
        ("prompt_id", pa.string()),
        ("prompt_hash", pa.string()),
        ("text", pa.string()),  # the rendered `doc_to_text`: the user message
        ("prompt_text", pa.string()),  # the token ids decoded, special tokens kept: what the model read
        ("token_ids", pa.list_(pa.int32())),
        ("chat_template", pa.bool_()),
        ("reference_answer", pa.string()),
    ]
)


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _disk_error(path: Path, e: OSError, label: str = "") -> DetauditError:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DetauditError(f"cannot write {label}{path}: {e.strerror} (nothing already written was lost)")
    return DetauditError(f"cannot write {label}{path}: {e.strerror or e}")


def umask() -> int:
    """The process umask, read without changing it where Linux says it (`os.umask` sets it to read it:
    another thread creating a file meanwhile would get the wrong mode)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def unwritable(directory: Path) -> str | None:
    """Why nothing can be created in `directory` (None: it can), found by creating and removing an
    empty directory: the one sure test (root passes access checks; /proc refuses new entries even to
    root; a read-only mount refuses everyone)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".detaudit-probe-", dir=directory))
    except OSError as e:
        return e.strerror or str(e)
    return None


def check_output_dir(path: Path) -> None:
    """Before any work, creating nothing: refuse a directory to write that cannot be made or written (a
    file in its place, an unwritable or read-only parent, a name too long)."""
    full = Path(path).absolute()
    try:
        if full.exists() and not full.is_dir():
            raise DetauditError(f"output path {path} is not a directory")
        nearest = next(p for p in (full, *full.parents) if p.exists())
    except OSError as e:  # a name too long, a loop of symlinks
        raise DetauditError(f"output path {path}: {e.strerror or e}") from None
    why = unwritable(nearest)
    if why:
        raise DetauditError(f"output path {path} is not writable: {why}")


def atomic_write_bytes(path: Path, data: bytes, *, parents: bool = True, label: str = "") -> None:
    """`data` as the whole of `path`, or `path` as it was (a temporary file beside it, renamed over it);
    `parents`: create missing directories; `label` names the file in an error ("--junit ")."""
    try:
        if parents:
            path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise _disk_error(path, e, label) from None
    try:
        os.fchmod(fd, 0o666 & ~umask())  # mkstemp's 0600 would make the run unreadable to anyone else
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(e, OSError):
            raise _disk_error(path, e, label) from None
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def open_regular(path: Path) -> BinaryIO:
    """`path` opened for reading, if it is a regular file (symlinks followed). The open never blocks
    (O_NONBLOCK: a FIFO has no writer to wait for), and what it opened is checked with fstat, so a FIFO,
    socket or device put where a detaudit file belongs is refused instead of read forever.
    FileNotFoundError passes through; anything else is a DetauditError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise DetauditError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a file"
            raise DetauditError(f"{path} is {kind}, not a regular file; refused")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_json(path: Path, what: str) -> Any:
    try:
        with open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_JSON_BYTES:
                raise DetauditError(f"{path} is corrupt: {size} bytes, more than any detaudit file holds")
            data = json.loads(f.read().decode())
    except FileNotFoundError:
        raise DetauditError(f"{path.parent} is not a detaudit {what} directory (no {path.name})") from None
    except RecursionError:
        raise DetauditError(f"{path} is corrupt: nested deeper than any detaudit file") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError; an integer of more than 4300 digits
        raise DetauditError(f"{path} is corrupt: {str(e)[:160]}") from None
    except OSError as e:
        raise DetauditError(f"cannot read {path}: {e.strerror}") from None
    why = _malformed(data)
    if why:
        raise DetauditError(f"{path} is corrupt: {why}")
    return data


def _malformed(obj: Any) -> str | None:
    """What parsed JSON holds that no detaudit file does: nesting deeper than MAX_JSON_DEPTH (walked
    without recursion, so later recursive code never meets it), or a string that is not Unicode (a lone
    surrogate `\\ud800` parses, then fails every write and print)."""
    stack = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                return f"nested more than {MAX_JSON_DEPTH} levels deep"
            items = node.items() if isinstance(node, dict) else enumerate(node)
            stack.extend((x, depth + 1) for kv in items for x in kv)
        elif isinstance(node, str):
            try:
                node.encode()
            except UnicodeEncodeError:
                return f"a string holds a lone surrogate ({node[:40]!r})"
    return None


class RunDir:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None
        self.manifest: Manifest | None = None

    # ---- paths
    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def cell_path(self, cell_id: str) -> Path:
        """The cell's file; the id is checked against the grid's pattern first (ids come from
        manifests, which are untrusted: `../../x` must never become a path), and the path must resolve
        inside the run directory (a symlinked `cells/` or cell file is refused)."""
        check_cell_id(cell_id, str(self.manifest_path))
        path = self.path / CELLS / f"{cell_id}.parquet"
        self._check_inside(path)
        return path

    def _check_inside(self, *paths: Path) -> None:
        root = self.path.resolve()
        for p in paths:
            if not os.path.lexists(p):
                continue
            try:
                p.resolve().relative_to(root)
            except ValueError:
                raise DetauditError(
                    f"{p} resolves outside the run directory {self.path} (a symlink to {os.path.realpath(p)}); "
                    "refused: a run directory holds its own files"
                ) from None
            except (OSError, RuntimeError) as e:  # a symlink loop
                raise DetauditError(f"{p} cannot be resolved ({e}); refused") from None

    def check_contained(self) -> None:
        """The directories and files the run writes or reads resolve inside it."""
        self._check_inside(*(self.path / name for name in (CELLS, MANIFEST, LOCK, LOGS, PROMPTS)))

    # ---- lifecycle
    @contextmanager
    def locked(self) -> Iterator["RunDir"]:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self.check_contained()
            (self.path / CELLS).mkdir(exist_ok=True)
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o666)
        except OSError as e:
            raise DetauditError(f"output path {self.path} is not writable: {e.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device: never written to or waited on
            os.close(fd)
            raise DetauditError(f"{self.path / LOCK} is not a regular file; refused (remove it)")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DetauditError(
                f"another sweep is writing to {self.path}{self._lock_holder()}; "
                "wait for it or use another --output-path"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd
        self._remove_stale_temps()
        try:
            yield self
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            self._lock_fd = None

    def _remove_stale_temps(self) -> None:
        """Temp files `atomic_write_bytes` left when a writer was killed between creating and renaming
        one: with the lock held no other writer exists, so each is stale (its file's previous version,
        or none, is still in place). Only the lock holder's own files: the manifest and the cells (a
        report being written beside them by `analyze` is not ours to remove)."""
        for directory, pattern in ((self.path, f".{MANIFEST}.*.tmp"), (self.path / CELLS, ".*.tmp")):
            for tmp in directory.glob(pattern):
                if tmp.is_file() and not tmp.is_symlink():
                    tmp.unlink(missing_ok=True)

    def _lock_holder(self) -> str:
        try:
            with open_regular(self.path / LOCK) as f:
                pid = f.read(32).decode(errors="replace").strip()
            return f" (pid {pid})" if pid.isdigit() else ""
        except (OSError, DetauditError):
            return ""

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def preflight(self) -> None:
        """Before any work, creating nothing: refuse an output path that cannot become this run's
        directory (a file, an unwritable place, a symlinked `cells/`, a corrupt manifest)."""
        check_output_dir(self.path)
        if self.exists():
            self.load()
        elif self.path.is_dir():
            self.check_contained()

    def load(self) -> Manifest:
        if not self.path.is_dir():
            raise DetauditError(f"run directory {self.path} does not exist")
        self.check_contained()
        self.manifest = Manifest.from_dict(read_json(self.manifest_path, "run"), str(self.manifest_path))
        return self.manifest

    def save(self) -> None:
        assert self.manifest is not None
        self.manifest.updated = now()
        atomic_write_json(self.manifest_path, self.manifest.to_dict())

    def init_or_check(self, manifest: Manifest) -> list[str]:
        """Start a new manifest, or check that the existing one is the same sweep (same
        `comparable()`) and add any new cells to it. Returns the ids of cells already complete."""
        if self.exists():
            old = self.load()
            if old.comparable() != manifest.comparable():
                diff = ", ".join(old.differences(manifest)) or "sweep"
                raise DetauditError(
                    f"{self.path} holds a different sweep (different {diff}); use another --output-path"
                )
            clash = speculative_conflicts(old.speculative, manifest.speculative)
            if clash:
                raise DetauditError(
                    f"{self.path} holds cells of another draft model or n-gram lookup under the same name "
                    f"({'; '.join(clash)}); use another --output-path"
                )
            widen_grid(old.config, manifest.config)  # a resumed sweep may add TP sizes, batch sizes, ...
            old.speculative.update(manifest.speculative)
            for cid, meta in manifest.cells.items():
                old.cells.setdefault(cid, meta)
            old.environment_history.append(manifest.environment)
            old.backends.update(manifest.backends)
            for name, info in manifest.suites.items():  # ungraded counts etc. as this run saw them
                old.suites.setdefault(name, info)
        else:
            self.manifest = manifest
            manifest.created = now()
        done = []
        assert self.manifest is not None
        for cid, meta in self.manifest.cells.items():
            if self.cell_is_valid(cid, meta):
                if meta.state != "done":
                    meta.state = "done"
                    meta.extra["recovered"] = True
                done.append(cid)
            elif meta.state == "done":
                meta.state, meta.error = "pending", "cell file missing or corrupt; recomputed"
        self.save()
        return done

    # ---- cells
    def cell_is_valid(self, cell_id: str, meta: CellMeta | None = None) -> bool:
        """The cell's file is one `read_table` accepts (this cell's id and this run's identity, every
        column of its type, rows that agree with the cell, one per prompt), so a resumed sweep or a
        merge never counts as done a cell that analyze would refuse."""
        if not os.path.lexists(self.cell_path(cell_id)):
            return False
        try:
            self.read_table(cell_id, meta=meta)
        except DetauditError:
            return False
        return True

    def _identity_error(self, kv: dict, cell_id: str) -> str | None:
        stored = kv.get(CELL_KEY, b"").decode(errors="replace")
        if stored != cell_id:
            return f"it holds cell {stored or '?'!r}, not {cell_id!r}"
        run = kv.get(RUN_KEY)
        if run is not None and self.manifest is not None and run.decode(errors="replace") != self.manifest.comparable():
            return "it belongs to another sweep"
        return None

    def _rows_error(self, table: pa.Table, cell_id: str, meta: CellMeta | None) -> str | None:
        """What a cell file's rows hold that the cell they belong to cannot: a column of another type than
        the record schema's, a coordinate (cell id, backend, TP, batch size, suite, engine, model) other
        than the manifest's for this cell, another number of rows than its prompts, or a log-probability
        no engine computes (NaN, infinite, positive)."""
        for f in table.schema:
            want = SCHEMA.field(f.name).type if f.name in SCHEMA.names else None
            if want is not None and not f.type.equals(want):
                return f"column {f.name!r} holds {str(f.type)[:60]}, not {want}"
        expected: dict[str, Any] = {"cell_id": cell_id}
        if meta is not None:
            expected.update(
                backend=meta.backend, tp=meta.tp, batch_size=meta.batch_size, suite=meta.suite, engine=meta.engine
            )
        if self.manifest is not None and isinstance(self.manifest.model.get("name"), str):
            expected["model"] = self.manifest.model["name"]
        for column, want in expected.items():
            if column in table.column_names:
                other = [v for v in pc.unique(table.column(column)).to_pylist() if v != want]
                if other:
                    if column == "cell_id":
                        return f"its rows belong to cell {str(other[0])[:80]!r}"
                    return f"its rows record {column} {_shown(other[0])}, the manifest {_shown(want)}"
        if meta is not None and meta.prompts and table.num_rows != meta.prompts:
            return f"it holds {table.num_rows} records, the manifest {meta.prompts} for this cell"
        for column in LOGPROB_COLUMNS:
            if column in table.column_names:
                values = table.column(column).combine_chunks()
                while pa.types.is_list(values.type):
                    values = values.flatten()
                if len(values) and values.null_count < len(values):
                    low, high = pc.min_max(values).values()
                    nan = pc.any(pc.is_nan(values)).as_py()
                    if nan or not math.isfinite(low.as_py()) or high.as_py() > LOGPROB_MAX:
                        bad = "NaN" if nan else low.as_py() if not math.isfinite(low.as_py()) else high.as_py()
                        return f"column {column!r} holds {bad} (a log-probability is a finite number <= 0)"
        return None

    def write_cell(self, cell_id: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
        assert self.manifest is not None
        self.write_cell_bytes(cell_id, cell_bytes(cell_id, rows, self.manifest.comparable()))
        self.manifest.cells[cell_id].finish(meta, prompts=len(rows))
        self.save()

    def write_cell_bytes(self, cell_id: str, data: bytes) -> None:
        atomic_write_bytes(self.cell_path(cell_id), data)

    def write_prompts(self, rows: list[dict[str, Any]]) -> None:
        """`prompts.parquet`, once: a run's prompts never change (its identity holds their hashes)."""
        path = self.path / PROMPTS
        if not path.exists():
            sink = pa.BufferOutputStream()
            pq.write_table(pa.Table.from_pylist(rows, schema=PROMPT_SCHEMA), sink, compression="zstd")
            atomic_write_bytes(path, sink.getvalue().to_pybytes())

    def mark(self, cell_id: str, state: str, **meta: Any) -> None:
        assert self.manifest is not None
        self.manifest.cells[cell_id].update(state=state, **meta)
        self.save()

    def read_table(self, cell_id: str, columns: list[str] | None = None, meta: CellMeta | None = None) -> pa.Table:
        """A cell's records, checked: a regular file, readable, every record column present and of its
        type, its own cell id (file metadata and rows) and this run's identity, rows that agree with the
        cell (`meta`, default: the manifest's) and numbers an engine computes. Anything else is a corrupt
        cell (exit 2)."""
        path = self.cell_path(cell_id)
        if meta is None and self.manifest is not None:
            meta = self.manifest.cells.get(cell_id)
        try:
            with open_regular(path) as f:
                pf = pq.ParquetFile(f)
                table = pf.read(columns=columns)
                kv = pf.schema_arrow.metadata or {}
        except FileNotFoundError:
            raise DetauditError(
                f"cell {cell_id} is marked done but its file {path} is missing; rerun the sweep to recompute it"
            ) from None
        except DetauditError:
            raise
        except Exception as e:
            raise DetauditError(
                f"cell file {path} is unreadable or truncated ({type(e).__name__}); rerun the sweep to recompute it"
            ) from None
        missing = [c for c in (columns or COLUMNS) if c not in table.column_names]
        if missing:
            raise DetauditError(f"cell file {path} is corrupt: it lacks columns {', '.join(missing)}")
        why = self._identity_error(kv, cell_id) or self._rows_error(table, cell_id, meta)
        if why:
            raise DetauditError(f"cell file {path} is corrupt: {why}; rerun the sweep to recompute it")
        return table

    def read_bytes(self, cell_id: str) -> bytes:
        """A cell file's bytes (a regular file only), for a copy into another run."""
        with open_regular(self.cell_path(cell_id)) as f:
            return f.read()

    def read_cell(self, cell_id: str) -> pd.DataFrame:
        return self.read_table(cell_id).to_pandas()


def _shown(value: Any) -> str:
    return repr(value[:40]) if isinstance(value, str) else str(value)[:40]


def cell_bytes(cell_id: str, rows: list[dict[str, Any]], run_key: str) -> bytes:
    table = pa.Table.from_pylist(rows, schema=SCHEMA)
    table = table.replace_schema_metadata({CELL_KEY: cell_id.encode(), RUN_KEY: run_key.encode()})
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression="zstd")
    return sink.getvalue().to_pybytes()


# ---------------------------------------------------------------- alignment directories


def write_alignment_data(out_dir: Path, df: pd.DataFrame, summary: list[dict], meta: dict) -> list[Path]:
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), sink)
    atomic_write_bytes(out_dir / ALIGN_FILE, sink.getvalue().to_pybytes())
    atomic_write_json(out_dir / ALIGN_SUMMARY, {"meta": meta, "summary": summary})
    return [out_dir / ALIGN_FILE, out_dir / ALIGN_SUMMARY]


def is_alignment_dir(path: Path) -> bool:
    return (Path(path) / ALIGN_SUMMARY).exists() and not (Path(path) / MANIFEST).exists()


def load_alignment(path: Path) -> dict:
    data = read_json(Path(path) / ALIGN_SUMMARY, "alignment")
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("summary"), list)
        or not isinstance(data.get("meta", {}), dict)
    ):
        raise DetauditError(f"{Path(path) / ALIGN_SUMMARY} is not a detaudit alignment summary")
    return data
