"""The typed, versioned run manifest and its schema check.

`Manifest.from_dict` validates every field it reads (a hand-edited or corrupted manifest is one line
and exit 2, never a traceback); `to_dict` writes format version 2. Version 1 manifests (written
before this module) have the same keys and read unchanged. Unknown top-level keys are kept.

`comparable()` is the one identity check: resume, merge and `gate --baseline` all compare it.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any

from detaudit.config import (
    TP_MODES,
    Cell,
    DecodingParams,
    EngineSettings,
    ServerConfig,
    SweepConfig,
    check_grid_size,
    parse_speculative,
)
from detaudit.errors import DetauditError

FORMAT_VERSION = 2
STATES = ("pending", "done", "failed")
MAX_PROMPTS = 10**12  # a cell's recorded prompt count
MAX_CELL_ID = 200  # characters: `<id>.parquet` stays under every filesystem's 255-byte name limit
# suite__backend__tpN__bsN, optionally followed by a speculative setting (`__ngram4`, `__draft4-NAME`) and
# load suffixes (server cells): never a path
CELL_ID_RE = re.compile(
    r"^[A-Za-z0-9][A-Za-z0-9_.-]*__[A-Za-z0-9][A-Za-z0-9_.-]*__tp[0-9]{1,2}__bs[0-9]{1,6}"
    r"(__[a-z]+[0-9]{1,7}(-[A-Za-z0-9][A-Za-z0-9.-]{0,47})?)*$"
)


def check_cell_id(cell_id: Any, where: str) -> str:
    if not isinstance(cell_id, str) or len(cell_id) > MAX_CELL_ID or not CELL_ID_RE.fullmatch(cell_id):
        raise DetauditError(
            f"{where}: {str(cell_id)[:80]!r} is not a detaudit cell id (corrupt or hand-edited manifest)"
        )
    return cell_id


def _bad(where: str, key: str, want: str, value: Any) -> DetauditError:
    return DetauditError(f"{where}: field {key!r} must be {want}, got {type(value).__name__} {str(value)[:60]!r}")


def _get(d: dict, key: str, kind: type | tuple, where: str, default: Any = None, required: bool = False) -> Any:
    if key not in d or d[key] is None:
        if required:
            raise DetauditError(f"{where}: required field {key!r} is missing")
        return default
    v = d[key]
    ok = isinstance(v, kind) and not (
        isinstance(v, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,))
    )
    if not ok:
        names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
        raise _bad(where, key, f"a {names}", v)
    return v


def _list_of(d: dict, key: str, kind: type, where: str) -> list:
    v = _get(d, key, list, where, default=[])
    for x in v:
        if not isinstance(x, kind) or isinstance(x, bool):
            raise _bad(where, key, f"a list of {kind.__name__}", v)
    return v


def _dict_of_dicts(d: dict, key: str, where: str) -> dict[str, dict]:
    v = _get(d, key, dict, where, default={})
    for k, x in v.items():
        if not isinstance(x, dict):
            raise _bad(where, f"{key}.{k}", "a mapping", x)
    return v


@dataclass
class CellMeta:
    """One cell's coordinates and state; `extra` holds timings and other recorded facts."""

    backend: str
    tp: int
    batch_size: int
    suite: str
    tp_mode: str = "real"
    engine: str = "builtin"
    state: str = "pending"
    prompts: int = 0
    error: str | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, cell_id: str, d: Any, where: str) -> "CellMeta":
        """Field types and values; `Manifest.from_dict` then checks the coordinates against the id and
        the grid."""
        w = f"{where}: cell {str(cell_id)[:80]}"
        if not isinstance(d, dict):
            raise DetauditError(f"{w} is not a mapping")
        meta = cls(
            backend=_get(d, "backend", str, w, required=True),
            tp=_get(d, "tp", int, w, required=True),
            batch_size=_get(d, "batch_size", int, w, required=True),
            suite=_get(d, "suite", str, w, required=True),
            tp_mode=_get(d, "tp_mode", str, w, "real"),
            engine=_get(d, "engine", str, w, "builtin"),
            state=_get(d, "state", str, w, "pending"),
            prompts=_get(d, "prompts", int, w, 0),
            error=_get(d, "error", str, w),
            extra={k: v for k, v in d.items() if k not in _CELL_FIELDS},
        )
        if meta.state not in STATES:
            raise _bad(w, "state", f"one of {', '.join(STATES)}", meta.state)
        if meta.tp_mode not in TP_MODES:
            raise _bad(w, "tp_mode", f"one of {', '.join(TP_MODES)}", meta.tp_mode)
        if not 0 <= meta.prompts <= MAX_PROMPTS:
            raise _bad(w, "prompts", f"a count between 0 and {MAX_PROMPTS}", meta.prompts)
        for key in ("wall_s", "engine_start_s", "generate_s"):
            if key in meta.extra and meta.extra[key] is not None:
                v = _get(meta.extra, key, (int, float), w)
                if not (-1e15 < v < 1e15):  # NaN too; a 4000-digit int must never reach float()
                    raise _bad(w, key, "a finite number of seconds", v)
        return meta

    def to_dict(self) -> dict:
        return {**self.extra, **{f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}}

    def update(self, **values: Any) -> None:
        for k, v in values.items():
            if k in _CELL_FIELDS:
                setattr(self, k, v)
            else:
                self.extra[k] = v

    def finish(self, meta: dict, prompts: int) -> None:
        self.update(**meta, state="done", prompts=prompts, error=None)


_CELL_FIELDS = {f.name for f in fields(CellMeta)} - {"extra"}


@dataclass
class Manifest:
    config: dict  # the sweep as configured (SweepConfig.to_dict() + shard)
    identity: dict  # what must match for runs to be comparable (on disk: "comparable")
    cells: dict[str, CellMeta]
    model: dict = field(default_factory=dict)  # name, path, architecture, checksum (or the server's identity)
    suites: dict[str, dict] = field(default_factory=dict)  # checksum, source, prompts, ungraded
    environment: dict = field(default_factory=dict)
    hardware_key: str = ""
    command: str = ""
    code_version: str = ""
    git_hash: str | None = None
    backends: dict[str, dict] = field(default_factory=dict)  # engine.describe() per (backend, TP[, batch])
    speculative: dict[str, dict] = field(default_factory=dict)  # label -> Speculative.describe() (not off)
    executor: dict = field(default_factory=dict)
    created: str = ""
    updated: str = ""
    environment_history: list = field(default_factory=list)
    # merged runs
    merged_from: list = field(default_factory=list)
    mixed_hardware: bool = False
    hardware_keys: list = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # keys this version does not know, kept as they were

    # ---- identity
    def comparable(self) -> str:
        """Hash of the identity: two runs are comparable (resume, merge, baseline) iff equal."""
        return hashlib.sha256(json.dumps(self.identity, sort_keys=True, default=str).encode()).hexdigest()[:16]

    def differences(self, other: "Manifest") -> list[str]:
        keys = sorted(set(self.identity) | set(other.identity))
        return [k for k in keys if self.identity.get(k) != other.identity.get(k)]

    @property
    def model_name(self) -> str:
        return str(self.model.get("name") or self.config.get("model") or "?")

    def tp_mode(self, tp: int) -> str:
        return "emulated" if (self.config.get("tp_mode") == "emulated" and tp > 1) else "real"

    def done_cells(self) -> list[str]:
        return [cid for cid, m in self.cells.items() if m.state == "done"]

    def grid(self, where: str = "manifest") -> dict[str, Cell]:
        """The configured grid (cell id -> Cell), its axes validated as a sweep's are."""
        return _grid(self.config, f"{where}: config")

    # ---- disk
    @classmethod
    def from_dict(cls, d: Any, where: str = "manifest") -> "Manifest":
        if not isinstance(d, dict):
            raise DetauditError(f"{where} is not a detaudit manifest (not a mapping)")
        if "cells" not in d or "config" not in d:
            raise DetauditError(f"{where} is not a detaudit manifest (missing config/cells)")
        version = _get(d, "format_version", int, where, 1)
        if version > FORMAT_VERSION:
            raise DetauditError(
                f"{where} has format version {version}; this detaudit reads up to {FORMAT_VERSION} (upgrade it)"
            )
        config = _config(_get(d, "config", dict, where, required=True), where)
        raw_cells = _get(d, "cells", dict, where, required=True)
        cells = {check_cell_id(cid, where): CellMeta.from_dict(cid, meta, where) for cid, meta in raw_cells.items()}
        known = {f.name for f in fields(cls)} | {"comparable", "comparable_key", "format_version"}
        m = cls(
            config=config,
            identity=_get(d, "comparable", dict, where, {}),
            cells=cells,
            model=_get(d, "model", dict, where, {}),
            suites=_dict_of_dicts(d, "suites", where),
            environment=_get(d, "environment", dict, where, {}),
            hardware_key=_get(d, "hardware_key", str, where, ""),
            command=_get(d, "command", str, where, ""),
            code_version=_get(d, "code_version", str, where, ""),
            git_hash=_get(d, "git_hash", str, where),
            backends=_dict_of_dicts(d, "backends", where),
            speculative=_dict_of_dicts(d, "speculative", where),
            executor=_get(d, "executor", dict, where, {}),
            created=_get(d, "created", str, where, ""),
            updated=_get(d, "updated", str, where, ""),
            environment_history=_get(d, "environment_history", list, where, []),
            merged_from=_list_of(d, "merged_from", str, where),
            mixed_hardware=_get(d, "mixed_hardware", bool, where, False),
            hardware_keys=_list_of(d, "hardware_keys", str, where),
            extra={k: v for k, v in d.items() if k not in known},
        )
        for key in ("name", "path", "architecture", "checksum"):
            _get(m.model, key, str, f"{where}: model")
        recorded, identity = m.model.get("checksum"), m.identity.get("model_checksum")
        if recorded is not None and identity is not None and recorded != identity:
            raise DetauditError(
                f"{where}: model checksum {recorded[:16]!r} is not the run identity's {str(identity)[:16]!r} "
                "(corrupt or hand-edited manifest)"
            )
        _check_cells(m, where)
        return m

    def to_dict(self) -> dict:
        out = dict(self.extra)
        for f in fields(self):
            if f.name in ("extra", "identity", "cells"):
                continue
            out[f.name] = getattr(self, f.name)
        out.update(
            format_version=FORMAT_VERSION,
            comparable=self.identity,
            comparable_key=self.comparable(),
            cells={cid: m.to_dict() for cid, m in self.cells.items()},
        )
        return out


def _config(c: dict, where: str) -> dict:
    """Every recorded SweepConfig field present is checked against its declared type (lists for tuples;
    a null list reads as empty; the engine settings flattened as `SweepConfig.to_dict` writes them);
    keys of other versions are kept as they are."""
    import dataclasses
    import typing

    w = f"{where}: config"
    c = dict(c)
    hints = {k: v for k, v in typing.get_type_hints(SweepConfig).items() if k != "engine"}
    hints.update((k, v) for k, v in typing.get_type_hints(EngineSettings).items() if k != "name")
    hints["engine"] = str
    for name, t in hints.items():
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) is tuple:
            if name in c:
                c[name] = _list_of(c, name, typing.get_args(t)[0], w)
        elif t is float:
            _get(c, name, (int, float), w)
        elif t in (str, bool, int, dict):
            _get(c, name, t, w)
        elif dataclasses.is_dataclass(t) or any(dataclasses.is_dataclass(a) for a in args):
            _get(c, name, dict, w)  # nested dataclasses (decoding, server) are stored as mappings
        elif args:  # X | None
            _get(c, name, tuple(args), w)
        else:
            _get(c, name, dict, w)
    shard = _get(c, "shard", list, w)
    if shard is not None and (
        len(shard) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) for x in shard)
    ):
        raise _bad(w, "shard", "[I, N]", shard)
    # the values, as the sweep that wrote them checked them (a temperature "hot", a device "tpu", a dtype
    # "float8" is no sweep's): the typed objects are built from what the manifest holds
    _typed(DecodingParams, c.get("decoding"), f"{w}.decoding")
    server = _typed(ServerConfig, c.get("server"), f"{w}.server") if c.get("server") else None
    flat = {k: c[k] for k in ("dtype", "device", "cuda_graphs", "hang_timeout") if c.get(k) is not None}
    _typed(EngineSettings, {**flat, "server": server}, w, built={"server"})
    return c


def _typed(cls: type, d: Any, where: str, built: frozenset | set = frozenset()) -> Any:
    """`cls` (a config dataclass) built from a manifest's mapping: each field present checked against its
    declared type, then the class's own checks of the values (`__post_init__`); keys of other versions
    are left out. A value no sweep writes is one line naming the field."""
    import dataclasses
    import typing

    if d is None:
        return None
    if not isinstance(d, dict):
        raise DetauditError(f"{where} must be a mapping, got {type(d).__name__}")
    hints = typing.get_type_hints(cls)
    values = {}
    for f in dataclasses.fields(cls):
        if f.name not in d or d[f.name] is None and f.name not in built:
            continue
        v, t = d[f.name], hints[f.name]
        if f.name not in built:
            args = [a for a in typing.get_args(t) if a is not type(None)]
            kind = args[0] if len(args) == 1 and typing.get_origin(t) is not tuple else t
            if typing.get_origin(kind) is tuple:
                if not isinstance(v, list) or not all(isinstance(x, typing.get_args(kind)[0]) for x in v):
                    raise _bad(where, f.name, f"a list of {typing.get_args(kind)[0].__name__}", v)
                v = tuple(v)
            elif kind is float:
                _get(d, f.name, (int, float), where)
                if not -1e300 < v < 1e300:  # NaN too; a 4000-digit int must never reach float()
                    raise _bad(where, f.name, "a finite number", v)
            elif kind in (int, str, bool):
                _get(d, f.name, kind, where)
        values[f.name] = v
    try:
        return cls(**values)
    except (DetauditError, TypeError, ValueError, OverflowError) as e:
        raise DetauditError(f"{where}: {e} (corrupt or hand-edited manifest)") from None


GRID_AXES = ("suites", "backends", "tp", "batch_sizes", "background_load", "speculative")
# what a config without the axis (written before it existed) ran
GRID_DEFAULTS: dict[str, list] = {"background_load": [0], "speculative": ["off"]}


def _axis_key(key: str, value: Any) -> Any:
    """What makes two values of an axis one coordinate: a speculative setting's cell-id label (one draft
    model given by two paths is one setting; the identity holds its checksum)."""
    if key == "speculative" and isinstance(value, str):
        try:
            return parse_speculative(value).label
        except DetauditError:
            return value
    return value


def widen_grid(config: dict, *others: dict) -> None:
    """Add to `config`'s grid axes the values of `others` it lacks (a resumed sweep that adds TP sizes, a
    merge of shards or of runs of other batch sizes): every recorded cell stays inside the grid."""
    for key in GRID_AXES:
        values = list(config.get(key) or GRID_DEFAULTS.get(key, []))
        for other in others:
            have = {_axis_key(key, v) for v in values}
            values += [v for v in other.get(key) or GRID_DEFAULTS.get(key, []) if _axis_key(key, v) not in have]
        if values:
            config[key] = values


def _grid(c: dict, w: str) -> dict[str, Cell]:
    axes = {key: c.get(key) or GRID_DEFAULTS.get(key, []) for key in GRID_AXES}
    try:
        check_grid_size(*axes.values())  # before any cell is built: a few bytes can declare millions
        cfg = SweepConfig(
            model="-",
            **{k: tuple(v) for k, v in axes.items()},
            limit=c.get("limit"),
            tp_mode="real" if c.get("tp_mode") is None else c["tp_mode"],
            repeats=1 if c.get("repeats") is None else c["repeats"],
        )
    except DetauditError as e:
        raise DetauditError(f"{w}: {e} (corrupt or hand-edited manifest)") from None
    return {check_cell_id(cell.id, w): cell for cell in cfg.cells()}


def _check_cells(m: Manifest, where: str) -> None:
    """A cell's coordinates come from one place: its id. Each entry's backend, TP size, batch size and
    suite must give its id back, the cell must be in the configured grid and of the run's engine; a
    contradiction (a hand-edited `tp: 3` under a `tp1` id) is refused, never analysed as another cell."""
    grid = m.grid(where)
    engine = m.config.get("engine")
    for cid, meta in m.cells.items():
        cell = Cell.recorded(cid, meta.backend, meta.tp, meta.batch_size, meta.suite)
        if cell.id != cid:
            raise DetauditError(
                f"{where}: cell {cid} records backend {meta.backend[:40]!r}, tp {str(meta.tp)[:20]}, batch size "
                f"{str(meta.batch_size)[:20]}, suite {meta.suite[:40]!r}: not the cell its id names "
                "(corrupt or hand-edited manifest)"
            )
        if cid not in grid:
            raise DetauditError(
                f"{where}: cell {cid} is not in the configured grid (config: suites, backends, tp, batch_sizes); "
                "corrupt or hand-edited manifest"
            )
        if engine is not None and meta.engine != engine:
            raise _bad(f"{where}: cell {cid}", "engine", f"the run's engine {str(engine)[:40]!r}", meta.engine)


# Keys of a backend's description that do not decide its bits: the environment (library versions, the
# GPU), which the manifest's environment and hardware keys already track, and how the all-reduce moves
# the partials (all-gather or all-to-all: the same additions). Every other key describes how it computes.
ENVIRONMENT_KEYS = frozenset({"torch", "cuda", "gpu", "triton", "all_reduce_impl", "tree_all_reduce_impl"})


def numerics(describe: dict | None) -> dict:
    """How an engine's cells were computed, from its description (`backend` part, environment keys out)."""
    backend = (describe or {}).get("backend")
    return {k: v for k, v in backend.items() if k not in ENVIRONMENT_KEYS} if isinstance(backend, dict) else {}


def speculative_conflicts(recorded: dict[str, dict], new: dict[str, dict]) -> list[str]:
    """Speculative settings of one label (one cell-id coordinate) that draft otherwise: a draft model of
    another checksum (the label names the draft by its directory, so a checksum is what tells two drafts
    apart), or an n-gram lookup of other suffix lengths (`ngram_max`, as another detaudit version records
    it). Cells of one id computed with two proposers: their acceptance, and under bf16 their output, may
    differ."""
    short = lambda d: str(d.get("checksum"))[:12]  # noqa: E731
    out = []
    for label in sorted(set(recorded) & set(new)):
        a, b = recorded[label], new[label]
        if a.get("checksum") != b.get("checksum"):
            out.append(f"{label} (draft checksum {short(a)} vs {short(b)})")
        elif "ngram_max" in a and "ngram_max" in b and a["ngram_max"] != b["ngram_max"]:
            out.append(f"{label} (n-gram lookup of up to {a['ngram_max']} vs {b['ngram_max']} tokens)")
    return out


def numerics_conflicts(recorded: dict[str, dict], new: dict[str, dict]) -> list[str]:
    """Keys of `new` (backend@tp -> engine description) whose numerics differ from what `recorded` holds
    for the same key, each with the fields that differ: cells of one run computed two ways (a resumed or
    merged run made by another detaudit version whose kernels compute differently)."""
    out = []
    for key in sorted(set(recorded) & set(new)):
        a, b = numerics(recorded[key]), numerics(new[key])
        if a and b and a != b:
            out.append(f"{key} ({', '.join(sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k)))})")
    return out
