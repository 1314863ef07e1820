"""A sweep's progress in a CI log (no terminal): a line when a cell starts, a heartbeat while a cell runs
past a minute, a line when it finishes. The clock is injected: no test waits on real time."""

from __future__ import annotations

import io

from rich.console import Console

from detaudit.progress import QUIET_S, CellProgress, steps


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _progress(terminal: bool, clock: Clock, ticker: bool = False):
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=terminal, width=200)
    return CellProgress(console, 3, 0, {"c1": 20, "c2": 8}, clock=clock, ticker=ticker), buf


def test_start_heartbeat_and_end_lines_off_a_terminal():
    clock = Clock()
    progress, buf = _progress(False, clock)
    with progress:
        progress.event("c1", "start", 0)
        progress.event("c1", "tokens", 5)
        clock.now += 59.9
        progress.beat()  # not yet a minute: nothing
        clock.now += 0.1
        progress.beat()
        clock.now += 30
        progress.beat()  # a minute since the last line: nothing yet
        clock.now += 30
        progress.event("c1", "tokens", 3)
        progress.beat()
        clock.now += 10
        progress.event("c1", "end", 0)
        progress.event("c2", "start", 0)
        clock.now += 600
        progress.event("c2", "end", 0)
        progress.beat()  # nothing runs: nothing to say
    assert buf.getvalue().splitlines() == [
        "[1/3] c1 started",
        "c1 still running after 60 s (5 of 20 tokens generated)",
        "c1 still running after 120 s (8 of 20 tokens generated)",
        "[1/3] c1 finished in 130.0 s",
        "[2/3] c2 started",
        "[2/3] c2 finished in 600.0 s",
    ]


def test_a_terminal_gets_bars_not_lines():
    clock = Clock()
    progress, buf = _progress(True, clock)
    with progress:
        progress.event("c1", "start", 0)
        clock.now += 3600
        progress.beat()
        assert "still running" not in buf.getvalue() and "started" not in buf.getvalue()
        progress.event("c1", "end", 0)
    assert progress.thread is None


def test_the_heartbeat_thread_stops_with_the_sweep():
    progress, _ = _progress(False, Clock(), ticker=True)
    with progress:
        assert progress.thread is not None and progress.thread.is_alive()
    assert not progress.thread.is_alive()  # woken by the stop event, not by its next tick


def test_bench_steps_print_a_line_each_off_a_terminal():
    clock, buf = Clock(), io.StringIO()
    with steps(Console(file=buf, force_terminal=False, width=200), "vLLM engines", 3, clock=clock) as advance:
        clock.now += 149.4
        advance("TP 2 vllm-bi")
        clock.now += 56
        advance()
    assert buf.getvalue().splitlines() == ["[1/3] vLLM engines: TP 2 vllm-bi (149 s)", "[2/3] vLLM engines (56 s)"]


def test_bench_steps_draw_a_bar_on_a_terminal():
    buf = io.StringIO()
    with steps(Console(file=buf, force_terminal=True, width=100), "kernels", 2) as advance:
        advance("a")
        advance()
    assert "kernels" in buf.getvalue() and "[1/2]" not in buf.getvalue()


def test_transient_bench_steps_are_quiet_off_a_terminal():
    # many short steps (bench kernels): a line once QUIET_S has passed since the last one, and the last step
    clock, buf = Clock(), io.StringIO()
    console = Console(file=buf, force_terminal=False, width=200)
    with steps(console, "kernels", 4, transient=True, clock=clock) as advance:
        for dt in (1, 1, QUIET_S, 1):
            clock.now += dt
            advance()
    assert buf.getvalue().splitlines() == [f"[3/4] kernels ({2 + QUIET_S:.0f} s)", "[4/4] kernels (1 s)"]
