"""The run directory: `manifest.json` plus one Parquet file per cell under `cells/`.

Every file is written atomically (temporary file in the same directory, fsync, `os.replace`), so a
killed sweep never leaves a partial file that could be read as a result. A cell's Parquet file is
written before the manifest records it as done; on resume a valid cell file is the authority, so a
completed cell is never recomputed. A lock file (`fcntl.flock`, released by the kernel when the
holder dies) refuses a second sweep into the same directory.
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
from detaudit.records import COLUMNS, SCHEMA

MANIFEST = "manifest.json"
CELLS = "cells"
LOCK = ".lock"
FORMAT_VERSION = 1


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def atomic_write_bytes(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
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
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise DetauditError(f"cannot write {path}: {e.strerror} (nothing already written was lost)") from None
        raise


def atomic_write_json(path: Path, obj: Any) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=2, sort_keys=True, default=str) + "\n").encode())


class RunDir:
    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None
        self.manifest: dict[str, Any] = {}

    # ---- paths
    @property
    def manifest_path(self) -> Path:
        return self.path / MANIFEST

    def cell_path(self, cell_id: str) -> Path:
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
            holder = self._lock_holder()
            raise DetauditError(
                f"another sweep is writing to {self.path}{holder}; wait for it or use another --output-path"
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

    def load(self) -> dict[str, Any]:
        try:
            self.manifest = json.loads(self.manifest_path.read_text())
        except FileNotFoundError:
            raise DetauditError(f"{self.path} is not a detaudit run directory (no {MANIFEST})") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DetauditError(f"{self.manifest_path} is corrupt: {e}") from None
        if not isinstance(self.manifest, dict) or "cells" not in self.manifest or "config" not in self.manifest:
            raise DetauditError(f"{self.manifest_path} is not a detaudit manifest (missing config/cells)")
        return self.manifest

    def save(self) -> None:
        self.manifest["updated"] = now()
        atomic_write_json(self.manifest_path, self.manifest)

    def init_or_check(self, manifest: dict[str, Any]) -> list[str]:
        """Start a new manifest, or check that the existing one is the same sweep (same comparable
        key) and add any new cells to it. Returns the ids of cells already complete."""
        if self.exists():
            old = self.load()
            if old.get("comparable_key") != manifest["comparable_key"]:
                raise DetauditError(
                    f"{self.path} holds a different sweep (model, suites, decoding or dtype differ); "
                    "use another --output-path"
                )
            for cid, meta in manifest["cells"].items():
                old["cells"].setdefault(cid, meta)
            old["environment_history"] = old.get("environment_history", []) + [manifest["environment"]]
            for key in ("backends",):
                old.setdefault(key, {}).update(manifest.get(key, {}))
            self.manifest = old
        else:
            self.manifest = manifest
            self.manifest["created"] = now()
            self.manifest["format_version"] = FORMAT_VERSION
        done = []
        for cid, meta in self.manifest["cells"].items():
            if self.cell_is_valid(cid, meta):
                if meta.get("state") != "done":
                    meta.update(state="done", recovered=True)
                done.append(cid)
            elif meta.get("state") == "done":
                meta.update(state="pending", error="cell file missing or corrupt; recomputed")
        self.save()
        return done

    # ---- cells
    def cell_is_valid(self, cell_id: str, meta: dict[str, Any] | None = None) -> bool:
        path = self.cell_path(cell_id)
        if not path.exists():
            return False
        try:
            md = pq.read_metadata(path)
            kv = md.metadata or {}
            if kv.get(b"detaudit.cell_id", b"").decode() != cell_id:
                return False
            expected = meta.get("prompts") if meta else None
            return expected is None or md.num_rows == expected
        except Exception:
            return False

    def write_cell(self, cell_id: str, rows: list[dict[str, Any]], meta: dict[str, Any]) -> None:
        table = pa.Table.from_pylist(rows, schema=SCHEMA)
        table = table.replace_schema_metadata({"detaudit.cell_id": cell_id})
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink, compression="zstd")
        atomic_write_bytes(self.cell_path(cell_id), sink.getvalue().to_pybytes())
        self.manifest["cells"][cell_id].update(meta, state="done", prompts=len(rows), error=None)
        self.save()

    def mark(self, cell_id: str, state: str, **meta: Any) -> None:
        self.manifest["cells"][cell_id].update(meta, state=state)
        self.save()

    def read_cell(self, cell_id: str) -> pd.DataFrame:
        path = self.cell_path(cell_id)
        try:
            table = pq.read_table(path)
        except Exception as e:
            raise DetauditError(f"cell file {path} is unreadable or truncated ({type(e).__name__}); "
                                f"rerun the sweep to recompute it") from None
        missing = [c for c in COLUMNS if c not in table.column_names]
        if missing:
            raise DetauditError(f"cell file {path} lacks columns {', '.join(missing)}")
        return table.to_pandas()


def load_run(path: str | os.PathLike) -> tuple[dict[str, Any], pd.DataFrame]:
    """Manifest and the records of every completed cell (a DataFrame with the record columns)."""
    run = RunDir(path)
    if not run.path.is_dir():
        raise DetauditError(f"run directory {run.path} does not exist")
    manifest = run.load()
    frames = [run.read_cell(cid) for cid, meta in sorted(manifest["cells"].items()) if meta.get("state") == "done"]
    records = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=COLUMNS)
    return manifest, records
