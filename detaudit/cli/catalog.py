"""`detaudit models`, `suites`, `backends`, `doctor`: what is installed and available."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Callable

import typer
from rich.markup import escape
from rich.table import Table

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
    from detaudit.suites import list_suites

    return list_suites()


def _backends() -> list[dict]:
    from detaudit.backends import available, get_backend

    return [
        {"name": name, **{k: v for k, v in get_backend(name).describe().items() if k != "backend"}}
        for name in available()
    ]


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
):
    """Fetch and convert a named model into the cache (`DETAUDIT_HOME`). Idempotent."""
    from detaudit.models import prepare

    out.print(str(prepare(name, force=force, console=err)))


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
    from detaudit.suites import load_suite

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
        shown = ", ".join(f"{k}: {v}" for k, v in generation.items())
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
    from detaudit import fingerprint
    from detaudit.backends import available
    from detaudit.backends.kernels import cpu_calls
    from detaudit.engines import ENGINES

    env = fingerprint.collect()
    checks = {"backends": ", ".join(available()), "engines": ", ".join(map(_engine_state, ENGINES.values()))}
    checks["cpu_kernels"] = cpu_calls.describe()  # compiled (the cpu extra) or PyTorch ops, and why
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
        t.add_row(str(k), json.dumps(v) if isinstance(v, (dict, list)) else str(v))
    out.print(t)
