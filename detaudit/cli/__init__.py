"""detaudit command line: one module per command group; each command parses its options, builds a
config object, makes one call into the library, and renders the result."""

from __future__ import annotations

import typer

from detaudit.cli import align, bench, catalog, results, sweep

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="Audit whether LLM inference is reproducible across TP sizes, batch sizes and numeric backends.")
app.command()(sweep.sweep)
app.command()(results.analyze)
app.command()(results.report)
app.command()(results.gate)
app.command()(results.merge)
app.command()(align.align)
app.command()(catalog.doctor)
app.add_typer(catalog.models_app, name="models")
app.add_typer(catalog.suites_app, name="suites")
app.add_typer(catalog.backends_app, name="backends")
app.add_typer(bench.bench_app, name="bench")


def main() -> None:
    app()
