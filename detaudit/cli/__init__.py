"""detaudit command line: one module per command group; each command parses its options, builds a
config object, makes one call into the library, and renders the result."""

from __future__ import annotations

import os
import sys
from typing import Annotated

import typer
from rich.markup import escape

try:  # typer >= 0.20 vendors click
    from typer._click import echo
    from typer._click import exceptions as cx
except ImportError:  # pragma: no cover - older typer on the real click
    from click import echo
    from click import exceptions as cx

from detaudit import omp_wait
from detaudit.cli import align, bench, catalog, results, sweep
from detaudit.cli.common import App, Group, err, out
from detaudit.cli.hints import foreign_flag


class _OneLineErrors(Group):
    """Usage errors (unknown option, bad choice, missing argument) print one line and exit 2, like every
    other bad input, instead of click's boxed usage text."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        try:
            rv = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except cx.NoArgsIsHelpError as e:
            echo(e.ctx.get_help() if e.ctx else e.format_message())
            rv = 2
        except cx.UsageError as e:
            hint = f" (see `{e.ctx.command_path} --help`)" if e.ctx else ""
            message = (_foreign(e) if isinstance(e, cx.NoSuchOption) else None) or e.format_message()
            err.print(f"[bold red]error:[/] {escape(message)}{hint}", highlight=False, soft_wrap=True)
            rv = 2
        except typer.Abort:
            err.print("[yellow]interrupted[/]")
            rv = 130
        if not standalone_mode:
            return rv
        sys.exit(rv if isinstance(rv, int) else 0)


def _foreign(e) -> str | None:
    """lm-eval's / vLLM's name for a flag: a pointer to detaudit's (`detaudit.cli.hints`)."""
    if e.ctx is None:
        return None
    known = {o for p in e.ctx.command.params for o in (*p.opts, *p.secondary_opts)}
    return foreign_flag(e.option_name, known, e.ctx.command_path)


app = App(
    cls=_OneLineErrors,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    help="Audit whether LLM inference is reproducible across TP sizes, batch sizes and numeric backends.",
)


def _print_version(value: bool) -> None:
    if value:
        from detaudit import __version__

        out.print(f"detaudit {__version__}", highlight=False)
        raise typer.Exit(0)


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option("--version", is_eager=True, callback=_print_version, help="Print detaudit's version and exit."),
    ] = False,
) -> None:
    """Audit whether LLM inference is reproducible across TP sizes, batch sizes and numeric backends."""


app.command()(sweep.sweep)
app.command()(results.analyze)
app.command()(results.report)
app.command()(results.gate)
app.command()(results.merge)
app.command()(results.diff)
app.command()(align.align)
app.command()(catalog.doctor)
app.add_typer(catalog.models_app, name="models")
app.add_typer(catalog.suites_app, name="suites")
app.add_typer(catalog.backends_app, name="backends")
app.add_typer(bench.bench_app, name="bench")


def main() -> None:
    # before anything loads torch (and with it libgomp, which reads its wait settings once): `omp_wait`
    omp_wait.apply()
    if not sys.stderr.isatty():  # a CI log or a file: one line per event, no bar redrawn with carriage returns
        for var in ("TQDM_DISABLE", "HF_HUB_DISABLE_PROGRESS_BARS"):  # read when tqdm / the hub is imported
            os.environ.setdefault(var, "1")
    app()
