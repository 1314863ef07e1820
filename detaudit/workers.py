"""Engines in worker processes, driven over pipes: the built-in engine's real-TP ranks (one process per
rank) and vLLM's offline engine (one process hosting it, which runs its own ranks).

The controller (`WorkerPool`) starts N processes running `python -m ENTRY RANK SIZE PORT FD LISTEN_FD`,
where ENTRY is the engine's own worker module (`detaudit.builtin.rank`, `detaudit.vllm.host`), and sends
each one the group's `EngineOptions` whole (pickled over the pipe). The worker module calls `serve`,
which builds its engine from those options and answers generate / score / describe / timings calls;
once `serve` has closed the engine on "close", the worker module ends the process with `exit_now`.

Failure handling: a worker that dies fails the command at once; a worker that sends no progress for
`hang_timeout` seconds fails it too. Either way every worker is killed (no orphans: workers also die
with their parent through PR_SET_PDEATHSIG) and the next call reopens the engine. A worker compiling
detaudit's CPU kernels, or waiting for another process's compile (`detaudit.compiling`), says so, and
meanwhile the controller allows it the engine start's `ENGINE_START_S` instead: a fresh install's
first call compiles for a minute or two without a token, and is not a hang.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

from detaudit import compiling
from detaudit.errors import CellFailed
from detaudit.runs.records import Generation, ProgressFn

FAULT_ENV = "DETAUDIT_FAULT_INJECT"  # tests: "crash:RANK" or "hang:RANK" (at the first generate)


# ---- the worker side -------------------------------------------------------------------------------


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _inject_fault(rank: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if not spec:
        return
    kind, _, who = spec.partition(":")
    if who and int(who) != rank:
        return
    if kind == "crash":
        os._exit(17)
    if kind == "hang":
        while True:
            time.sleep(60)


def worker_args() -> tuple[int, int, int, Connection, int]:
    """(rank, size, port, pipe, listen fd) of this worker, from the command line `WorkerPool` gave it.
    LISTEN_FD: rank 0's inherited store socket, listening on 127.0.0.1:PORT (-1 on other ranks)."""
    rank, size, port, fd, listen_fd = (int(a) for a in sys.argv[1:6])
    return rank, size, port, Connection(fd), listen_fd


def serve(rank: int, conn: Connection, open_engine: Callable[[Any, dict], Any]) -> bool:
    """A worker's life: receive ("open", (options, extra)), build the engine with `open_engine(options,
    extra)`, answer calls until "close". Errors are reported to the controller (first line + a short
    traceback) and end the process with a non-zero code. True once the engine was closed on "close";
    False when the controller went away first (the engine left as it was)."""
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller handles Ctrl-C and kills us
    engine = None
    sending = threading.Lock()  # a compile's notice may come from another thread (a team worker's first call)

    def send(msg: tuple) -> None:
        with sending:
            conn.send(msg)

    compiling.listen(lambda on: send(("compiling", on)))
    try:
        cmd, (options, extra) = conn.recv()
        assert cmd == "open", cmd
        engine = open_engine(options, extra)
        send(("ready", engine.describe()))
        while True:
            cmd, payload = conn.recv()
            if cmd == "close":
                break
            if cmd == "generate":
                _inject_fault(rank)
                progress = (lambda n: send(("progress", n))) if rank == 0 else None
                args, kwargs = payload
                res: Any = engine.generate(*args, progress=progress, **kwargs)
            elif cmd == "score":
                args, kwargs = payload
                res = engine.score(*args, **kwargs)
            elif cmd == "describe":
                res = engine.describe()
            elif cmd == "timings":
                res = getattr(engine, "last_timings", {})
            elif cmd == "score_routing":
                res = getattr(engine, "last_score_routing", None)
            elif cmd == "profile":
                res = getattr(engine, "last_profile", None)
            else:
                raise ValueError(f"unknown command {cmd}")
            send(("result", res if rank == 0 else None))
        engine.close()
        return True
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        return False
    except BaseException as e:  # report, then exit non-zero
        try:
            send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"))
        except Exception:
            pass
        os._exit(1)


def exit_now() -> None:
    """End a worker process whose engine `serve` closed (a TP rank: once it has left its process group
    too): flush its output and exit without the interpreter's teardown, which here only frees memory
    and the libraries' state (the closed engine has stopped whatever it started: vLLM's own workers) and
    costs about 0.35 s of CPU with torch imported, near 2 s in a vLLM host, while the controller waits."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ---- the controller --------------------------------------------------------------------------------


# how long a worker (or a Ray actor) may take to open its engine, loading the model, before it answers:
# the hang timeout counts only from then on
ENGINE_START_S = 600.0


class WorkerPool:
    """N worker processes serving one engine; the Engine interface.

    `entry`: the worker module (run with -m); `extra`: what each worker gets beside the options (threads,
    ...); `rank0_socket`: a listening socket rank 0 inherits (the process group's store); `log`: a file
    for the workers' own output (default: this process's); `remove_on_close`: a directory of the engine's
    (logs, markers) removed on a clean close and kept after a failure, whose message names it;
    `hosted`: one process hosting an engine whose description changes per call (vLLM's knobs); `label`:
    what the workers are called in failure messages."""

    def __init__(
        self,
        entry: str,
        options: Any,
        nprocs: int,
        *,
        hang_timeout: float,
        extra: dict | None = None,
        env: dict[str, str] | None = None,
        rank0_socket: socket.socket | None = None,
        log: str | None = None,
        remove_on_close: str | None = None,
        hosted: bool = False,
        label: str = "TP worker",
        start_timeout: float = ENGINE_START_S,
    ) -> None:
        self.hang_timeout, self.label = hang_timeout, label
        self.log, self.remove_on_close, self.hosted = log, remove_on_close, hosted
        self.keep_log = False  # set when a failure's message names the log
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        port = rank0_socket.getsockname()[1] if rank0_socket is not None else 0
        try:
            for r in range(nprocs):
                parent, child = socket.socketpair()
                fds = (child.fileno(),) + ((rank0_socket.fileno(),) if rank0_socket is not None and r == 0 else ())
                listen_fd = fds[1] if len(fds) > 1 else -1
                argv = [
                    sys.executable,
                    "-m",
                    entry,
                    str(r),
                    str(nprocs),
                    str(port),
                    str(child.fileno()),
                    str(listen_fd),
                ]
                out = open(log, "ab") if log else None
                p = subprocess.Popen(
                    argv,
                    pass_fds=fds,
                    env={**os.environ, **(env or {})},
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=out,
                )
                if out is not None:
                    out.close()
                child.close()
                self.procs.append(p)
                conn = Connection(parent.detach())
                self.conns.append(conn)
                conn.send(("open", (options, extra or {})))
            if rank0_socket is not None:
                rank0_socket.close()  # rank 0 holds it now
                rank0_socket = None
            self._describe = self._collect("ready", start_timeout)[0]
        except BaseException:
            if rank0_socket is not None:
                rank0_socket.close()
            self.keep_log = True
            self.close()
            raise

    def _who(self, r: int) -> str:
        return f"{self.label} (log: {self.log})" if self.hosted else f"{self.label} rank {r}"

    def _collect(self, expect: str, timeout: float, progress: ProgressFn | None = None) -> list[Any]:
        compiles: set[int] = set()  # ranks compiling now: this process says so too (a Ray actor's hang timer)
        try:
            return self._gather(expect, timeout, progress, compiles)
        finally:
            if compiles:
                compiling.end()

    def _gather(self, expect: str, timeout: float, progress: ProgressFn | None, compiles: set[int]) -> list[Any]:
        results: dict[int, Any] = {}
        allowed = timeout
        deadline = time.monotonic() + allowed
        pending = dict(enumerate(self.conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                what = "compiling the CPU kernels" if compiles else "no progress"
                raise CellFailed(f"{self.label} hung: {what} for {allowed:.0f} s (workers killed)")
            ready = wait(list(pending.values()), timeout=min(0.5, left))
            for r, p in enumerate(self.procs):
                if p.poll() is not None and not (r in pending and pending[r].poll()):
                    raise CellFailed(f"{self._who(r)} died (exit code {p.returncode})")
            for r, c in list(pending.items()):
                if c not in ready:
                    continue
                try:
                    kind, data = c.recv()
                except (EOFError, OSError):
                    try:
                        code = self.procs[r].wait(2)
                    except subprocess.TimeoutExpired:
                        code = None
                    raise CellFailed(f"{self._who(r)} died (pipe closed, exit code {code})") from None
                if kind == "progress":
                    deadline = time.monotonic() + allowed
                    if progress:
                        progress(data)
                elif kind == "compiling":  # a first use's compile, or a wait for another's: not a hang
                    before = bool(compiles)
                    (compiles.add if data else compiles.discard)(r)
                    if bool(compiles) != before:
                        (compiling.begin if compiles else compiling.end)()
                    allowed = max(timeout, ENGINE_START_S) if compiles else timeout
                    deadline = time.monotonic() + allowed
                elif kind == "error":
                    raise CellFailed(data.splitlines()[0] if data else f"rank {r} failed")
                elif kind == expect:
                    results[r] = data
                    del pending[r]
        return [results[r] for r in range(len(self.conns))]

    def _call(self, cmd: str, payload: Any, progress: ProgressFn | None = None) -> Any:
        if not self.procs:
            raise CellFailed("the engine's worker processes are not running")
        try:
            for c in self.conns:
                c.send((cmd, payload))
            return self._collect("result", self.hang_timeout, progress)[0]
        except BaseException:
            self.keep_log = True
            self.close()
            raise

    def generate(self, prompts, prompt_ids, decoding, batch_size: int, progress: ProgressFn | None = None, **load):
        args = (list(map(list, prompts)), list(prompt_ids), decoding, batch_size)
        out: list[Generation] = self._call("generate", (args, load), progress)
        return out

    def score(self, prompts, continuations, batch_size: int, **kwargs) -> list[list[float]]:
        args = (list(map(list, prompts)), list(map(list, continuations)), batch_size)
        return self._call("score", (args, kwargs))

    @property
    def last_timings(self) -> dict:
        """Rank 0's timings of the last generate call."""
        return self._call("timings", ())

    @property
    def last_profile(self) -> dict | None:
        """Rank 0's self time per op of the last generate call made with profile=True (its own kernels and
        collectives, profiled in its process), or None."""
        return self._call("profile", ())

    @property
    def last_score_routing(self) -> list | None:
        """Rank 0's routing of the last score call (MoE models), or None."""
        return self._call("score_routing", ())

    def describe(self) -> dict:
        if self.hosted:
            return self._call("describe", ())
        return {**self._describe, "workers": len(self.procs)}

    def close(self) -> None:
        for c in self.conns:
            try:
                c.send(("close", None))
            except Exception:
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            try:
                p.wait(max(0.01, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(5)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []
        if self.remove_on_close and not self.keep_log:
            shutil.rmtree(self.remove_on_close, ignore_errors=True)
