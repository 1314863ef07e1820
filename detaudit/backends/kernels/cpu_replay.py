"""A CPU forward step recorded once and replayed: the CPU's counterpart of a CUDA graph.

A decode step of the invariant backends on CPU is a few hundred compiled calls (the bf16 micro-kernel's
call tables, numba's row, attention and tree kernels) with Python between them: the layers, the
backends' dispatch, each product's operand checks, padding and call tables. At 16 threads of an AMX
Xeon that Python was two thirds of a step (reports/cpu-bf16). `capture(forward)` runs `forward` once
and records what it computed, in order:

- each *unit*: a function that makes compiled calls (`unit`-wrapped: `cpu_calls.run`, the row and
  attention kernels, `cpu_gemm.block_products`) or one compiled call (`call`), with its arguments: the
  numpy views and call tables it was given point into tensors that stay alive with the recording, so
  calling it again reads and writes the same memory;
- each PyTorch op outside a unit (the glue: casts, copies, padding, the final log-softmax), seen by a
  `TorchDispatchMode`: ops that write an argument are made again as they were, ops that return a new
  tensor are made again into the tensor the capture got (by their out= overload, a cast as the copy it
  is), views and `empty` are not made at all
  (a captured view already aliases its base; an empty buffer's contents are whatever the next op writes).

`Replay.run()` then makes exactly those calls, with no Python of the layers in between. The inputs that
change from step to step (token ids, positions) live in tensors the forward read at capture, which the
caller overwrites in place before each replay. Each replayed call computes what the eager call computes
from the same inputs (the same functions on the same memory, in the same order), so a replayed step's bits
are the eager step's: `tests/unit/test_cpu_replay.py` and the engine's replay-against-eager test check it.

What a capture sees it cannot replay is refused (`ReplayUnsupported`): a tensor's value read into Python
through the dispatcher (`.item()`, `bool(t)`: a decision replay would not retake), an op outside ATen (a
collective, whose completion its Python caller waits for), torch ops run on other threads outside a unit
(`cpu_gemm.run_jobs`), a profiler that is recording. Reads that bypass the dispatcher (`.tolist()`, numpy
views read in Python) are not seen: the replay-against-eager tests guard the decode step's code there.
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from detaudit.errors import DetauditError

ENV = "DETAUDIT_CPU_REPLAY"  # auto (the builtin engine replays CPU decode steps where it can) | off

_tls = threading.local()  # .rec: the Recording this thread captures into; .depth: units entered


class ReplayUnsupported(DetauditError):
    """The forward did something a replay cannot redo (the message says what)."""


_SCALAR_READS = {"_local_scalar_dense", "item", "equal", "is_nonzero"}
_NOT_MADE = {"empty", "empty_strided", "empty_like"}


def wanted(device_type: str, whole_cache_exact: bool, tp: int, routes: bool) -> bool:
    """Whether the builtin engine records its CPU decode steps and replays them: a TP-1 dense model (MoE
    routing records and all-reduces are not replayed) on a backend whose attention over the whole cache is
    exact (`Backend.WHOLE_CACHE_EXACT`), unless DETAUDIT_CPU_REPLAY=off."""
    setting = os.environ.get(ENV, "auto").strip().lower()
    if setting not in ("auto", "off"):
        raise DetauditError(f"{ENV}={setting!r}: use auto or off")
    return setting == "auto" and device_type == "cpu" and whole_cache_exact and tp == 1 and not routes


def _writes(func) -> bool:
    return any(a.alias_info is not None and a.alias_info.is_write for a in func._schema.arguments)


def _aliased(func, args, outs: list) -> bool:
    """Whether the op's outputs alias its inputs: a view, or an op that may return its input (`to`,
    `contiguous`) and did (one that made a copy instead is redone like any other)."""
    if not any(r.alias_info is not None for r in func._schema.returns):  # (`is_view` is True for `to` too)
        return False
    bases = {t.untyped_storage().data_ptr() for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor)}
    return all(t.untyped_storage().data_ptr() in bases for t in outs)


class _Ops(TorchDispatchMode):
    """Records the PyTorch ops the capturing thread makes outside a unit."""

    def __init__(self, rec: "Recording") -> None:
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _recorder() is not self.rec:
            return out
        name = func._schema.name.split("::")[-1]
        if name in _SCALAR_READS:
            raise ReplayUnsupported(f"the step reads a tensor's value into Python ({func}): replay would not")
        if func.namespace == "profiler":
            raise ReplayUnsupported("a profiler is recording: the step is not captured")
        if func.namespace != "aten":
            raise ReplayUnsupported(f"the step calls {func}, which a replay cannot redo")
        self.rec.keep(out)
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        writes = _writes(func)
        if name in _NOT_MADE or (not writes and _aliased(func, args, outs)):
            return out
        self.rec.steps.append((lambda: func(*args, **kwargs)) if writes else _into(func, name, args, kwargs, outs))
        return out


def _into(func, name: str, args, kwargs, outs: list) -> Callable[[], None]:
    """A step making `func(*args, **kwargs)` again into the captured `outs`: by its out= overload where
    it has one (no new tensor: a fresh allocation of a large output is page faults at every replay), a cast
    (`to`, `_to_copy`) as the copy into the captured tensor that `_to_copy` itself is; else the op, then
    its results copied in."""
    if name in ("to", "_to_copy") and len(outs) == 1 and isinstance(args[0], torch.Tensor):
        src, dst = args[0], outs[0]
        return lambda: dst.copy_(src)
    out_op = _out_overload(func)
    if out_op is not None and len(out_op[1]) == len(outs):
        op, names = out_op
        given = {**kwargs, **dict(zip(names, outs))}
        return lambda: op(*args, **given)

    def again() -> None:
        fresh = [t for t in tree_flatten(func(*args, **kwargs))[0] if isinstance(t, torch.Tensor)]
        for have, new in zip(outs, fresh):
            have.copy_(new)

    return again


def _out_overload(func):
    """(the out= overload of `func`, its out arguments' names): the overload whose other arguments are
    `func`'s, by name and type, for an op with a kernel of its own (a composite op's out= overload may
    decompose otherwise than the op: `linear`, `matmul`); None where there is none."""
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    if not (has(func.name(), "CPU") or has(func.name(), "CompositeExplicitAutograd")):
        return None
    want = [(a.name, str(a.type)) for a in func._schema.arguments]
    packet = func.overloadpacket
    for overload in packet.overloads():
        op = getattr(packet, overload)
        outs = [a.name for a in op._schema.arguments if a.is_out]
        if outs and [(a.name, str(a.type)) for a in op._schema.arguments if not a.is_out] == want:
            return op, outs
    return None


class Recording:
    def __init__(self) -> None:
        self.steps: list[Callable[[], None]] = []
        self._alive: list = []  # every tensor the capture made: tables and numpy views hold raw addresses

    def keep(self, x) -> None:
        self._alive.append(x)


def _recorder() -> Recording | None:
    """The Recording this thread captures into, where it is outside any unit (inside one, the unit is
    what is recorded)."""
    return None if getattr(_tls, "depth", 0) else getattr(_tls, "rec", None)


def recording() -> bool:
    """Whether this thread is capturing a step (outside any unit)."""
    return _recorder() is not None


def unit(fn: Callable) -> Callable:
    """`fn` recorded as one step of a capture (the Python and ops inside it are made again by calling it
    again). `fn` must compute only from its arguments and write only into them or its result; a tensor
    result is copied into the captured one at replay."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        rec = _recorder()
        if rec is None:
            return fn(*args, **kwargs)
        _tls.depth = 1
        try:
            out = fn(*args, **kwargs)
        finally:
            _tls.depth = 0
        rec.keep((args, kwargs, out))
        if isinstance(out, torch.Tensor):
            rec.steps.append(lambda: out.copy_(fn(*args, **kwargs)))
        else:
            rec.steps.append(lambda: fn(*args, **kwargs))
        return out

    return wrapped


def call(fn: Callable, *args) -> None:
    """fn(*args) (a compiled kernel writing into its arguments), recorded where a capture is running."""
    fn(*args)
    rec = _recorder()
    if rec is not None:
        rec.keep(args)
        rec.steps.append(lambda: fn(*args))


def keep(*objects) -> None:
    """Keep `objects` alive with the recording this thread is capturing into, if any: operands a call table
    addresses by raw pointer that nothing recorded holds (a packed weight cached elsewhere)."""
    rec = getattr(_tls, "rec", None)
    if rec is not None:
        rec.keep(objects)


def refuse_threads(what: str) -> None:
    """Called where torch ops are about to run on worker threads: a capture outside a unit cannot see
    them."""
    if recording():
        raise ReplayUnsupported(f"{what} runs torch ops on worker threads outside a recorded unit")


class Replay:
    """The recorded steps of one capture and the forward's outputs (the tensors each replay rewrites)."""

    def __init__(self, rec: Recording, out) -> None:
        self._rec = rec
        self.steps = tuple(rec.steps)
        self.out = out

    def run(self):
        for step in self.steps:
            step()
        return self.out


def capture(forward: Callable[[], object]) -> Replay:
    """Run `forward()` once, recording it (see the module's doc): its outputs and the Replay that makes
    them again. `forward` should have run once before (lazy caches: packed weights, compiled kernels), or
    their making is recorded and repeated every replay."""
    if torch.autograd._profiler_enabled():
        raise ReplayUnsupported("a profiler is recording: the step is not captured")
    if getattr(_tls, "rec", None) is not None:
        raise ReplayUnsupported("a capture is already running on this thread")
    rec = Recording()
    _tls.rec, _tls.depth = rec, 0
    try:
        with _Ops(rec):
            out = forward()
    finally:
        _tls.rec = None
    rec.keep(out)
    return Replay(rec, out)
