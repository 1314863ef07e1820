"""Suite YAML: an lm-evaluation-harness task file, read the way lm-eval reads it.

`load_spec(path)` parses one task YAML (with its `include:` chain) into a `Spec`: which rows to load,
how each row becomes a prompt, an answer and an id, how it decodes, and which keys were ignored.
Rendering happens in `detaudit.inputs.suite_render`. Every key falls in one of three classes:

- used: `task`, `include`, `dataset_path`, `dataset_name`, `dataset_kwargs`, `test_split` (else
  `validation_split`), `doc_to_text`, `doc_to_target`, `generation_kwargs` (`detaudit.decoding`; what it
  leaves out gets lm-eval's defaults for `output_type: generate_until`, the default output type, with
  `fewshot_delimiter` as the default stop string), `metadata`, and detaudit's own `docs` (inline rows),
  `local_file` (the file of a `--data-dir` mirror), `doc_to_id` and `apply_chat_template` (whether prompts
  go through the model's chat template by default);
- ignored, listed once on the suite (`Spec.ignored`): keys that change scoring, grouping or few-shot
  sampling but not a zero-shot prompt (`num_fewshot: 0`, `metric_list`, `filter_list`, `process_results`,
  `tag`, `group`, the few-shot splits, `target_delimiter`, ...);
- refused by name: keys that would change the prompts or answers and that detaudit cannot honour
  (`num_fewshot` > 0, `process_docs`, `doc_to_choice`, a non-empty `description` or `gen_prefix`,
  `!function` in anything that builds a prompt, non-generation `output_type`, ...).

Task files are shared like data, so nothing in one is trusted:
- every path it names (`include:`, `dataset_kwargs.data_files` / `data_dir`, a local `dataset_path`) must
  resolve, symlinks included, inside the directory of the YAML the user named (`Scope`); URLs only as
  `hf://`, `https://`, `http://`; `--trust-suite-paths` lifts this, and the manifest records it;
- `dataset_kwargs` reaches `datasets.load_dataset` only with data-selection keys (`DATASET_KWARGS`):
  `cache_dir`, `storage_options`, ... are refused by name;
- the file is read only when it is a regular file of at most `MAX_SUITE_BYTES`, and parsed by the bounded
  loader of `detaudit.inputs.user_files` (aliases, depth, integers, dates, lone surrogates: one line each);
- templates render in Jinja2's `ImmutableSandboxedEnvironment` (no Python internals), bounded in time,
  memory and size (`detaudit.inputs.suite_render`); strict undefined variables as in lm-eval.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from detaudit.decoding import FEWSHOT_DELIMITER, GenerationKwargs, lm_eval_defaults, parse_generation_kwargs
from detaudit.errors import DetauditError
from detaudit.inputs import user_files
from detaudit.inputs.suite_paths import (
    DATASET_KWARGS,
    PACKAGED_BUILDERS,
    Scope,
    check_dataset_path,
    resolve_data_dir,
    resolve_data_files,
)

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
    "fewshot_delimiter",
    "num_fewshot",
    "description",
    "gen_prefix",
    "repeats",
    "apply_chat_template",
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
MAX_SUITE_BYTES = user_files.MAX_YAML_BYTES  # a suite file larger than this is refused before it is parsed
one_line = user_files.one_line


# --------------------------------------------------------------------------------------------
# YAML with lm-eval's `!function` tag (parsed into a marker, never imported)


@dataclass(frozen=True)
class Function:
    """`!function module.name` in a task file: lm-eval imports and calls it; detaudit never does."""

    ref: str


class _Loader(user_files.Loader):
    """The bounded safe loader (`detaudit.inputs.user_files`) with lm-eval's `!function` tag."""


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
    raw = user_files.read_regular(path, "suite file", MAX_SUITE_BYTES)  # the size first, before any parsing
    data = user_files.load_yaml(user_files.decode(path, raw, "suite file"), str(path), _Loader)
    if not isinstance(data, dict):
        raise DetauditError(f"{path}: a suite must be a YAML mapping of keys (task, doc_to_text, ...)")
    return raw, data


def _merged(
    path: Path, scope: "Scope", chain: tuple[Path, ...] = ()
) -> tuple[list[bytes], dict[str, tuple[Any, Path]]]:
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
            target = scope.local(target, f"`include: {name}`", path)
            sub_raws, sub = _merged(target, scope, chain + (resolved,))
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
    """How a row becomes text: a column of the row (lm-eval reads a bare name as `doc[name]`), a Jinja
    template (`source`, compiled where it is rendered: `detaudit.inputs.suite_render`), or a constant (an int
    `doc_to_target`). Plain data, so it can travel to the process that renders templates."""

    key: str  # doc_to_text / doc_to_target / doc_to_id
    source: str  # the YAML value (the template), also for messages
    column: str | None = None
    constant: str | None = None

    @property
    def is_template(self) -> bool:
        return self.column is None and self.constant is None


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
        env.parse(value)  # syntax errors are found here, before any row is read (compiling, which folds
        # constants such as `'a' * 10**9`, happens where rendering is bounded: `detaudit.inputs.suite_render`)
    except jinja2.TemplateSyntaxError as e:
        raise DetauditError(f"{path}: `{key}` is not a valid Jinja2 template: {one_line(e.message)}") from None
    except RecursionError:  # Jinja's parser recurses about ten frames per nested bracket
        raise DetauditError(f"{path}: `{key}` is refused: its template is nested too deeply") from None
    return Field(key=key, source=value)


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
    dataset_kwargs: dict  # the other data-selection kwargs (data_dir resolved against its YAML)
    data_files: dict[str, list[str]] | None  # {split: files}: local files resolved and confined, or URLs
    split: str | None  # test_split, else validation_split
    local_file: str | None
    generation: GenerationKwargs
    version: str
    description: str
    apply_chat_template: bool | None = None  # detaudit's own key; None: lm-eval's default (plain text)
    ignored: tuple[str, ...] = field(default=())

    @property
    def builder(self) -> bool:
        """Rows from files through one of `datasets`' packaged builders (json, csv, parquet, ...)."""
        return self.dataset_path in PACKAGED_BUILDERS


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
        "apply_chat_template",
    ):
        if _has_function(get(key)):
            out.append(f"`{key}` (holds a `!function`: detaudit does not run Python functions from task files)")
    return out


def _dataset(
    data: dict, origin: dict[str, Path], scope: Scope, path: Path, rows_from_dataset: bool
) -> tuple[str | None, dict, dict[str, list[str]] | None]:
    """(dataset_name, the other dataset_kwargs, data_files): only data-selection keys, every path confined."""
    kwargs = data.get("dataset_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise DetauditError(f"{path}: `dataset_kwargs` must be a mapping (e.g. {{data_files: rows.jsonl}})")
    kwargs = {str(k): v for k, v in kwargs.items()}
    name = data.get("dataset_name")
    if not rows_from_dataset:
        return name, kwargs, None
    other = [k for k in kwargs if k not in DATASET_KWARGS]
    if other:
        raise DetauditError(
            f"{path}: `dataset_kwargs` key(s) {', '.join(other)} refused: detaudit passes only data-selection "
            f"keys to `datasets.load_dataset` ({', '.join(DATASET_KWARGS)})"
        )
    if "name" in kwargs:
        if name not in (None, kwargs["name"]):
            raise DetauditError(
                f"{path}: `dataset_name: {name}` and `dataset_kwargs.name: {kwargs['name']}` disagree; keep one"
            )
        name = kwargs.pop("name")
    dataset_path = data["dataset_path"]
    check_dataset_path(dataset_path, scope, path)
    local = dataset_path in PACKAGED_BUILDERS
    base = origin.get("dataset_kwargs", path).parent
    files = kwargs.pop("data_files", None)
    if files is not None:
        files = resolve_data_files(files, base, local, scope, path)
    if "data_dir" in kwargs:
        kwargs["data_dir"] = resolve_data_dir(kwargs["data_dir"], base, local, scope, path)
    if local and files is None and "data_dir" not in kwargs and not data.get("local_file"):
        raise no_data_files(path, dataset_path)  # (with a `local_file`, `--data-dir` may still give the rows)
    return name, kwargs, files


def no_data_files(path: Path, dataset_path: str, local_file: str | None = None) -> DetauditError:
    mirror = f", or pass --data-dir (DETAUDIT_DATA_DIR) to a directory holding {local_file}" if local_file else ""
    return DetauditError(
        f"{path}: `dataset_path: {dataset_path}` needs `dataset_kwargs.data_files` (without it `datasets` "
        f"reads every file of the working directory){mirror}"
    )


def load_spec(path: Path, trust_paths: bool = False) -> Spec:
    """Parse one task file (and its includes). Every path it names must lie in the YAML's directory
    unless `trust_paths` (`--trust-suite-paths`)."""
    scope = Scope(Path(path).expanduser().absolute().parent.resolve(), trust_paths)
    raws, merged = _merged(path, scope)
    raw = b"\0".join(raws)

    unknown = [k for k in merged if k not in ALL_KEYS]
    if unknown:
        raise DetauditError(
            f"{path}: unsupported key(s) {', '.join(unknown)}; detaudit reads lm-eval task keys "
            f"({', '.join(USED_KEYS[:12])}, ...) and its own `docs`, `local_file`, `doc_to_id`, "
            "`apply_chat_template`"
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
    delimiter = data.get("fewshot_delimiter", FEWSHOT_DELIMITER)
    if delimiter is not None and not isinstance(delimiter, str):
        raise DetauditError(f"{path}: `fewshot_delimiter` must be a string (got {delimiter!r})")
    generation = lm_eval_defaults(  # what the file leaves out decodes as lm-eval decodes it (generate_until)
        parse_generation_kwargs(data.get("generation_kwargs"), str(path)),
        given=data.get("generation_kwargs") is not None,
        delimiter=delimiter,
    )
    meta = data.get("metadata") or {}
    if not isinstance(meta, dict):
        raise DetauditError(f"{path}: `metadata` must be a mapping (e.g. {{version: 1.0}})")
    chat = data.get("apply_chat_template")
    if chat is not None and not isinstance(chat, bool):
        raise DetauditError(f"{path}: `apply_chat_template` must be true or false (got {chat!r})")
    from_dataset = not inline and data.get("dataset_path") not in (None, "")
    dataset_name, kwargs, data_files = _dataset(data, origin, scope, path, from_dataset)

    ignored = [k for k in merged if k in IGNORED_KEYS]
    ignored += [k for k in ("num_fewshot", "repeats", "description", "gen_prefix") if k in merged]
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
        dataset_name=dataset_name,
        dataset_kwargs=kwargs,
        data_files=data_files,
        split=split,
        local_file=local_file,
        generation=generation,
        version=str(meta.get("version", "")),
        description=str(meta.get("description", "")),
        apply_chat_template=chat,
        ignored=tuple(sorted(set(ignored), key=list(merged).index)),
    )
