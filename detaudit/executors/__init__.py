"""The executor seam: where a (engine, backend, TP) group of cells runs.

The sweep hands an executor `CellGroup`s; the executor opens the group's engine (through
`detaudit.engines`), runs its cells in order and hands each finished cell back as a `CellOutput` to
the driver's `on_output`, which alone writes the run directory. Executors: `local` (this machine: the
engine's own worker processes) and `ray` (an actor per group on a Ray cluster; optional extra).

Teacher forcing: each cell scores a reference cell's outputs (the first cell of its backend and
suite). A job that *is* its reference scores its own outputs; otherwise the executor asks the driver
(`reference(cell_id)`) for the reference's token ids, or gets None when they do not exist (yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from detaudit.config import DecodingParams, EngineOptions, Speculative
from detaudit.errors import DetauditError
from detaudit.runs.records import Generation


@dataclass
class CellJob:
    cell_id: str
    batch_size: int
    prompt_ids: list[str]
    token_ids: list[list[int]]
    reference_id: str  # the cell whose outputs this one scores (itself for a reference cell)
    decoding: DecodingParams  # the cell's suite's decoding (its generation_kwargs under the command line's)
    texts: list[str] = field(default_factory=list)  # the prompts' user messages (server engines' chat API)
    background: int = 0  # server engines: background requests in flight while the cell runs
    speculative: Speculative | None = None  # the cell's speculative decoding (None: off)


@dataclass
class CellGroup:
    options: EngineOptions
    jobs: list[CellJob]

    @property
    def label(self) -> str:
        return f"{self.options.backend}@tp{self.options.tp}"


@dataclass
class CellOutput:
    cell_id: str
    generations: list[Generation] | None = None
    scores: list[list[float]] | None = None  # teacher forcing of `reference_id`'s outputs, or None
    reference_id: str | None = None
    timing: dict = field(default_factory=dict)
    describe: dict = field(default_factory=dict)  # the engine's facts when it ran this cell
    emulated: bool = False
    error: str | None = None  # the cell failed (worker crash, hang, ...); the sweep goes on
    placement: dict = field(default_factory=dict)  # where it ran (node, devices) when the executor knows
    score_routing: list | None = None  # MoE models: the routing of the scored positions, per record


ReferenceFn = Callable[[str], "list[list[int]] | None"]
OutputFn = Callable[[CellOutput], None]
EventFn = Callable[[str, str, int], None]  # (cell id, event "start" | "engine" | "tokens" | "end", tokens)


class Executor(Protocol):
    name: str

    def run(self, groups: list[CellGroup], reference: ReferenceFn, on_output: OutputFn, events: EventFn) -> None: ...

    def describe(self) -> dict: ...


def get_executor(name: str, **options) -> Executor:
    if name == "local":
        from detaudit.executors.local import LocalExecutor

        return LocalExecutor()
    if name == "ray":
        from detaudit.executors.ray import RayExecutor

        return RayExecutor(**options)
    raise DetauditError(f"unknown executor {name!r} (available: local, ray)")
