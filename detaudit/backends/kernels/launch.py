"""Launching a compiled Triton kernel again without the JIT's per-call work.

`kernel[grid](*args)` binds every argument, computes the specialisation key, looks the compiled kernel
up and builds the launch metadata on every call: on the H100 machines (a slow virtualised host) that is
about 50 us of Python per launch, where the launch itself costs about 8 us (reports/gpu/eager-host-cost-h100.md).
The kernel wrappers therefore launch through the JIT once per *plan* (everything that decides the
specialisation: shapes, strides, dtypes, pointer alignment, config) and keep what it returned: the
compiled kernel and its full argument list. Later calls with the same plan key swap in the new tensors
and call the compiled kernel's launcher directly, exactly as the JIT does after its cache hit (same
binary, same grid, same argument values), so the bits cannot change.

A plan key must cover everything the JIT specialises on. The wrappers key on every integer argument's
source (shape, strides, grid) and on each tensor's dtype and 16-byte alignment (the JIT's pointer
specialisation), so two calls with one key bind the same specialisation.

On CPU tensors (TRITON_INTERPRET=1) the JIT launch returns nothing to keep: `Launch.first` returns None
and the wrappers launch through the JIT every time.

Under Triton 3.6 (the version the GPU machines run), a kept plan goes one level lower (`Direct`): the
launcher's Python layer (`CudaLauncher.__call__`: scratch allocation, the tensor-descriptor expansion loop,
the launch metadata and two calls of the empty launch-hook chains) is replaced by one call of the compiled
C `launch` function with an argument list built once per plan: per call only the stream, the tensors'
pointers (passed as integers, as the launcher accepts them) and, for a tensor-descriptor argument, the
CUtensorMap the driver encoded for that base pointer (kept per pointer) change. Same function, grid and
argument values as the launcher passes, so the same bits. Taken only where nothing else would run at
launch: no launch hook registered (a profiler's), no global or profile scratch, every descriptor lowered to
TMA; any other Triton version keeps the launcher's path.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

try:
    import triton as _triton
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover - older or missing triton: plans are never built
    _triton = _knobs = None

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

    __slots__ = ("kernel", "grid", "args", "slots", "run", "function", "packed", "direct")

    def __init__(self, kernel: Any, grid: tuple[int, int, int], args: list, slots: Sequence[int]) -> None:
        self.kernel = kernel
        self.grid = grid
        self.args = args
        self.slots = tuple(slots)
        self.run = kernel.run  # initialises the module handles once
        self.function = kernel.function
        self.packed = kernel.packed_metadata
        self.direct = Direct.of(self)

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
        if self.direct is not None and hooks_idle():
            self.direct(stream(index), tensors)
            return
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


def hooks_idle() -> bool:
    """No launch hook is registered (Triton 3.6 keeps them as chains that are never None)."""
    r = _knobs.runtime
    return _idle(r.launch_enter_hook) and _idle(r.launch_exit_hook)


def _idle(hook: Any) -> bool:
    return hook is None or (type(hook).__name__ == "HookChain" and not hook.calls)


class Direct:
    """A kept plan launched through the compiled C launcher itself (Triton 3.6's protocol: 13 launch
    arguments, then the kernel's, each tensor descriptor expanded to its CUtensorMap, shape and strides).
    `template` is that argument list with the plan's values; per call the stream, each per-call tensor's
    pointer and each per-call descriptor's expansion are put in."""

    __slots__ = ("raw", "encode", "template", "where", "descs")

    BASE = 13  # gridX, gridY, gridZ, stream, function, cooperative, pdl, global scratch, profile scratch,
    #            packed metadata, launch metadata, enter hook, exit hook

    def __init__(self, raw: Any, encode: Any, template: list, where: list[tuple[int, int, Any]]) -> None:
        self.raw = raw
        self.encode = encode  # the driver's descriptor expansion, (descriptor, metadata) -> its arguments
        self.template = template
        self.where = where  # per slot: (position, width, descriptor metadata or None for a pointer)
        self.descs: dict[tuple[int, int], list] = {}  # (slot, base pointer) -> the descriptor's expansion

    @classmethod
    def of(cls, plan: "Launch") -> "Direct | None":
        if _triton is None or not _triton.__version__.startswith("3.6."):
            return None
        try:
            from triton.backends.nvidia import driver as nv
        except ImportError:  # pragma: no cover
            return None
        run = plan.run
        if (
            getattr(nv, "_BASE_ARGS_FORMAT_LEN", None) != cls.BASE
            or type(run).__name__ != "CudaLauncher"
            or run.global_scratch_size
            or run.profile_scratch_size
        ):
            return None
        raw = _raw_launch(run.launch)
        signature = list(getattr(plan.kernel.src, "signature", {}).values())
        metas = list(getattr(plan.kernel.metadata, "tensordesc_meta", None) or [])
        if raw is None or len(signature) != len(plan.args):
            return None
        template = [
            *plan.grid,
            0,
            plan.function,
            run.launch_cooperative_grid,
            run.launch_pdl,
            None,
            None,
            plan.packed,
            None,
            None,
            None,
        ]
        where: dict[int, tuple[int, int, Any]] = {}
        for i, (sig, value) in enumerate(zip(signature, plan.args)):
            if isinstance(sig, str) and sig.startswith("tensordesc"):
                if not metas:
                    return None  # decomposed in the frontend (no TMA): the launcher's path
                meta = metas.pop(0)
                expanded = nv.make_tensordesc_arg(value, meta)
                where[i] = (len(template), len(expanded), meta)
                template.extend(expanded)
            else:
                where[i] = (len(template), 1, None)
                template.append(value.data_ptr() if isinstance(value, torch.Tensor) and value.is_cuda else value)
        if metas:
            return None
        return cls(raw, nv.make_tensordesc_arg, template, [where[i] for i in plan.slots])

    def __call__(self, stream: int, tensors: Sequence[Any]) -> None:
        args = self.template.copy()
        args[3] = stream
        for slot, ((pos, width, meta), t) in enumerate(zip(self.where, tensors)):
            if meta is None:
                args[pos] = t.data_ptr()
            else:
                key = (slot, t.base.data_ptr())
                expanded = self.descs.get(key)
                if expanded is None:
                    expanded = self.encode(t, meta)
                    cache_put(self.descs, key, expanded)
                args[pos : pos + width] = expanded
        self.raw(*args)


def _raw_launch(launch: Any) -> Any:
    """The compiled C `launch` behind a CudaLauncher's `launch` (itself, or the function its tensor-
    descriptor wrapper closes over)."""
    if type(launch).__name__ == "builtin_function_or_method":
        return launch
    for cell in getattr(launch, "__closure__", None) or ():
        value = cell.cell_contents
        if type(value).__name__ == "builtin_function_or_method" and value.__name__ == "launch":
            return value
    return None


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
