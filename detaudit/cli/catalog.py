"""`detaudit models`, `suites`, `backends`, `doctor`: what is installed and available."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Callable, Optional

import typer
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from detaudit.cli.common import (
    DEFAULT_MODEL,
    App,
    DataDirOpt,
    JsonOpt,
    LimitOpt,
    TrustSuitePathsOpt,
    err,
    handle_errors,
    out,
    print_json,
    print_listing,
    print_rows,
)

models_app = App(no_args_is_help=True, help="Named models and local checkpoints.")
suites_app = App(no_args_is_help=True, help="Prompt suites.")
backends_app = App(no_args_is_help=True, help="Numeric backends.")


def _ls(app: typer.Typer, rows: Callable[[], list[dict]], columns: list[str], doc: str) -> None:
    """Register `ls` on a command group: a table, or `--json`."""

    @app.command("ls", help=doc)
    @handle_errors
    def ls(json_: JsonOpt = False):
        print_listing(rows(), columns, json_)


def _models() -> list[dict]:
    from detaudit.models import list_models

    return list_models()


def _suites() -> list[dict]:
    from detaudit.inputs.suites import list_suites

    return list_suites()


def _backends() -> list[dict]:
    from detaudit.backends import available, get_backend
    from detaudit.engines import ENGINES

    rows = [
        {"name": name, **{k: v for k, v in get_backend(name).describe().items() if k != "backend"}}
        for name in available()
    ]
    native: dict[str, list[str]] = {}
    for info in ENGINES.values():  # backends an engine computes with its own kernels (vllm-bi)
        for name, what in info.native_backends.items():
            native.setdefault(name, [what]).append(info.name)
    for name, (what, *engines) in native.items():
        note = f"{what}; --engine {' / '.join(engines)} only"
        rows.append({"name": name, "matmul": note, "attention": note, "all_reduce": note})
    return rows


_ls(
    models_app,
    _models,
    ["name", "state", "size_mb", "path", "description"],
    "List named models and whether they are prepared.",
)
_ls(
    suites_app,
    _suites,
    ["name", "source", "dataset_path", "needs_data_dir", "description"],
    "List the built-in suites (suites/ of the repository, package data in a wheel).",
)
_ls(
    backends_app,
    _backends,
    ["name", "matmul", "attention", "all_reduce"],
    "List the registered numeric backends and how they compute.",
)


@models_app.command("prepare")
@handle_errors
def models_prepare(
    name: Annotated[str, typer.Argument(help="A named model.")] = DEFAULT_MODEL,
    force: Annotated[bool, typer.Option("--force", help="Redo it even if already prepared.")] = False,
    safetensors: Annotated[
        bool,
        typer.Option(
            "--safetensors",
            help="Synthetic models: also write the seeded weights as safetensors files (engines that read "
            "files, such as vLLM, need them; the built-in engine then reads them too).",
        ),
    ] = False,
    device: Annotated[
        Optional[str],
        typer.Option("--device", help="With --safetensors: where the weights are drawn (default: cuda if present)."),
    ] = None,
):
    """Fetch and convert a named model into the cache (`DETAUDIT_HOME`). Idempotent."""
    from detaudit.models import prepare

    out.print(str(prepare(name, force=force, console=err, safetensors=safetensors, device=device)))


@models_app.command("truncate")
@handle_errors
def models_truncate(
    model: Annotated[str, typer.Argument(help="A named model, checkpoint directory or hub id.")],
    layers: Annotated[int, typer.Option("--layers", help="Decoder layers to keep (the first N).")],
    output: Annotated[Path, typer.Option("--output", "-o", help="New checkpoint directory.")],
):
    """Write MODEL's first N layers as a checkpoint: a draft model for `--speculative draft:DIR:K` (same
    tokenizer, embedding and lm_head; `smollm2-135m-draft` is the embedded model's, named)."""
    from detaudit.models import truncate_to

    out.print(str(truncate_to(model, layers, output, console=err)))


@suites_app.command("show")
@handle_errors
def suites_show(
    name: Annotated[str, typer.Argument(help="Suite name or lm-eval task YAML path.")],
    data_dir: DataDirOpt = None,
    limit: LimitOpt = None,
    trust_suite_paths: TrustSuitePathsOpt = False,
    json_: JsonOpt = False,
):
    """Show a suite's prompts and answers, its decoding (generation_kwargs) and its prompt form."""
    from detaudit import paths
    from detaudit.config import check_limit
    from detaudit.inputs.suites import load_suite

    check_limit(limit)
    suite = load_suite(name, data_dir=paths.data_dir(data_dir), limit=limit, trust_paths=trust_suite_paths)
    rows = [{"id": p.id, "answer": p.answer, "text": p.text} for p in suite.prompts]
    ignored = list(suite.ignored_keys)
    ungraded = list(suite.ungraded)
    generation = suite.generation.to_dict()
    if json_:
        print_json(
            {
                "name": suite.name,
                "source": suite.source,
                "checksum": suite.checksum,
                "prompts": rows,
                "ignored_keys": ignored,
                "ungraded": ungraded,
                "generation_kwargs": generation,
                "generation_defaults": list(suite.generation.defaults),  # keys lm-eval's defaults set
                "apply_chat_template": suite.apply_chat_template,
            }
        )
        return
    out.print(
        f"[bold]{escape(suite.name)}[/] ({escape(suite.source)}, {len(rows)} prompts, sha256 {suite.checksum[:16]})"
    )
    form = "the model's chat template" if suite.apply_chat_template else "plain text (lm-eval's default)"
    out.print(f"prompts: {form}, unless --apply-chat-template / --no-apply-chat-template says otherwise")
    if generation:
        lm_eval = {k: v for k, v in generation.items() if k in suite.generation.defaults}
        parts = [
            f"{where}: " + ", ".join(f"{k}: {v!r}" for k, v in keys.items())
            for where, keys in (("from the file", suite.generation.from_file()), ("lm-eval's defaults", lm_eval))
            if keys
        ]
        shown = "; ".join(parts)
        out.print(f"generation_kwargs (the suite's decoding; decoding flags on the command line win): {escape(shown)}")
    if ignored:
        out.print(f"[dim]ignored lm-eval keys (detaudit does not use them): {escape(', '.join(ignored))}[/]")
    if ungraded:
        out.print(
            f"[yellow]{len(ungraded)} row(s) without an answer, kept ungraded: {escape(', '.join(ungraded[:10]))}[/]"
        )
    print_rows([{**r, "text": r["text"][:100].replace("\n", " ")} for r in rows], ["id", "answer", "text"])


def _engine_state(info) -> str:
    """An engine's name, and why it cannot run here when its extra is missing."""
    from detaudit.errors import DetauditError

    try:
        if info.requires is not None:
            info.requires()
    except DetauditError as e:
        return f"{info.name} (unavailable: {e})"
    return info.name


@handle_errors
def doctor(json_: JsonOpt = False):
    """Print the environment fingerprint and check the installation."""
    from detaudit import omp_wait
    from detaudit.backends import available, describe_machine
    from detaudit.engines import ENGINES, native_backend_names
    from detaudit.runs import fingerprint
    from detaudit.vllm import torch_match

    env = fingerprint.collect()
    checks = {
        "backends": ", ".join([*available(), *(f"{n} (engine's own)" for n in native_backend_names())]),
        "engines": ", ".join(map(_engine_state, ENGINES.values())),
        "vllm": torch_match(),  # one line: which vLLM, the torch it pins, whether the installed one matches
    }
    checks.update(describe_machine())  # the CPU product path and compiled kernels (the cpu extra), and why
    checks["omp_wait"] = omp_wait.describe()
    try:
        from detaudit.models import list_models

        checks["models"] = ", ".join(f"{m['name']} ({m['state']})" for m in list_models())
    except Exception as e:  # doctor reports, never crashes
        checks["models"] = f"error: {e}"
    if json_:
        print_json({"environment": env, "checks": checks})
        return
    t = Table(title="detaudit doctor", show_header=False)
    for k, v in {**{k: v for k, v in env.items() if k not in ("env", "versions")}, **env["versions"], **checks}.items():
        # data, not markup: rich would read `pip install 'detaudit[vllm]'` as a style tag and drop it
        t.add_row(Text(str(k)), Text(json.dumps(v) if isinstance(v, (dict, list)) else str(v)))
    out.print(t)
