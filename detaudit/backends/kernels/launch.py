"""Launching a compiled Triton kernel again without the JIT's per-call work.

`kernel[grid](*args)` binds every argument, computes the specialisation key, looks the compiled kernel
up and builds the launch metadata on every call: on the GPU machines' virtualised hosts that is about
50 us of Python per launch, where the launch itself costs about 8 us, and eager decode issues hundreds.
The kernel wrappers therefore launch through the JIT once per *plan* (everything that decides the
specialisation: shapes, strides, dtypes, pointer alignment, config) and keep what it returned: the
compiled kernel and its full argument list. Later calls with the same plan key swap in the new tensors
and call the compiled kernel's launcher directly, exactly as the JIT does after its cache hit (same
binary, same grid, same argument values), so the bits cannot change.

A plan key must cover everything the JIT specialises on. The wrappers key on every integer argument's
source (shape, strides, grid) and on each tensor's dtype and 16-byte alignment (the JIT's pointer
specialisation), so two calls with one key bind the same specialisation.

On CPU tensors (TRITON_INTERPRET=1), and on a Triton whose compiled kernels do not expose the launcher
this relies on, `Launch.first` returns None and the wrappers launch through the JIT every time.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

try:
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older or missing triton: plans are never built
    _knobs = None

_get_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

# plans per wrapper; cleared when one grows past this (a long-running process with ever new shapes)
MAX_PLANS = 4096


def stream(index: int) -> int:
    """The current CUDA stream of device `index` as the launcher takes it (the capture stream while a
    CUDA graph is being captured)."""
    if _get_stream is not None:
        return _get_stream(index)
    return torch.cuda.current_stream(index).cuda_stream  # pragma: no cover


class Launch:
    """A compiled kernel, its grid and its argument list (in the kernel's parameter order, constexprs
    included, as the JIT passes them); `slots` are the positions of the per-call arguments."""

    __slots__ = ("kernel", "grid", "args", "slots", "run", "function", "packed")

    def __init__(self, kernel: Any, grid: tuple[int, int, int], args: list, slots: Sequence[int]) -> None:
        self.kernel = kernel
        self.grid = grid
        self.slots = tuple(slots)
        # the per-call arguments are put in at every launch: the plan keeps none of the first call's tensors
        # (a kept plan holding them would keep their memory, a whole weight or activation, alive for good)
        self.args = [None if i in self.slots else a for i, a in enumerate(args)]
        self.run = kernel.run  # initialises the module handles once
        self.function = kernel.function
        self.packed = kernel.packed_metadata

    @classmethod
    def first(
        cls, jit_fn: Any, grid: tuple[int, ...], args: Sequence, kwargs: dict, slots: Sequence[int]
    ) -> "Launch | None":
        """Launch `jit_fn[grid](*args, **kwargs)` through the JIT (compiling it if needed) and return the
        plan to launch it again, or None where there is nothing to keep (the interpreter, a launch hook
        such as a profiler's, an older Triton)."""
        compiled = jit_fn[grid](*args, **kwargs)
        if _knobs is None or compiled is None or not hasattr(compiled, "packed_metadata"):
            return None
        names = list(jit_fn.arg_names)
        values = dict(zip(names, args))
        values.update((k, v) for k, v in kwargs.items() if k in values or k in names)
        if len(values) != len(names):
            return None  # defaults we did not pass: let the JIT bind them every time
        grid3 = (tuple(grid) + (1, 1))[:3]
        return cls(compiled, grid3, [values[n] for n in names], slots)

    def __call__(self, index: int, *tensors: Any) -> None:
        args = self.args.copy()
        for i, t in zip(self.slots, tensors):
            args[i] = t
        s = stream(index)
        hook = _knobs.runtime.launch_enter_hook
        meta = self.kernel.launch_metadata(self.grid, s, *args) if hook is not None else None
        self.run(
            self.grid[0],
            self.grid[1],
            self.grid[2],
            s,
            self.function,
            self.packed,
            meta,
            hook,
            _knobs.runtime.launch_exit_hook,
            *args,
        )


class Desc:
    """A host-side TMA descriptor as the launcher reads it (base.data_ptr(), shape, strides, padding),
    without the validating dataclass: the plan checked the layout once; the launcher encodes the
    CUtensorMap from these fields at each launch (Triton 3.6 and 3.9 alike)."""

    __slots__ = ("base", "shape", "strides", "block_shape", "layout", "padding")

    def __init__(
        self, base: Any, shape: list[int], strides: list[int], block_shape: list[int], layout: Any = None
    ) -> None:
        self.base = base
        self.shape = shape
        self.strides = strides
        self.block_shape = block_shape
        self.layout = layout
        self.padding = "zero"


def cache_put(cache: dict, key: Any, value: Any) -> None:
    if len(cache) >= MAX_PLANS:
        cache.clear()
    cache[key] = value
