"""Suites: lm-eval style task YAML -> prompts; the model's chat template -> prompt token ids.

A suite is a YAML file in the repository's top-level `suites/` directory (or any YAML path) using
lm-evaluation-harness keys unchanged:

    task: aime24                       # the suite name (also used in cell ids and file names)
    dataset_path: HuggingFaceH4/aime_2024
    dataset_name: null                 # optional hub config
    test_split: train
    local_file: aime24.jsonl           # the same rows in the local mirror (`--data-dir`)
    doc_to_text: "{{problem}}\\n\\nPlease reason step by step, ..."
    doc_to_target: "{{answer}}"        # optional; without it prompts are ungraded
    doc_to_id: "{{id}}"                # optional; defaults to the row index
    generation_kwargs: {...}           # optional, carried along for the sweep
    metadata: {version: 1.0, description: "..."}

Rows come from an inline `docs:` list (for suites written for this project), from
`<data_dir>/<local_file>` (JSON lines, validated line by line so errors name the line), or from the
Hugging Face hub via `datasets.load_dataset(dataset_path, dataset_name, split=test_split)`.
Templates are Jinja2 with strict undefined variables, as in lm-eval: a row that lacks a field a
template uses (or holds null there) is an error that names the row.

(`description` goes under `metadata`: in lm-eval a top-level `description` is text prepended to
every prompt, which this tool does not do.)
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from detaudit.errors import DetauditError

SUITES_DIR = Path(__file__).resolve().parent.parent / "suites"

KNOWN_KEYS = (
    "task", "dataset_path", "dataset_name", "test_split", "local_file", "docs",
    "doc_to_text", "doc_to_target", "doc_to_id", "generation_kwargs", "metadata",
)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # task names end up in cell ids / file names


@dataclass(frozen=True)
class Prompt:
    suite: str
    index: int  # position in the suite (0-based, before `limit`)
    id: str  # from `doc_to_id`; unique within the suite, seeds per-request sampling
    text: str  # the user message, before the chat template
    answer: str | None  # reference answer from `doc_to_target`, None for ungraded suites


@dataclass(frozen=True)
class Suite:
    name: str
    path: Path  # the suite YAML
    prompts: tuple[Prompt, ...]
    checksum: str  # sha256 of the YAML bytes + the data file bytes (or the hub fingerprint)
    source: str  # "inline", "mirror:<file>" or "hub:<dataset_path>"
    version: str = ""
    description: str = ""
    generation_kwargs: dict = field(default_factory=dict, compare=False, hash=False)


# --------------------------------------------------------------------------------------------
# spec (the YAML alone)


@dataclass(frozen=True)
class _Spec:
    path: Path
    raw: bytes
    name: str
    doc_to_text: Any  # compiled jinja2 templates
    doc_to_target: Any | None
    doc_to_id: Any | None
    docs: list | None
    dataset_path: str | None
    dataset_name: str | None
    test_split: str | None
    local_file: str | None
    generation_kwargs: dict
    version: str
    description: str


def _one_line(text: object) -> str:
    return " ".join(str(text).split())


def _read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DetauditError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise DetauditError(f"{what} {path} is a directory, not a file") from None
    except OSError as e:
        raise DetauditError(f"cannot read {what} {path}: {e.strerror or e}") from None


def _decode(path: Path, raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DetauditError(f"cannot read {what} {path}: not UTF-8 text (bad byte at offset {e.start})") from None


def _jinja_env():
    import jinja2

    def finalize(value):
        if value is None:
            raise _NullField()
        return value

    return jinja2.Environment(
        undefined=jinja2.StrictUndefined, keep_trailing_newline=True, autoescape=False, finalize=finalize
    )


class _NullField(Exception):
    """A template printed a field whose value is null."""


def _compile(env, path: Path, key: str, value: object):
    import jinja2

    if not isinstance(value, str) or not value.strip():
        raise DetauditError(f"{path}: `{key}` must be a non-empty template string")
    try:
        return env.from_string(value)
    except jinja2.TemplateSyntaxError as e:
        raise DetauditError(f"{path}: `{key}` is not a valid Jinja2 template: {_one_line(e.message)}") from None


def _load_spec(path: Path) -> _Spec:
    raw = _read_bytes(path, "suite file")
    text = _decode(path, raw, "suite file")
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = getattr(e, "problem", None) or e
        raise DetauditError(f"{path}: malformed YAML{where}: {_one_line(reason)}") from None
    if not isinstance(data, dict):
        raise DetauditError(f"{path}: a suite must be a YAML mapping of keys (task, doc_to_text, ...)")

    unknown = sorted(str(k) for k in data if k not in KNOWN_KEYS)
    if unknown:
        raise DetauditError(f"{path}: unsupported key(s) {', '.join(unknown)}; supported: {', '.join(KNOWN_KEYS)}")
    inline = "docs" in data
    required = ["task", "doc_to_text"] + ([] if inline else ["dataset_path", "test_split"])
    missing = [k for k in required if data.get(k) in (None, "")]
    if missing:
        hint = "" if inline else " (or an inline `docs:` list)"
        raise DetauditError(f"{path}: missing required key(s) {', '.join(missing)}{hint}")

    name = data["task"]
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise DetauditError(f"{path}: `task` must be a name of letters, digits, '_', '-' or '.' (got {name!r})")
    for key in ("dataset_path", "dataset_name", "test_split", "local_file"):
        if data.get(key) is not None and not isinstance(data[key], str):
            raise DetauditError(f"{path}: `{key}` must be a string (got {data[key]!r})")
    local_file = data.get("local_file")
    if local_file is not None and (Path(local_file).name != local_file or local_file in (".", "..")):
        raise DetauditError(f"{path}: `local_file` must be a plain file name (got {local_file!r})")
    docs = data.get("docs")
    if inline and (not isinstance(docs, list) or not all(isinstance(d, dict) for d in docs)):
        raise DetauditError(f"{path}: `docs` must be a list of mappings (one per prompt)")
    gen = data.get("generation_kwargs") or {}
    if not isinstance(gen, dict):
        raise DetauditError(f"{path}: `generation_kwargs` must be a mapping")
    meta = data.get("metadata") or {}
    if not isinstance(meta, dict):
        raise DetauditError(f"{path}: `metadata` must be a mapping (e.g. {{version: 1.0}})")

    env = _jinja_env()
    optional = {
        k: _compile(env, path, k, data[k]) if data.get(k) is not None else None for k in ("doc_to_target", "doc_to_id")
    }
    return _Spec(
        path=path,
        raw=raw,
        name=name,
        doc_to_text=_compile(env, path, "doc_to_text", data["doc_to_text"]),
        doc_to_target=optional["doc_to_target"],
        doc_to_id=optional["doc_to_id"],
        docs=docs,
        dataset_path=data.get("dataset_path"),
        dataset_name=data.get("dataset_name"),
        test_split=data.get("test_split"),
        local_file=local_file,
        generation_kwargs=dict(gen),
        version=str(meta.get("version", "")),
        description=str(meta.get("description", "")),
    )


def _builtin() -> dict[str, Path]:
    if not SUITES_DIR.is_dir():
        return {}
    return {p.stem: p for p in sorted(SUITES_DIR.glob("*.yaml"))}


def _resolve(name: str) -> Path:
    builtin = _builtin()
    if name in builtin:
        return builtin[name]
    candidate = Path(name).expanduser()
    if name.endswith((".yaml", ".yml")) or candidate.is_file():
        if not candidate.exists():
            raise DetauditError(f"suite file {candidate} does not exist")
        return candidate
    known = ", ".join(builtin) or "(none found in " + str(SUITES_DIR) + ")"
    raise DetauditError(f"unknown suite {name!r}; known suites: {known} (or pass the path of a suite YAML file)")


# --------------------------------------------------------------------------------------------
# rows


def _read_jsonl(path: Path) -> tuple[bytes, list[tuple[str, dict]]]:
    """(file bytes, [(row label, row)]); every bad line is reported with its line number."""
    raw = _read_bytes(path, "data file")
    text = _decode(path, raw, "data file")
    rows = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DetauditError(f"{path}, line {lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(row, dict):
            raise DetauditError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append((f"{path}, line {lineno}", row))
    return raw, rows


def _load_hub(spec: _Spec) -> tuple[bytes, list[tuple[str, dict]]]:
    """Rows from the Hugging Face hub; the dataset's fingerprint stands in for the file bytes."""
    mirror_hint = (
        f"pass --data-dir (or set DETAUDIT_DATA_DIR) to a directory holding {spec.local_file}"
        if spec.local_file
        else "this suite has no `local_file` for a local mirror"
    )
    try:
        import datasets

        ds = datasets.load_dataset(spec.dataset_path, spec.dataset_name, split=spec.test_split)
    except Exception as e:  # offline, unknown id, unknown split, ...
        raise DetauditError(
            f"suite {spec.name}: could not load {spec.dataset_path} (split {spec.test_split}) from the "
            f"Hugging Face hub ({type(e).__name__}: {_one_line(e)[:200]}); {mirror_hint}"
        ) from None
    fingerprint = str(getattr(ds, "_fingerprint", "")) or hashlib.sha256(
        json.dumps(ds.to_list(), sort_keys=True, default=str).encode()
    ).hexdigest()
    where = f"{spec.dataset_path} [{spec.test_split}]"
    return fingerprint.encode(), [(f"{where} row {i}", dict(row)) for i, row in enumerate(ds)]


def _render(spec: _Spec, key: str, template, row: dict, label: str) -> str:
    import jinja2

    try:
        return template.render(**row)
    except jinja2.UndefinedError as e:
        fields = ", ".join(map(str, row)) or "none"
        raise DetauditError(
            f"suite {spec.name}: {label}: `{key}` uses a field the row lacks ({_one_line(e.message)}; "
            f"the row has: {fields})"
        ) from None
    except _NullField:
        raise DetauditError(f"suite {spec.name}: {label}: `{key}` uses a field that is null in this row") from None
    except Exception as e:
        raise DetauditError(f"suite {spec.name}: {label}: `{key}` failed: {type(e).__name__}: {_one_line(e)}") from None


def _prompts(spec: _Spec, rows: list[tuple[str, dict]]) -> list[Prompt]:
    prompts, seen = [], {}
    for index, (label, row) in enumerate(rows):
        text = _render(spec, "doc_to_text", spec.doc_to_text, row, label)
        if not text.strip():
            raise DetauditError(f"suite {spec.name}: {label}: `doc_to_text` renders an empty prompt")
        answer = None
        if spec.doc_to_target is not None:
            answer = _render(spec, "doc_to_target", spec.doc_to_target, row, label).strip()
            if not answer:
                raise DetauditError(f"suite {spec.name}: {label}: the answer (`doc_to_target`) is empty")
        pid = str(index)
        if spec.doc_to_id is not None:
            pid = _render(spec, "doc_to_id", spec.doc_to_id, row, label).strip()
            if not pid:
                raise DetauditError(f"suite {spec.name}: {label}: the id (`doc_to_id`) is empty")
        if pid in seen:
            raise DetauditError(f"suite {spec.name}: {label}: id {pid!r} repeats the id of {seen[pid]}")
        seen[pid] = label
        prompts.append(Prompt(suite=spec.name, index=index, id=pid, text=text, answer=answer))
    return prompts


# --------------------------------------------------------------------------------------------
# public API


def list_suites() -> list[dict]:
    """The built-in suites, for `detaudit suites ls`. `needs_data_dir`: the rows are not inline, so
    without hub access `--data-dir` must point at a directory holding `local_file`."""
    out = []
    for path in _builtin().values():
        spec = _load_spec(path)
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
    """Load a built-in suite by name, or any suite YAML by path.

    Rows: the YAML's inline `docs`; else `<data_dir>/<local_file>` when a data dir is given; else the
    hub. `limit` keeps the first N prompts (the checksum still covers the whole source, so record the
    limit beside it). Every bad input raises a one-line DetauditError.
    """
    if limit is not None and limit < 1:
        raise DetauditError(f"--limit must be >= 1 (got {limit})")
    path = _resolve(name)
    spec = _load_spec(path)
    if path.parent.resolve() == SUITES_DIR and spec.name != path.stem:
        raise DetauditError(
            f"{path}: built-in suite `task` must match its file name ({path.stem!r}, got {spec.name!r})"
        )

    if spec.docs is not None:
        data, rows, source = b"", [(f"{path} docs[{i}]", d) for i, d in enumerate(spec.docs)], "inline"
    elif data_dir is not None:
        data_dir = Path(data_dir).expanduser()
        if not spec.local_file:
            raise DetauditError(f"suite {spec.name}: {path} has no `local_file`, so it cannot be read from --data-dir")
        if not data_dir.is_dir():
            raise DetauditError(
                f"data dir {data_dir} does not exist or is not a directory (from --data-dir / DETAUDIT_DATA_DIR)"
            )
        file = data_dir / spec.local_file
        if not file.exists():
            raise DetauditError(f"suite {spec.name}: data dir {data_dir} has no {spec.local_file}")
        data, rows = _read_jsonl(file)
        source = f"mirror:{spec.local_file}"
    else:
        data, rows = _load_hub(spec)
        source = f"hub:{spec.dataset_path}"

    if not rows:
        raise DetauditError(f"suite {spec.name}: no prompts ({source} holds no rows)")
    prompts = _prompts(spec, rows)
    checksum = hashlib.sha256(spec.raw + b"\0" + data).hexdigest()
    return Suite(
        name=spec.name,
        path=path,
        prompts=tuple(prompts[:limit] if limit else prompts),
        checksum=checksum,
        source=source,
        version=spec.version,
        description=spec.description,
        generation_kwargs=spec.generation_kwargs,
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


def text_hash(text: str) -> str:
    """First 16 hex digits of sha256 over the UTF-8 prompt text (before the chat template)."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]
