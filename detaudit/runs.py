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
the manifest is validated against its schema (`detaudit.manifest`), cell ids must match the grid's
pattern (they become file names), and a cell file must carry its own cell id and its run's identity.
"""

from __future__ import annotations

import datetime as _dt
import errno
import fcntl
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from detaudit.errors import DetauditError
from detaudit.manifest import CellMeta, Manifest, check_cell_id
from detaudit.records import COLUMNS, SCHEMA

MANIFEST = "manifest.json"
CELLS = "cells"
PROMPTS = "prompts.parquet"
LOCK = ".lock"
ALIGN_FILE = "alignment.parquet"
ALIGN_SUMMARY = "alignment.json"
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


def _disk_error(path: Path, e: OSError) -> DetauditError | None:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return DetauditError(f"cannot write {path}: {e.strerror} (nothing already written was lost)")
    if e.errno in (errno.EACCES, errno.EROFS, errno.EPERM):
        return DetauditError(f"cannot write {path}: {e.strerror}")
    return None


def atomic_write_bytes(path: Path, data: bytes) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        raise (_disk_error(path, e) or e) from None
    try:
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
        err = _disk_error(path, e) if isinstance(e, OSError) else None
        if err is not None:
            raise err from None
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


def read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise DetauditError(f"{path.parent} is not a detaudit {what} directory (no {path.name})") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DetauditError(f"{path} is corrupt: {e}") from None
    except OSError as e:
        raise DetauditError(f"cannot read {path}: {e.strerror}") from None


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
        manifests, which are untrusted: `../../x` must never become a path)."""
        check_cell_id(cell_id, str(self.manifest_path))
        return self.path / CELLS / f"{cell_id}.parquet"

    # ---- lifecycle
    @contextmanager
    def locked(self) -> Iterator["RunDir"]:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            (self.path / CELLS).mkdir(exist_ok=True)
            fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DetauditError(f"output path {self.path} is not writable: {e.strerror}") from None
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
        try:
            yield self
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            self._lock_fd = None

    def _lock_holder(self) -> str:
        try:
            pid = (self.path / LOCK).read_text().strip()
            return f" (pid {pid})" if pid else ""
        except OSError:
            return ""

    def exists(self) -> bool:
        return self.manifest_path.exists()

    def load(self) -> Manifest:
        if not self.path.is_dir():
            raise DetauditError(f"run directory {self.path} does not exist")
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
        """The file exists, is readable, carries this cell's id and this run's identity, and holds
        one row per prompt."""
        path = self.cell_path(cell_id)
        if not path.exists():
            return False
        try:
            md = pq.read_metadata(path)
        except Exception:
            return False
        return self._identity_error(md.metadata or {}, cell_id) is None and (
            meta is None or not meta.prompts or md.num_rows == meta.prompts
        )

    def _identity_error(self, kv: dict, cell_id: str) -> str | None:
        stored = kv.get(CELL_KEY, b"").decode(errors="replace")
        if stored != cell_id:
            return f"it holds cell {stored or '?'!r}, not {cell_id!r}"
        run = kv.get(RUN_KEY)
        if run is not None and self.manifest is not None and run.decode(errors="replace") != self.manifest.comparable():
            return "it belongs to another sweep"
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

    def read_table(self, cell_id: str, columns: list[str] | None = None) -> pa.Table:
        """A done cell's records, checked: readable, every record column present, its own cell id
        (file metadata and rows) and this run's identity. Anything else is a corrupt cell (exit 2)."""
        path = self.cell_path(cell_id)
        try:
            pf = pq.ParquetFile(path)
            table = pf.read(columns=columns)
        except FileNotFoundError:
            raise DetauditError(
                f"cell {cell_id} is marked done but its file {path} is missing; rerun the sweep to recompute it"
            ) from None
        except Exception as e:
            raise DetauditError(
                f"cell file {path} is unreadable or truncated ({type(e).__name__}); rerun the sweep to recompute it"
            ) from None
        missing = [c for c in (columns or COLUMNS) if c not in table.column_names]
        if missing:
            raise DetauditError(f"cell file {path} is corrupt: it lacks columns {', '.join(missing)}")
        why = self._identity_error(pf.schema_arrow.metadata or {}, cell_id)
        if why is None and "cell_id" in table.column_names:
            ids = set(table.column("cell_id").to_pylist())
            if ids - {cell_id}:
                why = f"its rows belong to cell {sorted(map(str, ids - {cell_id}))[0]!r}"
        if why:
            raise DetauditError(f"cell file {path} is corrupt: {why}; rerun the sweep to recompute it")
        return table

    def read_cell(self, cell_id: str) -> pd.DataFrame:
        return self.read_table(cell_id).to_pandas()


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
