"""The local executor: groups run one after another on this machine, each through its engine (the
built-in engine's worker processes, or vLLM's host process)."""

from __future__ import annotations

import time

from detaudit.engines import Engine, open_engine
from detaudit.errors import CellFailed
from detaudit.executors import CellGroup, CellJob, CellOutput, EventFn, OutputFn, ReferenceFn


def run_job(
    engine: Engine, group: CellGroup, job: CellJob, reference: ReferenceFn, events: EventFn, load_s: float
) -> CellOutput:
    """Generate one cell, then score its reference's outputs (teacher forcing) where they exist."""
    t0 = time.monotonic()
    # only a cell that speculates passes the keyword: engines without speculative decoding are refused
    # by the sweep before they open (`engines.EngineInfo.speculative`)
    spec = {"speculative": job.speculative} if job.speculative is not None and job.speculative.on else {}
    gens = engine.generate(
        job.token_ids,
        job.prompt_ids,
        job.decoding,
        job.batch_size,
        progress=lambda n: events(job.cell_id, "tokens", n),
        background=job.background,
        texts=job.texts,
        **spec,
    )
    gen_s = time.monotonic() - t0
    continuations = [g.token_ids for g in gens] if job.reference_id == job.cell_id else reference(job.reference_id)
    scores = engine.score(job.token_ids, continuations, job.batch_size) if continuations is not None else None
    score_routing = getattr(engine, "last_score_routing", None) if scores is not None else None
    timing = {
        "wall_s": round(time.monotonic() - t0 + load_s, 3),
        "engine_start_s": round(load_s, 3),
        "generate_s": round(gen_s, 3),
        "output_tokens": sum(len(g.token_ids) for g in gens),
    }
    return CellOutput(
        job.cell_id,
        gens,
        scores,
        job.reference_id if scores is not None else None,
        timing,
        describe=engine.describe(),
        emulated=group.options.emulated,
        score_routing=score_routing,
    )


class GroupEngine:
    """One group's engine: opened on its first cell, closed after a failed cell (the next cell reopens
    it). Both executors run cells through it: the local one here, the Ray one inside its actor."""

    def __init__(self, group: CellGroup) -> None:
        self.group = group
        self.engine: Engine | None = None

    def run(self, job: CellJob, reference: ReferenceFn, events: EventFn) -> CellOutput:
        load_s = 0.0
        try:
            if self.engine is None:
                events(job.cell_id, "engine", 0)
                t0 = time.monotonic()
                self.engine = open_engine(self.group.options)
                load_s = time.monotonic() - t0
            return run_job(self.engine, self.group, job, reference, events, load_s)
        except CellFailed as e:
            self.close()
            return CellOutput(job.cell_id, error=str(e))

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.close()


def run_group(group: CellGroup, reference: ReferenceFn, on_output: OutputFn, events: EventFn) -> None:
    """One engine serves the group's cells; a failed cell closes it and the next cell reopens it."""
    runner = GroupEngine(group)
    try:
        for job in group.jobs:
            events(job.cell_id, "start", 0)
            out = runner.run(job, reference, events)
            try:
                on_output(out)
            finally:
                events(job.cell_id, "end", 0)
    finally:
        runner.close()


class LocalExecutor:
    name = "local"

    def run(self, groups: list[CellGroup], reference: ReferenceFn, on_output: OutputFn, events: EventFn) -> None:
        for group in groups:
            run_group(group, reference, on_output, events)

    def describe(self) -> dict:
        return {"name": self.name}
