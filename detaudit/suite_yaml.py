"""Suite YAML: an lm-evaluation-harness task file, read the way lm-eval reads it.

`load_spec(path)` parses one task YAML (with its `include:` chain) into a `Spec`: which rows to load,
how each row becomes a prompt, an answer and an id, and which keys were ignored. Rendering happens in
`detaudit.suites`. Every key falls in one of three classes:

- used: `task`, `include`, `dataset_path`, `dataset_name`, `dataset_kwargs`, `test_split` (else
  `validation_split`), `doc_to_text`, `doc_to_target`, `generation_kwargs`, `metadata`, and detaudit's
  own `docs` (inline rows), `local_file` (the file of a `--data-dir` mirror) and `doc_to_id`;
- ignored, listed once on the suite (`Spec.ignored`): keys that change scoring, grouping or few-shot
  sampling but not a zero-shot prompt (`output_type: generate_until`, `num_fewshot: 0`, `metric_list`,
  `filter_list`, `process_results`, `tag`, `group`, the few-shot splits and delimiters, ...);
- refused by name: keys that would change the prompts or answers and that detaudit cannot honour
  (`num_fewshot` > 0, `process_docs`, `doc_to_choice`, a non-empty `description` or `gen_prefix`,
  `!function` in anything that builds a prompt, non-generation `output_type`, ...).

Templates are compiled in Jinja2's `ImmutableSandboxedEnvironment`: task files are shared like data,
and a template must not reach Python internals (`cycler.__init__.__globals__`...); strict undefined
variables as in lm-eval.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from detaudit.errors import DetauditError

# detaudit's own keys and the lm-eval keys it honours
USED_KEYS = (
    "task",
    "include",
    "dataset_path",
    "dataset_name",
    "dataset_kwargs",
    "test_split",
    "validation_split",
    "doc_to_text",
    "doc_to_target",
    "doc_to_id",
    "generation_kwargs",
    "metadata",
    "local_file",
    "docs",
    "output_type",
    "num_fewshot",
    "description",
    "gen_prefix",
    "repeats",
)
# lm-eval keys that do not change a zero-shot generation prompt or its reference answer
IGNORED_KEYS = (
    "task_alias",
    "tag",
    "group",
    "group_alias",
    "training_split",
    "fewshot_split",
    "fewshot_config",
    "target_delimiter",
    "fewshot_delimiter",
    "metric_list",
    "filter_list",
    "process_results",
    "should_decontaminate",
    "doc_to_decontamination_query",
    "unsafe_code",
)
# lm-eval keys that change the prompts / answers in ways detaudit does not implement
REFUSED_KEYS = {
    "process_docs": "a Python function that rewrites the rows",
    "doc_to_choice": "multiple-choice targets; detaudit grades a generation against one reference answer",
    "use_prompt": "promptsource templates",
    "doc_to_image": "image inputs",
    "doc_to_audio": "audio inputs",
    "custom_dataset": "a Python dataset loader",
    "class": "a custom Python task class",
}
ALL_KEYS = USED_KEYS + IGNORED_KEYS + tuple(REFUSED_KEYS)
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")  # task names end up in cell ids / file names
_TEMPLATE_RE = re.compile(r"\{\{|\{%|\{#")
_MAX_INCLUDE_DEPTH = 16


def one_line(text: object) -> str:
    return " ".join(str(text).split())


def read_bytes(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        raise DetauditError(f"{what} {path} does not exist") from None
    except IsADirectoryError:
        raise DetauditError(f"{what} {path} is a directory, not a file") from None
    except OSError as e:
        raise DetauditError(f"cannot read {what} {path}: {e.strerror or e}") from None


def decode(path: Path, raw: bytes, what: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DetauditError(f"cannot read {what} {path}: not UTF-8 text (bad byte at offset {e.start})") from None


# --------------------------------------------------------------------------------------------
# YAML with lm-eval's `!function` tag (parsed into a marker, never imported)


@dataclass(frozen=True)
class Function:
    """`!function module.name` in a task file: lm-eval imports and calls it; detaudit never does."""

    ref: str


class _Loader(yaml.SafeLoader):
    pass


def _function(loader: yaml.SafeLoader, node: yaml.Node) -> Function:
    return Function(str(loader.construct_scalar(node)) if isinstance(node, yaml.ScalarNode) else "?")


_Loader.add_constructor("!function", _function)


def _has_function(value: object) -> bool:
    if isinstance(value, Function):
        return True
    if isinstance(value, dict):
        return any(_has_function(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_function(v) for v in value)
    return False


def _parse(path: Path) -> tuple[bytes, dict]:
    raw = read_bytes(path, "suite file")
    text = decode(path, raw, "suite file")
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 -- a SafeLoader subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        reason = getattr(e, "problem", None) or e
        raise DetauditError(f"{path}: malformed YAML{where}: {one_line(reason)}") from None
    if not isinstance(data, dict):
        raise DetauditError(f"{path}: a suite must be a YAML mapping of keys (task, doc_to_text, ...)")
    return raw, data


def _merged(path: Path, chain: tuple[Path, ...] = ()) -> tuple[list[bytes], dict[str, tuple[Any, Path]]]:
    """The task file with its `include:` files merged the way lm-eval merges them (a shallow update:
    the including file's keys win; of several includes, the earlier one wins). Includes are resolved
    relative to the including file. Returns (bytes of every file read, {key: (value, file it came from)})."""
    resolved = path.resolve()
    if resolved in chain:
        raise DetauditError(f"{path}: `include` cycle ({' -> '.join(p.name for p in chain + (resolved,))})")
    if len(chain) >= _MAX_INCLUDE_DEPTH:
        raise DetauditError(f"{path}: `include` nested more than {_MAX_INCLUDE_DEPTH} levels deep")
    raw, data = _parse(path)
    raws = [raw]
    out: dict[str, tuple[Any, Path]] = {}
    include = data.pop("include", None)
    if include is not None:
        includes = [include] if isinstance(include, str) else include
        if not isinstance(includes, list) or not includes or not all(isinstance(i, str) and i for i in includes):
            raise DetauditError(f"{path}: `include` must be a file name or a list of file names (got {include!r})")
        for name in reversed(includes):
            target = Path(name).expanduser()
            target = target if target.is_absolute() else path.parent / target
            if not target.is_file():
                raise DetauditError(f"{path}: `include: {name}` names no file ({target} does not exist)")
            sub_raws, sub = _merged(target, chain + (resolved,))
            raws += sub_raws
            out.update(sub)
    out.update({str(k): (v, path) for k, v in data.items()})
    return raws, out


# --------------------------------------------------------------------------------------------
# templates


class NullField(Exception):
    """A template printed a field whose value is null."""


def jinja_env():
    """lm-eval's environment (strict undefined, trailing newline kept, `regex_replace` filter), sandboxed
    and immutable: no attribute starting with `_`, no mutation of the row, no Python internals."""
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def finalize(value):
        if value is None:
            raise NullField()
        return value

    env = ImmutableSandboxedEnvironment(
        undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False, finalize=finalize
    )
    env.filters["regex_replace"] = lambda s, pattern, repl, count=0: re.sub(pattern, repl, s, count=count)
    return env


@dataclass(frozen=True)
class Field:
    """How a row becomes text: a column of the row (lm-eval reads a bare name as `doc[name]`) or a
    Jinja template (`template` compiled), or a constant (an int `doc_to_target`)."""

    key: str  # doc_to_text / doc_to_target / doc_to_id
    source: str  # the YAML value, for messages
    column: str | None = None
    template: Any = None
    constant: str | None = None


def _field(env, path: Path, key: str, value: object, allow_int: bool = False) -> Field:
    import jinja2

    if isinstance(value, Function):
        raise DetauditError(
            f"{path}: `{key}: !function {value.ref}` is refused: detaudit does not run Python functions "
            "from task files (use a Jinja template or a column name)"
        )
    if allow_int and isinstance(value, int) and not isinstance(value, bool):
        return Field(key=key, source=str(value), constant=str(value))
    if not isinstance(value, str) or not value.strip():
        raise DetauditError(f"{path}: `{key}` must be a column name or a non-empty Jinja template (got {value!r})")
    if not _TEMPLATE_RE.search(value):
        return Field(key=key, source=value, column=value)  # lm-eval: `doc_to_text: question` -> doc["question"]
    try:
        return Field(key=key, source=value, template=env.from_string(value))
    except jinja2.TemplateSyntaxError as e:
        raise DetauditError(f"{path}: `{key}` is not a valid Jinja2 template: {one_line(e.message)}") from None


# --------------------------------------------------------------------------------------------
# the spec


@dataclass(frozen=True)
class Spec:
    path: Path
    raw: bytes  # the task file and its includes, for the checksum
    name: str
    doc_to_text: Field
    doc_to_target: Field | None
    doc_to_id: Field | None
    docs: list | None
    dataset_path: str | None
    dataset_name: str | None
    dataset_kwargs: dict  # data_files / data_dir resolved against the YAML that set them
    split: str | None  # test_split, else validation_split
    local_file: str | None
    generation_kwargs: dict
    version: str
    description: str
    ignored: tuple[str, ...] = field(default=())


def _refusals(merged: dict[str, tuple[Any, Path]]) -> list[str]:
    get = lambda k: merged[k][0] if k in merged else None  # noqa: E731
    out = []
    for key, why in REFUSED_KEYS.items():
        if key in merged and get(key) is not None:
            out.append(f"`{key}` ({why})")
    shots = get("num_fewshot")
    if shots is not None and (not isinstance(shots, int) or isinstance(shots, bool) or shots != 0):
        out.append(
            f"`num_fewshot: {shots}` (detaudit runs zero-shot prompts only; few-shot examples change every prompt)"
        )
    output_type = get("output_type")
    if output_type is not None and output_type != "generate_until":
        out.append(f"`output_type: {output_type}` (detaudit audits generation tasks: `generate_until`)")
    for key, what in (
        ("description", "text lm-eval puts before every prompt; put it in `doc_to_text`"),
        ("gen_prefix", "text lm-eval puts at the start of every answer"),
    ):
        value = get(key)
        if value is not None and (not isinstance(value, str) or value.strip()):
            out.append(f"`{key}` ({what})")
    repeats = get("repeats")
    if repeats is not None and repeats != 1:
        out.append(f"`repeats: {repeats}` (detaudit generates once per prompt and configuration)")
    kwargs = get("dataset_kwargs")
    if isinstance(kwargs, dict) and kwargs.get("trust_remote_code"):
        out.append("`dataset_kwargs.trust_remote_code` (detaudit does not run dataset scripts)")
    for key in (
        "task",
        "dataset_kwargs",
        "dataset_path",
        "dataset_name",
        "test_split",
        "validation_split",
        "docs",
        "local_file",
        "generation_kwargs",
        "metadata",
    ):
        if _has_function(get(key)):
            out.append(f"`{key}` (holds a `!function`: detaudit does not run Python functions from task files)")
    return out


def _resolve_data_files(value: object, base: Path, path: Path) -> object:
    """`data_files` relative to the YAML that names them (lm-eval passes them to `load_dataset` as is)."""

    def one(item: object) -> str:
        if not isinstance(item, str) or not item:
            raise DetauditError(f"{path}: `dataset_kwargs.data_files` entries must be file names (got {item!r})")
        if "://" in item:
            return item  # hf://, https://, s3://: left to `datasets`
        p = Path(item).expanduser()
        return str(p if p.is_absolute() else base / p)

    if isinstance(value, dict):
        return {str(k): [one(i) for i in v] if isinstance(v, list) else one(v) for k, v in value.items()}
    if isinstance(value, list):
        return [one(i) for i in value]
    return one(value)


def load_spec(path: Path) -> Spec:
    raws, merged = _merged(path)
    raw = b"\0".join(raws)

    unknown = [k for k in merged if k not in ALL_KEYS]
    if unknown:
        raise DetauditError(
            f"{path}: unsupported key(s) {', '.join(unknown)}; detaudit reads lm-eval task keys "
            f"({', '.join(USED_KEYS[:12])}, ...) and its own `docs`, `local_file`, `doc_to_id`"
        )
    refused = _refusals(merged)
    if refused:
        raise DetauditError(f"{path}: refused key(s), they would change the prompts: {'; '.join(refused)}")
    data = {k: v for k, (v, _) in merged.items()}
    origin = {k: p for k, (_, p) in merged.items()}

    name = data.get("task")
    if isinstance(name, list):
        raise DetauditError(f"{path}: `task` is a list: this is an lm-eval group file; pass each task's YAML")
    inline = data.get("docs") is not None
    local = data.get("local_file") not in (None, "")
    split = data.get("test_split") or data.get("validation_split")
    required = ["task", "doc_to_text"]
    if not inline and data.get("dataset_path") in (None, "") and not local:
        required.append("dataset_path")
    if not inline and not split and (data.get("dataset_path") not in (None, "") or not local):
        required.append("test_split")
    missing = [k for k in required if data.get(k) in (None, "")]
    if missing:
        hint = "" if inline else " (or an inline `docs:` list)"
        raise DetauditError(f"{path}: missing required key(s) {', '.join(missing)}{hint}")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise DetauditError(f"{path}: `task` must be a name of letters, digits, '_', '-' or '.' (got {name!r})")
    for key in ("dataset_path", "dataset_name", "test_split", "validation_split", "local_file"):
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
    kwargs = data.get("dataset_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise DetauditError(f"{path}: `dataset_kwargs` must be a mapping (e.g. {{data_files: rows.jsonl}})")
    kwargs = {str(k): v for k, v in kwargs.items()}
    base = origin.get("dataset_kwargs", path).parent
    if "data_files" in kwargs:
        kwargs["data_files"] = _resolve_data_files(kwargs["data_files"], base, path)
    if isinstance(kwargs.get("data_dir"), str) and "://" not in kwargs["data_dir"]:
        d = Path(kwargs["data_dir"]).expanduser()
        kwargs["data_dir"] = str(d if d.is_absolute() else base / d)

    ignored = [k for k in merged if k in IGNORED_KEYS]
    ignored += [k for k in ("output_type", "num_fewshot", "repeats", "description", "gen_prefix") if k in merged]
    if data.get("test_split") and "validation_split" in merged:
        ignored.append("validation_split")
    if (inline or local_file) and "dataset_kwargs" in merged and data.get("dataset_path") in (None, ""):
        ignored.append("dataset_kwargs")

    env = jinja_env()
    return Spec(
        path=path,
        raw=raw,
        name=name,
        doc_to_text=_field(env, path, "doc_to_text", data["doc_to_text"]),
        doc_to_target=_field(env, path, "doc_to_target", data["doc_to_target"], allow_int=True)
        if data.get("doc_to_target") is not None
        else None,
        doc_to_id=_field(env, path, "doc_to_id", data["doc_to_id"]) if data.get("doc_to_id") is not None else None,
        docs=docs,
        dataset_path=data.get("dataset_path") or None,
        dataset_name=data.get("dataset_name"),
        dataset_kwargs=kwargs,
        split=split,
        local_file=local_file,
        generation_kwargs=dict(gen),
        version=str(meta.get("version", "")),
        description=str(meta.get("description", "")),
        ignored=tuple(sorted(set(ignored), key=list(merged).index)),
    )
