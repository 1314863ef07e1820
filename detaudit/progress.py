"""Progress of a sweep's cells: live bars on a terminal; in a CI log or a file (no terminal), one
plain line per finished cell, printed as it finishes."""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class CellProgress:
    def __init__(self, console: Console, total: int, done: int, tokens: dict[str, int]) -> None:
        self.console, self.total, self.done, self.tokens = console, total, done, tokens
        self.live = console.is_terminal
        self.tasks: dict[str, int] = {}
        self.started: dict[str, float] = {}
        self.bars = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            transient=False,
            disable=not self.live,
        )

    def __enter__(self) -> "CellProgress":
        self.bars.__enter__()
        self.overall = self.bars.add_task("cells", total=self.total, completed=self.done)
        return self

    def __exit__(self, *exc) -> None:
        self.bars.__exit__(*exc)

    def event(self, cell_id: str, event: str, n: int) -> None:
        if event == "start":
            self.started[cell_id] = time.monotonic()
            self.tasks[cell_id] = self.bars.add_task(cell_id, total=self.tokens.get(cell_id, 0))
        elif event == "engine":
            self.bars.update(self.tasks[cell_id], description=f"{cell_id} [dim](starting engine)[/]")
        elif event == "tokens":
            self.bars.update(self.tasks[cell_id], advance=n, description=cell_id)
        elif event == "end":
            self.done += 1
            self.bars.remove_task(self.tasks.pop(cell_id))
            self.bars.advance(self.overall)
            if not self.live:
                took = time.monotonic() - self.started.pop(cell_id, time.monotonic())
                self.console.print(
                    f"[{self.done}/{self.total}] {escape(cell_id)} finished in {took:.1f} s",
                    highlight=False,
                    soft_wrap=True,
                )

    def failed(self, cell_id: str, error: str) -> None:
        self.bars.console.print(f"[red]cell {escape(cell_id)} failed:[/] {escape(error)}", soft_wrap=True)
