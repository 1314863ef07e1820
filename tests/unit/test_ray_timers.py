"""The Ray executor's timers (`_Loop.watch` / `handle`): the placement timeout and the hang timeout.

Ray stands in as a stub here (no cluster starts): what is checked is the driver's arithmetic on its slots'
phases and clocks, which a real cluster would only make slow and timing-dependent. tests/integration/
test_ray.py runs the same loop on a real local cluster."""

from __future__ import annotations

from collections import deque
from types import SimpleNamespace

import pytest

from detaudit.executors import ray as ray_executor
from detaudit.executors.ray import _Loop, _Slot

HANG = 20.0
PLACEMENT = 120.0


class _Ex:
    placement_timeout = PLACEMENT
    max_retries = 2

    def __init__(self, ray) -> None:
        self.ray = ray
        self.stopped: list[int] = []

    def _resource(self, group) -> str:
        return "GPU"

    def _stop(self, slot, graceful: bool) -> None:
        self.stopped.append(slot.index)


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _group(tp: int):
    settings = SimpleNamespace(hang_timeout=HANG)
    return SimpleNamespace(label=f"bio+tbik@tp{tp}", options=SimpleNamespace(tp=tp, settings=settings))


@pytest.fixture
def loop(monkeypatch):
    clock = _Clock()
    monkeypatch.setattr(ray_executor.time, "monotonic", clock)
    ray = SimpleNamespace(exceptions=SimpleNamespace(), get=lambda ref: ref.value)
    slots = [_Slot(0, _group(1)), _Slot(1, _group(2))]
    for s in slots:
        s.pending = deque([SimpleNamespace(cell_id=f"cell{s.index}", reference_id=f"cell{s.index}")])
    landed: list = []
    events: list = []
    lp = _Loop(_Ex(ray), slots, lambda cid: None, landed.append, lambda *e: events.append(e))
    lp.landed_outputs, lp.clock = landed, clock
    return lp


def _running(slot: _Slot, since: float) -> None:
    slot.phase, slot.ref, slot.since, slot.tokens_ref = "running", object(), since, object()
    slot.actor = SimpleNamespace()


def test_a_group_that_waited_behind_others_is_not_given_up_when_they_let_go(loop):
    """A TP-2 group placing for longer than the placement timeout while a TP-1 group held the GPUs: when
    the TP-1 group finishes, the placement timeout starts then (the instant between its bundles going and
    Ray placing the TP-2 group is not 'cannot be placed'); it fails only after the timeout with nothing
    holding resources."""
    tp1, tp2 = loop.slots
    tp2.phase, tp2.since = "placing", loop.clock.now
    loop.clock.now += 5 * PLACEMENT
    _running(tp1, loop.clock.now)  # its last token just now
    loop.watch()
    assert tp2.phase == "placing" and not loop.landed_outputs
    tp1.phase, tp1.ref, tp1.tokens_ref = "finished", None, None  # its last cell landed, bundles released
    loop.watch()
    assert tp2.phase == "placing" and not loop.landed_outputs
    loop.clock.now += PLACEMENT - 1
    loop.watch()
    assert tp2.phase == "placing" and not loop.landed_outputs
    loop.clock.now += 2
    loop.watch()
    assert tp2.phase == "finished"
    (out,) = loop.landed_outputs
    assert out.cell_id == "cell1" and "was not placed within 120 s" in out.error


def test_placement_timeout_starts_afresh_when_a_group_holds_resources_again(loop):
    tp1, tp2 = loop.slots
    tp2.phase, tp2.since = "placing", loop.clock.now
    loop.clock.now += PLACEMENT - 10
    loop.watch()  # idle from here
    _running(tp1, loop.clock.now)
    loop.clock.now += HANG / 2
    loop.watch()  # busy again
    tp1.phase, tp1.ref, tp1.tokens_ref = "finished", None, None
    loop.clock.now += HANG / 2
    loop.watch()
    loop.clock.now += PLACEMENT - 1
    loop.watch()
    assert tp2.phase == "placing" and not loop.landed_outputs


def _tokens(loop, slot: _Slot, tokens: int, opening: bool) -> None:
    ref = SimpleNamespace(value=(tokens, opening))
    slot.tokens_ref = ref
    loop.handle(slot, ref)


def test_a_compile_is_not_a_hang_and_its_end_restarts_the_hang_timeout(loop, monkeypatch):
    """An actor whose engine (or its TP ranks) compiles kernels reports it with its token count
    (`tokens()`' second field): the hang timeout is then the engine start's allowance, and counts afresh
    from the compile's end; without a compile, no token for the hang timeout kills the actor."""
    lost: list = []
    monkeypatch.setattr(loop, "lost", lambda slot, why: lost.append((slot.index, why)))
    tp1 = loop.slots[0]
    _running(tp1, loop.clock.now)
    _tokens(loop, tp1, 0, True)  # compiling
    loop.clock.now += HANG * 10
    tp1.tokens_ref = object()
    loop.watch()
    assert not lost
    _tokens(loop, tp1, 0, False)  # compiled, no token yet
    loop.clock.now += HANG - 1
    tp1.tokens_ref = object()
    loop.watch()
    assert not lost
    loop.clock.now += 2
    loop.watch()
    assert lost == [(0, f"no token for {HANG:.0f} s (actor killed as hung)")]


def test_the_actor_reports_this_process_compiling(monkeypatch):
    """`GroupActor.tokens()` says 'not a hang' while `detaudit.compiling` is active in the actor's
    process (its own engine's compile, or one its TP ranks reported to their pool)."""
    from detaudit import compiling

    actor = ray_executor.GroupActor.__new__(ray_executor.GroupActor)
    actor._tokens, actor._opening = 7, False
    assert actor.tokens() == (7, False)
    compiling.begin()
    try:
        assert actor.tokens() == (7, True)
    finally:
        compiling.end()
    assert actor.tokens() == (7, False)
