"""Progress of a sweep's cells: live bars on a terminal; in a CI log or a file (no terminal), plain lines:
one when a cell starts, one when it finishes, and a heartbeat for a cell still running after each
HEARTBEAT_S seconds (so a long cell is visibly alive, and a hung one visibly stuck). A benchmark's steps
(`steps`): a bar on a terminal, one line per finished step elsewhere."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Callable, Iterator

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

HEARTBEAT_S = 60.0
QUIET_S = 10.0  # a transient benchmark's steps off a terminal: at most a line this often (and the last)


class CellProgress:
    """`clock` and `heartbeat` are injectable: the heartbeat thread only calls `beat()` every few seconds,
    and `beat()` decides from `clock()` alone which cells are due a line (tests call it directly)."""

    def __init__(
        self,
        console: Console,
        total: int,
        done: int,
        tokens: dict[str, int],
        *,
        clock: Callable[[], float] = time.monotonic,
        heartbeat: float = HEARTBEAT_S,
        ticker: bool = True,
    ) -> None:
        self.console, self.total, self.done, self.tokens = console, total, done, tokens
        self.clock, self.heartbeat, self.ticker = clock, heartbeat, ticker
        self.live = console.is_terminal
        self.tasks: dict[str, int] = {}
        self.started: dict[str, float] = {}
        self.last_line: dict[str, float] = {}  # when each running cell last got a line
        self.generated: dict[str, int] = {}
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread: threading.Thread | None = None
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
        if not self.live and self.ticker:
            self.thread = threading.Thread(target=self._tick, name="detaudit-heartbeat", daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        if self.thread is not None:
            self.thread.join()
        self.bars.__exit__(*exc)

    def _tick(self) -> None:
        while not self.stop.wait(min(self.heartbeat / 6, 10.0)):
            self.beat()

    def _line(self, text: str) -> None:
        self.console.print(text, highlight=False, soft_wrap=True)

    def beat(self) -> None:
        """A line for each running cell that has had none for `heartbeat` seconds (off a terminal)."""
        if self.live:
            return
        now = self.clock()
        with self.lock:
            for cell_id, last in list(self.last_line.items()):
                if now - last >= self.heartbeat:
                    self.last_line[cell_id] = now
                    total = self.tokens.get(cell_id, 0)
                    of = f" of {total}" if total else ""
                    self._line(
                        f"{escape(cell_id)} still running after {now - self.started[cell_id]:.0f} s "
                        f"({self.generated.get(cell_id, 0)}{of} tokens generated)"
                    )

    def event(self, cell_id: str, event: str, n: int) -> None:
        with self.lock:
            if event == "start":
                self.started[cell_id] = self.last_line[cell_id] = self.clock()
                self.generated[cell_id] = 0
                self.tasks[cell_id] = self.bars.add_task(cell_id, total=self.tokens.get(cell_id, 0))
                if not self.live:
                    self._line(f"[{self.done + len(self.started)}/{self.total}] {escape(cell_id)} started")
            elif event == "engine":
                self.bars.update(self.tasks[cell_id], description=f"{cell_id} [dim](starting engine)[/]")
            elif event == "tokens":
                self.generated[cell_id] = self.generated.get(cell_id, 0) + n
                self.bars.update(self.tasks[cell_id], advance=n, description=cell_id)
            elif event == "end":
                self.done += 1
                self.bars.remove_task(self.tasks.pop(cell_id))
                self.bars.advance(self.overall)
                now = self.clock()
                took = now - self.started.pop(cell_id, now)
                self.last_line.pop(cell_id, None)
                if not self.live:
                    self._line(f"[{self.done}/{self.total}] {escape(cell_id)} finished in {took:.1f} s")

    def failed(self, cell_id: str, error: str) -> None:
        self.bars.console.print(f"[red]cell {escape(cell_id)} failed:[/] {escape(error)}", soft_wrap=True)


@contextlib.contextmanager
def steps(
    console: Console, label: str, total: int, *, transient: bool = False, clock: Callable[[], float] = time.monotonic
) -> Iterator[Callable[..., None]]:
    """Yields `advance(what="")`, called once per finished step of a benchmark: a live bar on a terminal; in
    a log (no terminal, where a bar shows only when it ends) a line per step, `[2/8] vLLM engines: TP 2
    vllm-bi (149 s)` (seconds since the previous line), so a long benchmark is visibly alive. `transient`
    (many short steps): off a terminal, a line only once QUIET_S seconds have passed since the last, and
    for the last step."""
    if console.is_terminal:
        with Progress(console=console, transient=transient) as bar:
            task = bar.add_task(label, total=total)
            yield lambda what="": bar.advance(task)
        return
    quiet = QUIET_S if transient else 0.0
    done, last = 0, clock()

    def advance(what: str = "") -> None:
        nonlocal done, last
        done, now = done + 1, clock()
        if now - last < quiet and done < total:
            return
        name = f"{label}: {what}" if what else label
        console.print(f"[{done}/{total}] {name} ({now - last:.0f} s)", markup=False, highlight=False)
        last = now

    yield advance
