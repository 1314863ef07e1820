"""Suites: lm-eval task YAML -> prompts; the model's chat template (or plain text) -> prompt token ids.

A suite is an lm-evaluation-harness task file, read as lm-eval reads it (`detaudit.inputs.suite_yaml` parses
it and says which keys are used, ignored or refused). The built-in suites (`smoke`, `quote`, `aime24`, `amc23`)
live in the repository's `suites/` (shipped in the wheel as package data); any other YAML is passed
by path.

    task: aime24                       # the suite name (also used in cell ids and file names)
    dataset_path: HuggingFaceH4/aime_2024   # or json / csv / parquet with dataset_kwargs.data_files
    dataset_name: null                 # optional hub config
    dataset_kwargs: {}                 # data-selection keys only (data_files relative to the YAML)
    test_split: train
    local_file: aime24.jsonl           # detaudit: the same rows in a local mirror (`--data-dir`)
    doc_to_text: "{{problem}}\\n\\nPlease reason step by step, ..."   # or a bare column name
    doc_to_target: "{{answer}}"        # optional; without it prompts are ungraded
    doc_to_id: "{{id}}"                # detaudit: optional; defaults to the row index
    apply_chat_template: true          # detaudit: prompts in the model's chat template unless the
                                       # command line says otherwise (lm-eval's default: plain text)
    generation_kwargs: {until: [...], max_gen_toks: 256, do_sample: false}   # detaudit.decoding (left
                                       # out: lm-eval's defaults, greedy until "\\n\\n")
    metadata: {version: 1.0, description: "..."}

Rows come from an inline `docs:` list (detaudit), from `<data_dir>/<local_file>` when a data dir is
given and the suite names a `local_file` (JSON lines, each line validated so errors name it), from the
suite's own local files (`dataset_path: json | csv | parquet ...` with `data_files`: JSON is parsed here,
line by line; other formats stream through `datasets`; nothing is cached), or from a hub dataset
(`datasets.load_dataset(dataset_path, dataset_name, split=test_split, **dataset_kwargs)`). `limit` is
applied to the rows before anything past it is parsed or rendered. A row whose answer is missing, null
or empty is kept ungraded (`Suite.ungraded` lists its id); a row whose prompt cannot be built is an
error that names the row.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from detaudit import paths
from detaudit.decoding import GenerationKwargs
from detaudit.errors import DetauditError
from detaudit.inputs.suite_paths import TRUST_FLAG, bounded_walk
from detaudit.inputs.suite_render import render_rows
from detaudit.inputs.suite_yaml import Spec, load_spec, no_data_files, one_line
from detaudit.inputs.user_files import decode, load_json, read_regular


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
    generation: GenerationKwargs = field(default_factory=GenerationKwargs)  # its `generation_kwargs`
    apply_chat_template: bool = False  # its default prompt form (the command line may override it)
    # keys of the task file that detaudit accepted but does not use (metric_list, output_type, ...)
    ignored_keys: tuple[str, ...] = ()
    # ids of the prompts whose answer was missing, null or empty although the suite has `doc_to_target`
    ungraded: tuple[str, ...] = ()


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
_COMPRESSED = (".gz", ".bz2", ".xz", ".zst", ".zip", ".lz4", ".tar")


def _jsonl_rows(path: Path, text: str) -> Rows:
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path}, line {lineno}"
        row = load_json(line, where)  # bounded: integer digits, depth (`detaudit.inputs.user_files`)
        if not isinstance(row, dict):
            raise DetauditError(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield where, row


def _json_document_rows(path: Path, text: str, key: str | None) -> Rows:
    """A JSON array of objects (or `field`: the array under that key), as `datasets`' json builder reads
    a file that is not JSON lines."""
    data = load_json(text, str(path))
    if key is not None:
        if not isinstance(data, dict) or key not in data:
            raise DetauditError(f"{path}: `dataset_kwargs.field: {key}` is not a key of the file's top-level object")
        data = data[key]
    if not isinstance(data, list):
        raise DetauditError(f"{path}: expected JSON lines or a JSON array of objects, got a {type(data).__name__}")
    for i, row in enumerate(data):
        if not isinstance(row, dict):
            raise DetauditError(f"{path} [{i}]: expected a JSON object, got {type(row).__name__}")
        yield f"{path} [{i}]", row


@contextlib.contextmanager
def _quiet_datasets():
    """`datasets` without its progress bars (they would break the one-line-per-event logs) and without the
    error line its loaders log before raising (the error is reported once, as one line)."""
    from datasets.utils import logging as ds_logging

    bars, level = ds_logging.is_progress_bar_enabled(), ds_logging.get_verbosity()
    ds_logging.disable_progress_bar()
    ds_logging.set_verbosity(ds_logging.CRITICAL + 10)
    try:
        yield
    finally:
        ds_logging.set_verbosity(level)
        if bars:
            ds_logging.enable_progress_bar()


def _load(spec: Spec, hint: str, **kwargs):
    where = "" if spec.builder else " from the Hugging Face hub"
    try:
        import datasets

        with _quiet_datasets():
            return datasets.load_dataset(spec.dataset_path, spec.dataset_name, split=spec.split, **kwargs)
    except Exception as e:  # offline, unknown id, unknown split, unreadable file, ...
        raise DetauditError(
            f"suite {spec.name}: could not load {spec.dataset_path} (split {spec.split}){where} "
            f"({type(e).__name__}: {one_line(e)[:200]}); {hint}"
        ) from None


def _hint(spec: Spec) -> str:
    if spec.local_file:
        return f"pass --data-dir (or set DETAUDIT_DATA_DIR) to a directory holding {spec.local_file}"
    if spec.builder:
        return "check `dataset_kwargs` (data_files are read relative to the YAML's directory)"
    return "this suite has no `local_file` for a local mirror"


def _hub_rows(spec: Spec, limit: int | None) -> tuple[bytes, str, Rows]:
    """Rows through `datasets.load_dataset` (cached where `datasets` caches), as lm-eval loads them; the
    checksum is the dataset's fingerprint."""
    kwargs = dict(spec.dataset_kwargs)
    if spec.data_files is not None:
        kwargs["data_files"] = spec.data_files
    ds = _load(spec, _hint(spec), **kwargs)
    if not hasattr(ds, "select") or not hasattr(ds, "column_names"):
        raise DetauditError(
            f"suite {spec.name}: {spec.dataset_path} did not load as one split (got {type(ds).__name__})"
        )
    data = (
        str(getattr(ds, "_fingerprint", ""))
        or hashlib.sha256(json.dumps(ds.to_list(), sort_keys=True, default=str).encode()).hexdigest()
    ).encode()
    if limit is not None and limit < len(ds):
        ds = ds.select(range(limit))
    where = f"{spec.dataset_path} [{spec.split}]"
    source = f"dataset:{spec.dataset_path}" if spec.builder else f"hub:{spec.dataset_path}"
    return data, source, ((f"{where} row {i}", dict(row)) for i, row in enumerate(ds))


def _streamed_rows(spec: Spec, files: list[Path] | None) -> Rows:
    """Local files in a format detaudit does not parse itself (csv, parquet, ...): `datasets` streams them,
    so rows are read as they are needed and nothing is cached; even its builder's lock file goes to a
    temporary directory that is gone once the rows are read."""
    kwargs = dict(spec.dataset_kwargs)
    if files is not None:
        kwargs["data_files"] = {spec.split: [str(f) for f in files]}
    where = f"{spec.dataset_path} [{spec.split}]"
    try:
        with tempfile.TemporaryDirectory(prefix="detaudit-datasets-") as scratch, _quiet_datasets():
            ds = _load(spec, _hint(spec), streaming=True, cache_dir=scratch, **kwargs)
            for i, row in enumerate(ds):
                yield f"{where} row {i}", dict(row)
    except DetauditError:
        raise
    except Exception as e:  # a malformed row of the file
        raise DetauditError(
            f"suite {spec.name}: could not read {where} ({type(e).__name__}: {one_line(e)[:200]})"
        ) from None


def _builder_rows(spec: Spec, limit: int | None) -> tuple[bytes, str, Rows]:
    """Rows of the suite's own files (`dataset_path: json | csv | parquet ...`). Local files: the checksum
    covers their bytes; JSON (lines or an array) is parsed here, lazily; nothing is cached anywhere."""
    files: list[Path] | None = None
    if spec.data_files is not None:
        if spec.split not in spec.data_files:
            raise DetauditError(
                f"suite {spec.name}: {spec.path}: split {spec.split!r} is not in `dataset_kwargs.data_files` (it "
                f"has {', '.join(spec.data_files)}; a file name or a list of them is the split `train`)"
            )
        chosen = spec.data_files[spec.split]
        if any("://" in f or "::" in f for f in chosen):
            return _hub_rows(spec, limit)  # remote files: `datasets` downloads and caches them
        files = [Path(f) for f in chosen]
        listed = files
    else:
        data_dir = spec.dataset_kwargs.get("data_dir", "")
        if "://" in data_dir or "::" in data_dir:
            return _hub_rows(spec, limit)
        walked = bounded_walk(Path(data_dir), f"`dataset_kwargs.data_dir: {data_dir}`", spec.path)
        listed = [p for p in walked if p.is_file()]
    parse_here = spec.dataset_path == "json" and files is not None and not any(f.suffix in _COMPRESSED for f in files)
    digest = hashlib.sha256()
    raws = {}
    for f in listed:
        raw = read_regular(f, "data file")
        digest.update(f.name.encode() + b"\0" + raw + b"\0")
        if parse_here:
            raws[f] = raw
    source = f"dataset:{spec.dataset_path}"
    if parse_here:
        return digest.hexdigest().encode(), source, _json_rows(spec, files, raws)
    return digest.hexdigest().encode(), source, _streamed_rows(spec, files)


def _json_rows(spec: Spec, files: list[Path], raws: dict[Path, bytes]) -> Rows:
    key = spec.dataset_kwargs.get("field")
    for f in files:
        text = decode(f, raws[f], "data file")
        if key is not None or text.lstrip().startswith("["):
            yield from _json_document_rows(f, text, key)
        else:
            yield from _jsonl_rows(f, text)


def _mirror_file(spec: Spec, data_dir: Path, trust_paths: bool) -> Path:
    """`<data_dir>/<local_file>`, which must resolve inside the data dir: a mirror is shared like data, and a
    symlink in it must not make a sweep read (and record as prompts) a file from elsewhere on the machine."""
    file = data_dir / spec.local_file
    if not file.exists():
        raise DetauditError(f"suite {spec.name}: data dir {data_dir} has no {spec.local_file}")
    resolved, root = file.resolve(), data_dir.resolve()
    if not trust_paths and not resolved.is_relative_to(root):
        raise DetauditError(
            f"suite {spec.name}: {file} resolves to {resolved}, outside the data dir {root} (copy the file into "
            f"the data dir, or pass {TRUST_FLAG})"
        )
    return file


def _rows(spec: Spec, data_dir: Path | None, limit: int | None, trust_paths: bool) -> tuple[bytes, str, Rows]:
    if spec.docs is not None:
        return b"", "inline", ((f"{spec.path} docs[{i}]", d) for i, d in enumerate(spec.docs))
    if data_dir is not None and spec.local_file:
        data_dir = Path(data_dir).expanduser()
        if not data_dir.is_dir():
            raise DetauditError(
                f"data dir {data_dir} does not exist or is not a directory (from --data-dir / DETAUDIT_DATA_DIR)"
            )
        file = _mirror_file(spec, data_dir, trust_paths)
        raw = read_regular(file, "data file")
        return raw, f"mirror:{spec.local_file}", _jsonl_rows(file, decode(file, raw, "data file"))
    if not spec.dataset_path:
        raise DetauditError(
            f"suite {spec.name}: {spec.path} has no `dataset_path`; pass --data-dir (or set DETAUDIT_DATA_DIR) "
            f"to a directory holding {spec.local_file}"
        )
    if spec.builder and spec.data_files is None and "data_dir" not in spec.dataset_kwargs:
        raise no_data_files(spec.path, spec.dataset_path, spec.local_file)  # rows only from the mirror, not given
    return _builder_rows(spec, limit) if spec.builder else _hub_rows(spec, limit)


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


def load_suite(name: str, data_dir: Path | None = None, limit: int | None = None, trust_paths: bool = False) -> Suite:
    """Load a built-in suite by name, or any suite YAML by path (`.name` is the task name).

    Rows: the YAML's inline `docs`; else `<data_dir>/<local_file>` when a data dir is given and the
    suite has a `local_file`; else its own files or hub dataset. `limit` keeps the first N rows, before
    any of the rest is parsed or rendered (the checksum still covers the whole source, so record the limit
    beside it). Paths the suite names must lie in its directory, and the mirror file in the data dir
    (symlinks resolved), unless `trust_paths`. Every bad input raises a one-line DetauditError.
    """
    if limit is not None and limit < 1:
        raise DetauditError(f"--limit must be >= 1 (got {limit})")
    path = _resolve(name)
    spec = load_spec(path, trust_paths)
    if path.parent.resolve() == paths.builtin_suites_dir().resolve() and spec.name != path.stem:
        raise DetauditError(
            f"{path}: built-in suite `task` must match its file name ({path.stem!r}, got {spec.name!r})"
        )
    data, source, rows = _rows(spec, data_dir, limit, trust_paths)
    rendered, ungraded = render_rows(spec.name, spec.doc_to_text, spec.doc_to_target, spec.doc_to_id, rows, limit)
    if not rendered:
        raise DetauditError(f"suite {spec.name}: no prompts ({source} holds no rows)")
    return Suite(
        name=spec.name,
        path=path,
        prompts=tuple(Prompt(spec.name, i, r.id, r.text, r.answer) for i, r in enumerate(rendered)),
        checksum=hashlib.sha256(spec.raw + b"\0" + data).hexdigest(),
        source=source,
        version=spec.version,
        description=spec.description,
        generation=spec.generation,
        apply_chat_template=bool(spec.apply_chat_template),
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


def has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", "") is not None


def prompt_token_ids(tokenizer, prompt: Prompt, chat: bool = True) -> list[int]:
    """`chat`: the prompt as one user turn in the model's own chat template, with the generation prompt
    (lm-eval's `--apply_chat_template`). Otherwise, and for a tokenizer without a chat template (a base
    model), the plain text tokenized with the tokenizer's own special tokens (lm-eval's default: it leaves
    BOS to the tokenizer)."""
    if not chat or not has_chat_template(tokenizer):
        return _as_id_list(tokenizer(prompt.text))
    messages = [{"role": "user", "content": prompt.text}]
    return _as_id_list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def prompt_hash(token_ids: list[int]) -> str:
    """First 16 hex digits of sha256 over the token ids (comma-separated decimal)."""
    return hashlib.sha256(",".join(str(int(t)) for t in token_ids).encode()).hexdigest()[:16]
