"""Suites: lm-eval task YAML -> prompts; the model's chat template -> prompt token ids.

A suite is an lm-evaluation-harness task file, read as lm-eval reads it (`detaudit.suite_yaml` parses
it and says which keys are used, ignored or refused). The built-in suites (`smoke`, `aime24`, `amc23`)
live in the repository's `suites/` (shipped in the wheel as package data); any other YAML is passed
by path.

    task: aime24                       # the suite name (also used in cell ids and file names)
    dataset_path: HuggingFaceH4/aime_2024   # or json / csv / parquet with dataset_kwargs.data_files
    dataset_name: null                 # optional hub config
    dataset_kwargs: {}                 # passed to datasets.load_dataset (data_files relative to the YAML)
    test_split: train
    local_file: aime24.jsonl           # detaudit: the same rows in a local mirror (`--data-dir`)
    doc_to_text: "{{problem}}\\n\\nPlease reason step by step, ..."   # or a bare column name
    doc_to_target: "{{answer}}"        # optional; without it prompts are ungraded
    doc_to_id: "{{id}}"                # detaudit: optional; defaults to the row index
    generation_kwargs: {...}           # optional, carried along for the sweep
    metadata: {version: 1.0, description: "..."}

Rows come from an inline `docs:` list (detaudit), from `<data_dir>/<local_file>` when a data dir is
given and the suite names a `local_file` (JSON lines, each line validated so errors name it), or from
`datasets.load_dataset(dataset_path, dataset_name, split=test_split, **dataset_kwargs)`. `limit` is
applied to the rows before anything is parsed or rendered. A row whose answer is missing, null or
empty is kept ungraded (`Suite.ungraded` lists its id); a row whose prompt cannot be built is an error
that names the row.
"""

from __future__ import annotations

import glob
import hashlib
import itertools
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from detaudit import paths
from detaudit.errors import DetauditError
from detaudit.suite_yaml import Field, NullField, Spec, decode, load_spec, one_line, read_bytes


@dataclass(frozen=True)
class Prompt:
    suite: str
    index: int  # position in the suite (0-based, before `limit`)
    id: str  # from `doc_to_id`; unique within the suite, seeds per-request sampling
    text: str  # the user message, before the chat template
    answer: str | None  # reference answer from `doc_to_target`; None: ungraded


@dataclass(frozen=True)
class Suite:
    name: str  # the task name (`task:`), whatever the file is called
    path: Path  # the suite YAML
    prompts: tuple[Prompt, ...]
    checksum: str  # sha256 of the YAML bytes (+ includes) + the data file bytes (or the dataset fingerprint)
    source: str  # "inline", "mirror:<file>", "hub:<dataset_path>" or "dataset:<builder>" (json, csv, ...)
    version: str = ""
    description: str = ""
    generation_kwargs: dict = field(default_factory=dict, compare=False, hash=False)
    # keys of the task file that detaudit accepted but does not use (metric_list, output_type, ...)
    ignored_keys: tuple[str, ...] = ()
    # ids of the prompts whose answer was missing, null or empty although the suite has `doc_to_target`
    ungraded: tuple[str, ...] = ()


_PACKAGED_BUILDERS = ("json", "csv", "parquet", "text", "arrow", "pandas", "xml", "sql", "webdataset")


# --------------------------------------------------------------------------------------------
# where suites are


def _builtin() -> dict[str, Path]:
    folder = paths.builtin_suites_dir()
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.glob("*.yaml"))}


def _resolve(name: str) -> Path:
    builtin = _builtin()
    if name in builtin:
        return builtin[name]
    candidate = Path(name).expanduser()
    if name.endswith((".yaml", ".yml")) or candidate.is_file():
        if not candidate.exists():
            raise DetauditError(f"suite file {candidate} does not exist")
        return candidate
    known = ", ".join(builtin) or "(none found in " + str(paths.builtin_suites_dir()) + ")"
    raise DetauditError(f"unknown suite {name!r}; known suites: {known} (or pass the path of a suite YAML file)")


# --------------------------------------------------------------------------------------------
# rows (lazy: nothing past `limit` is parsed)

Rows = Iterator[tuple[str, dict]]


def _jsonl_rows(path: Path, text: str) -> Rows:
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DetauditError(f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise DetauditError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
        yield f"{path}, line {lineno}", row


def _local_data_files(kwargs: dict) -> list[Path] | None:
    """The local files behind `data_files` (globs expanded), or None when any is remote."""
    value = kwargs.get("data_files")
    if value is None or "data_dir" in kwargs:
        return None
    items = (
        [i for v in value.values() for i in (v if isinstance(v, list) else [v])]
        if isinstance(value, dict)
        else (value if isinstance(value, list) else [value])
    )
    out = []
    for item in items:
        if "://" in item:
            return None
        matches = sorted(glob.glob(item)) if glob.has_magic(item) else [item]
        if not matches or not all(Path(m).is_file() for m in matches):
            return None
        out += [Path(m) for m in matches]
    return out


def _dataset_rows(spec: Spec, limit: int | None) -> tuple[bytes, str, Rows]:
    """Rows through `datasets.load_dataset`, as lm-eval loads them. The checksum covers the bytes of
    local `data_files`, else the dataset's fingerprint."""
    builder = spec.dataset_path in _PACKAGED_BUILDERS
    source = f"dataset:{spec.dataset_path}" if builder else f"hub:{spec.dataset_path}"
    files = _local_data_files(spec.dataset_kwargs)
    if builder and "data_files" in spec.dataset_kwargs and files is None and "data_dir" not in spec.dataset_kwargs:
        raise DetauditError(
            f"suite {spec.name}: {spec.path}: `dataset_kwargs.data_files` names no existing file "
            f"({spec.dataset_kwargs['data_files']}; relative names are read from the YAML's directory)"
        )
    if spec.local_file:
        hint = f"pass --data-dir (or set DETAUDIT_DATA_DIR) to a directory holding {spec.local_file}"
    elif builder:
        hint = "check `dataset_kwargs` (data_files are read relative to the YAML's directory)"
    else:
        hint = "this suite has no `local_file` for a local mirror"
    try:
        import datasets
        from datasets.utils import logging as ds_logging

        bars = ds_logging.is_progress_bar_enabled()
        ds_logging.disable_progress_bar()  # "Generating test split: ..." would break the one-line-per-event logs
        try:
            ds = datasets.load_dataset(spec.dataset_path, spec.dataset_name, split=spec.split, **spec.dataset_kwargs)
        finally:
            if bars:
                ds_logging.enable_progress_bar()
    except Exception as e:  # offline, unknown id, unknown split, unreadable file, ...
        where = "" if builder else " from the Hugging Face hub"
        raise DetauditError(
            f"suite {spec.name}: could not load {spec.dataset_path} (split {spec.split}){where} "
            f"({type(e).__name__}: {one_line(e)[:200]}); {hint}"
        ) from None
    if not hasattr(ds, "select") or not hasattr(ds, "column_names"):
        raise DetauditError(
            f"suite {spec.name}: {spec.dataset_path} did not load as one split (got {type(ds).__name__})"
        )
    if files is not None:
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode() + b"\0" + read_bytes(f, "data file") + b"\0")
        data = digest.hexdigest().encode()
    else:
        data = (
            str(getattr(ds, "_fingerprint", ""))
            or hashlib.sha256(json.dumps(ds.to_list(), sort_keys=True, default=str).encode()).hexdigest()
        ).encode()
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    where = f"{spec.dataset_path} [{spec.split}]"
    return data, source, ((f"{where} row {i}", dict(row)) for i, row in enumerate(ds))


def _rows(spec: Spec, data_dir: Path | None, limit: int | None) -> tuple[bytes, str, Rows]:
    if spec.docs is not None:
        return b"", "inline", ((f"{spec.path} docs[{i}]", d) for i, d in enumerate(spec.docs))
    if data_dir is not None and spec.local_file:
        data_dir = Path(data_dir).expanduser()
        if not data_dir.is_dir():
            raise DetauditError(
                f"data dir {data_dir} does not exist or is not a directory (from --data-dir / DETAUDIT_DATA_DIR)"
            )
        file = data_dir / spec.local_file
        if not file.exists():
            raise DetauditError(f"suite {spec.name}: data dir {data_dir} has no {spec.local_file}")
        raw = read_bytes(file, "data file")
        return raw, f"mirror:{spec.local_file}", _jsonl_rows(file, decode(file, raw, "data file"))
    if not spec.dataset_path:
        raise DetauditError(
            f"suite {spec.name}: {spec.path} has no `dataset_path`; pass --data-dir (or set DETAUDIT_DATA_DIR) "
            f"to a directory holding {spec.local_file}"
        )
    return _dataset_rows(spec, limit)


# --------------------------------------------------------------------------------------------
# rendering


class _Missing(Exception):
    """The row lacks a field that the template or column names."""


def _scalar(spec: Spec, f: Field, value: object, label: str) -> str:
    if value is None:
        raise NullField()
    if isinstance(value, (list, dict, tuple)):
        raise DetauditError(
            f"suite {spec.name}: {label}: `{f.key}: {f.source}` is a {type(value).__name__}, not text "
            "(detaudit builds one prompt and grades against one reference answer per row)"
        )
    return str(value)


def _render(spec: Spec, f: Field, row: dict, label: str) -> str:
    """One field of one row, as lm-eval resolves it: a constant, `row[column]`, or the template
    rendered in the sandbox. Raises _Missing / NullField for an absent / null field."""
    import jinja2
    from jinja2.exceptions import SecurityError

    if f.constant is not None:
        return f.constant
    if f.column is not None:
        if f.column not in row:
            raise _Missing(f"{f.column!r} is not a column of the row")
        return _scalar(spec, f, row[f.column], label)
    try:
        return f.template.render(row)
    except SecurityError as e:
        raise DetauditError(
            f"suite {spec.name}: {label}: `{f.key}` is refused by the template sandbox ({one_line(e)[:200]})"
        ) from None
    except jinja2.UndefinedError as e:
        raise _Missing(one_line(e.message)) from None
    except NullField:
        raise
    except Exception as e:
        raise DetauditError(
            f"suite {spec.name}: {label}: `{f.key}` failed: {type(e).__name__}: {one_line(e)[:200]}"
        ) from None


def _text(spec: Spec, f: Field, row: dict, label: str, what: str) -> str:
    try:
        text = _render(spec, f, row, label)
    except _Missing as e:
        fields = ", ".join(map(str, row)) or "none"
        kind = "names a column" if f.column is not None else "uses a field"
        raise DetauditError(
            f"suite {spec.name}: {label}: `{f.key}: {one_line(f.source)[:60]}` {kind} the row lacks ({e}; "
            f"the row has: {fields})"
        ) from None
    except NullField:
        raise DetauditError(f"suite {spec.name}: {label}: `{f.key}` uses a field that is null in this row") from None
    if not text.strip():
        raise DetauditError(f"suite {spec.name}: {label}: `{f.key}` renders {what}")
    return text


def _prompts(spec: Spec, rows: Rows, limit: int | None) -> tuple[list[Prompt], list[str]]:
    prompts, seen, ungraded, absent = [], {}, [], []
    for index, (label, row) in enumerate(itertools.islice(rows, limit)):
        text = _text(spec, spec.doc_to_text, row, label, "an empty prompt")
        pid = str(index)
        if spec.doc_to_id is not None:
            pid = _text(spec, spec.doc_to_id, row, label, "an empty id").strip()
        if pid in seen:
            raise DetauditError(f"suite {spec.name}: {label}: id {pid!r} repeats the id of {seen[pid]}")
        seen[pid] = label
        answer = None
        if spec.doc_to_target is not None:
            try:
                answer = _render(spec, spec.doc_to_target, row, label).strip() or None
            except _Missing as e:
                absent.append((label, str(e), ", ".join(map(str, row)) or "none"))
            except NullField:
                pass
            if answer is None:
                ungraded.append(pid)
        prompts.append(Prompt(suite=spec.name, index=index, id=pid, text=text, answer=answer))
    if prompts and len(absent) == len(prompts):
        label, why, fields = absent[0]
        raise DetauditError(
            f"suite {spec.name}: `doc_to_target: {one_line(spec.doc_to_target.source)[:60]}` names a field no row has "
            f"({label}: {why}; the row has: {fields}); drop `doc_to_target` for an ungraded suite"
        )
    return prompts, ungraded


# --------------------------------------------------------------------------------------------
# public API


def list_suites() -> list[dict]:
    """The built-in suites, for `detaudit suites ls`. `needs_data_dir`: the rows are not inline, so
    without hub access `--data-dir` must point at a directory holding `local_file`."""
    out = []
    for path in _builtin().values():
        spec = load_spec(path)
        inline = spec.docs is not None
        out.append(
            {
                "name": spec.name,
                "description": spec.description,
                "source": "inline" if inline else f"hub:{spec.dataset_path}",
                "dataset_path": spec.dataset_path,
                "local_file": spec.local_file,
                "needs_data_dir": not inline,
                "version": spec.version,
            }
        )
    return out


def load_suite(name: str, data_dir: Path | None = None, limit: int | None = None) -> Suite:
    """Load a built-in suite by name, or any suite YAML by path (`.name` is the task name).

    Rows: the YAML's inline `docs`; else `<data_dir>/<local_file>` when a data dir is given and the
    suite has a `local_file`; else `datasets.load_dataset`. `limit` keeps the first N rows, before any
    of the rest is parsed or rendered (the checksum still covers the whole source, so record the limit
    beside it). Every bad input raises a one-line DetauditError.
    """
    if limit is not None and limit < 1:
        raise DetauditError(f"--limit must be >= 1 (got {limit})")
    path = _resolve(name)
    spec = load_spec(path)
    if path.parent.resolve() == paths.builtin_suites_dir().resolve() and spec.name != path.stem:
        raise DetauditError(
            f"{path}: built-in suite `task` must match its file name ({path.stem!r}, got {spec.name!r})"
        )
    data, source, rows = _rows(spec, data_dir, limit)
    prompts, ungraded = _prompts(spec, rows, limit)
    if not prompts:
        raise DetauditError(f"suite {spec.name}: no prompts ({source} holds no rows)")
    return Suite(
        name=spec.name,
        path=path,
        prompts=tuple(prompts),
        checksum=hashlib.sha256(spec.raw + b"\0" + data).hexdigest(),
        source=source,
        version=spec.version,
        description=spec.description,
        generation_kwargs=spec.generation_kwargs,
        ignored_keys=spec.ignored,
        ungraded=tuple(ungraded),
    )


def _as_id_list(out: object) -> list[int]:
    if isinstance(out, Mapping) or (hasattr(out, "keys") and hasattr(out, "__getitem__")):
        out = out["input_ids"]  # transformers 5: BatchEncoding by default
    if hasattr(out, "tolist"):
        out = out.tolist()
    out = list(out)
    if len(out) == 1 and isinstance(out[0], (list, tuple)):
        out = list(out[0])  # a batch of one
    if not out or not all(isinstance(t, int) and not isinstance(t, bool) for t in out):
        raise DetauditError("the tokenizer's chat template did not return a list of token ids")
    return out


def prompt_token_ids(tokenizer, prompt: Prompt) -> list[int]:
    """The prompt as one user turn in the model's own chat template, with the generation prompt.

    A tokenizer without a chat template (a base model) gets the plain text, tokenized with its
    default special tokens, so that every cell still sees the same ids.
    """
    messages = [{"role": "user", "content": prompt.text}]
    if getattr(tokenizer, "chat_template", "") is None:
        return _as_id_list(tokenizer(prompt.text))
    return _as_id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def prompt_hash(token_ids: list[int]) -> str:
    """First 16 hex digits of sha256 over the token ids (comma-separated decimal)."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()[:16]
