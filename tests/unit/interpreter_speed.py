"""The Triton interpreter without its repeated patch of the language inside a kernel, for the scripts that
run under TRITON_INTERPRET=1 (`triton_checks.py`, `peer_checks.py`): the kernels compute the same, in less
CI time.

The interpreter patches `triton.language` for numpy (every builtin wrapped) when a kernel launches
(`GridExecutor.__call__`, undone when it returns), and again at every call of a `@triton.jit` helper
inside it (`InterpretedFunction.__call__`: `tl.cdiv`, `tl.zeros`, the kernels' own helpers), a patch it
never undoes. From the second such call on in a launch, the modules it patches are patched already:
`inspect.getmembers` over them finds nothing left to wrap, and the same wrappers are set again. Those
repeats were a quarter of `triton_checks.py`'s CPU time, a sixth of `peer_checks.py`'s. Here a helper's
call skips its patch when the running launch, or a helper's call in it, already patched every language
module the helper sees (`triton.language` / `triton.language.core` in its globals,
`interpreter._patch_lang`'s choice); any other call, and every launch, patches as Triton does."""

from __future__ import annotations

import threading

import triton.language as tl
from triton.runtime import interpreter

_running = threading.local()  # per thread: the language modules patched in each running launch, innermost last


def _languages(fn) -> set[int]:
    """The language modules the interpreter patches for `fn` (`interpreter._patch_lang`'s choice)."""
    return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}


def install() -> None:
    launch_call = interpreter.GridExecutor.__call__
    helper_call = interpreter.InterpretedFunction.__call__

    def launch(self, *args, **kwargs):
        stack = _running.__dict__.setdefault("stack", [])
        stack.append(_languages(self.fn))
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            stack.pop()

    def helper(self, *args, **kwargs):
        stack = getattr(_running, "stack", None)
        if not stack:  # a helper called outside any launch
            return helper_call(self, *args, **kwargs)
        languages = _languages(self.fn)
        if not languages <= stack[-1]:
            stack[-1] |= languages  # patched by this call (never undone) for the rest of the launch
            return helper_call(self, *args, **kwargs)
        fn = self.rewrite()  # Triton's own call, less its `_patch_lang(self.fn)`
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = launch
    interpreter.InterpretedFunction.__call__ = helper
