"""`detaudit models`, `suites`, `backends`, `doctor`: what is installed and available."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.table import Table

from detaudit.cli.common import DEFAULT_MODEL, DataDirOpt, JsonOpt, LimitOpt, err, handle_errors, out, print_json, print_listing, print_rows

models_app = typer.Typer(no_args_is_help=True, help="Named models and local checkpoints.")
suites_app = typer.Typer(no_args_is_help=True, help="Prompt suites.")
backends_app = typer.Typer(no_args_is_help=True, help="Numeric backends.")


@models_app.command("ls")
@handle_errors
def models_ls(json_: JsonOpt = False):
    """List named models and whether they are prepared."""
    from detaudit.models import list_models

    print_listing(list_models(), ["name", "state", "size_mb", "path", "description"], json_)


@models_app.command("prepare")
@handle_errors
def models_prepare(
    name: Annotated[str, typer.Argument(help="A named model.")] = DEFAULT_MODEL,
    force: Annotated[bool, typer.Option("--force", help="Redo it even if already prepared.")] = False,
):
    """Fetch and convert a named model into the cache (`DETAUDIT_HOME`). Idempotent."""
    from detaudit.models import prepare

    out.print(str(prepare(name, force=force, console=err)))


@suites_app.command("ls")
@handle_errors
def suites_ls(json_: JsonOpt = False):
    """List the built-in suites (package data: detaudit/data/suites)."""
    from detaudit.suites import list_suites

    print_listing(list_suites(), ["name", "source", "dataset_path", "needs_data_dir", "description"], json_)


@suites_app.command("show")
@handle_errors
def suites_show(
    name: Annotated[str, typer.Argument(help="Suite name or lm-eval task YAML path.")],
    data_dir: DataDirOpt = None,
    limit: LimitOpt = None,
    json_: JsonOpt = False,
):
    """Show a suite's prompts and answers."""
    from detaudit import paths
    from detaudit.suites import load_suite

    suite = load_suite(name, data_dir=paths.data_dir(data_dir), limit=limit)
    rows = [{"id": p.id, "answer": p.answer, "text": p.text} for p in suite.prompts]
    ignored = list(getattr(suite, "ignored_keys", ()) or ())
    ungraded = list(getattr(suite, "ungraded", ()) or ())
    if json_:
        print_json({"name": suite.name, "source": suite.source, "checksum": suite.checksum, "prompts": rows,
                    "ignored_keys": ignored, "ungraded": ungraded})
        return
    out.print(f"[bold]{suite.name}[/] ({suite.source}, {len(rows)} prompts, sha256 {suite.checksum[:16]})")
    if ignored:
        out.print(f"[dim]ignored lm-eval keys (detaudit does not use them): {', '.join(ignored)}[/]")
    if ungraded:
        out.print(f"[yellow]{len(ungraded)} row(s) without an answer, kept ungraded: {', '.join(ungraded[:10])}[/]")
    print_rows([{**r, "text": r["text"][:100].replace("\n", " ")} for r in rows], ["id", "answer", "text"])


@backends_app.command("ls")
@handle_errors
def backends_ls(json_: JsonOpt = False):
    """List the registered numeric backends and how they compute."""
    from detaudit.backends import available, get_backend

    rows = [{"name": name, **{k: v for k, v in get_backend(name).describe().items() if k != "backend"}}
            for name in available()]
    print_listing(rows, ["name", "matmul", "attention", "all_reduce"], json_)


@handle_errors
def doctor(json_: JsonOpt = False):
    """Print the environment fingerprint and check the installation."""
    from detaudit import fingerprint
    from detaudit.backends import available
    from detaudit.engines import ENGINES

    env = fingerprint.collect()
    checks = {"backends": ", ".join(available()), "engines": ", ".join(ENGINES)}
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
