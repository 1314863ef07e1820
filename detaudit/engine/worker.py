"""Real TP: the tool launches one worker process per rank (gloo on CPU, NCCL on GPU, one GPU per
rank) and drives them over pipes. Workers start once per (backend, TP) and serve every cell of it.

Failure handling: a worker that dies fails the command at once; a worker that sends no progress for
`hang_timeout` seconds fails it too. Either way every worker is killed (no orphans: workers also
die with their parent through PR_SET_PDEATHSIG) and the next command restarts the pool.
"""

from __future__ import annotations

import ctypes
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import traceback
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any, Sequence

from detaudit.config import DecodingParams
from detaudit.engine.local import cpu_cores
from detaudit.errors import CellFailed
from detaudit.records import Generation, ProgressFn

FAULT_ENV = "DETAUDIT_FAULT_INJECT"  # tests: "crash:RANK" or "hang:RANK" (at the first generate)


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


def _entry() -> None:
    """`python -c 'from detaudit.engine.worker import _entry; _entry()' RANK SIZE PORT FD LISTEN_FD SPEC`.
    LISTEN_FD: rank 0's inherited store socket, listening on 127.0.0.1:PORT (-1 on other ranks)."""
    rank, size, port, fd, listen_fd = (int(a) for a in sys.argv[1:6])
    _worker_main(rank, size, port, Connection(fd), json.loads(sys.argv[6]), listen_fd)


def _worker_main(rank: int, size: int, port: int, conn: Connection, spec: dict, listen_fd: int = -1) -> None:
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the controller handles Ctrl-C and kills us
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    group = None  # the process group this rank joins (none where the process hosts another engine)
    try:
        import torch

        from detaudit.engine import dist
        from detaudit.engine.local import LocalEngine

        device = f"cuda:{rank}" if spec["device"].startswith("cuda") else "cpu"
        if spec.get("host"):  # one process hosting another engine (e.g. vLLM), which runs its own TP workers
            os.environ.update(spec.get("env", {}))
            module, _, factory = spec["host"].partition(":")
            engine: Any = getattr(importlib.import_module(module), factory)(spec)
        else:
            if device != "cpu":
                torch.cuda.set_device(rank)
            torch.set_num_interop_threads(1)
            group = dist.init(rank, size, port, device, listen_fd=listen_fd)
            engine = LocalEngine(
                Path(spec["model_path"]),
                spec["backend"],
                size,
                rank=rank,
                group=group,
                dtype=spec["dtype"],
                device=device,
                eos_ids=spec["eos_ids"],
                threads=spec["threads"],
                cuda_graphs=spec.get("cuda_graphs", True),
            )
        conn.send(("ready", engine.describe()))
        while True:
            cmd, payload = conn.recv()
            if cmd == "close":
                break
            if cmd == "generate":
                _inject_fault(rank)
                progress = (lambda n: conn.send(("progress", n))) if rank == 0 else None
                res: Any = engine.generate(*payload, progress=progress)
            elif cmd == "score":
                res = engine.score(*payload)
            elif cmd == "describe":
                res = engine.describe()
            elif cmd == "timings":
                res = getattr(engine, "last_timings", {})
            else:
                raise ValueError(f"unknown command {cmd}")
            conn.send(("result", res if rank == 0 else None))
        engine.close()
        dist.shutdown(group)
    except (EOFError, BrokenPipeError, KeyboardInterrupt):
        pass
    except BaseException as e:  # report, then exit non-zero
        try:
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"))
        except Exception:
            pass
        os._exit(1)


class DistEngine:
    """Controller for C worker processes; same interface as LocalEngine."""

    def __init__(
        self,
        model_path: Path,
        backend: str,
        tp: int,
        *,
        dtype: str = "bfloat16",
        device: str = "cpu",
        eos_ids: Sequence[int] = (),
        hang_timeout: float = 300.0,
        start_timeout: float = 600.0,
        host: dict | None = None,
        cuda_graphs: bool = True,
    ) -> None:
        """`host`: instead of one worker per rank, start one process that hosts another engine, which
        runs its own TP workers: `{"host": "module:factory", "env": {...}, "log": FILE, ...}`; the worker
        calls `factory(spec)` with this engine's spec merged with `host`."""
        from detaudit.engine.dist import listen_socket

        self.tp = tp
        self.hang_timeout = hang_timeout
        self.hosted = host is not None
        self.keep_log = False  # set when a failure's message names the host's log file
        threads = max(1, cpu_cores() // tp) if not device.startswith("cuda") else 1
        self.spec = dict(
            model_path=str(model_path),
            backend=backend,
            dtype=dtype,
            device=device,
            eos_ids=list(eos_ids),
            threads=threads,
            tp=tp,
            cuda_graphs=cuda_graphs,
            **(host or {}),
        )
        nprocs = 1 if self.hosted else tp
        # rank 0's store socket: bound to 127.0.0.1 here, before any worker starts, and inherited by
        # rank 0 only (no free-port race, nothing listens on another interface)
        store_sock = None if self.hosted else listen_socket()
        port = store_sock.getsockname()[1] if store_sock else 0
        self.procs: list[subprocess.Popen] = []
        self.conns: list[Connection] = []
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        try:
            for r in range(nprocs):
                parent, child = socket.socketpair()
                fds = (child.fileno(),) + ((store_sock.fileno(),) if store_sock and r == 0 else ())
                listen_fd = fds[1] if len(fds) > 1 else -1
                code = "from detaudit.engine.worker import _entry; _entry()"
                argv = [
                    sys.executable,
                    "-c",
                    code,
                    str(r),
                    str(nprocs),
                    str(port),
                    str(child.fileno()),
                    str(listen_fd),
                    json.dumps(self.spec),
                ]
                log = open(host["log"], "ab") if host and host.get("log") else None  # vLLM's own chatter
                p = subprocess.Popen(argv, pass_fds=fds, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
                if log is not None:
                    log.close()
                child.close()
                self.procs.append(p)
                self.conns.append(Connection(parent.detach()))
            if store_sock is not None:
                store_sock.close()  # rank 0 holds it now
                store_sock = None
            self._describe = self._collect("ready", start_timeout)[0]
        except BaseException:
            if store_sock is not None:
                store_sock.close()
            self.keep_log = True
            self.close()
            raise

    def _who(self, r: int) -> str:
        if self.hosted:
            return f"vLLM engine process (log: {self.spec.get('log')})"
        return f"TP worker rank {r}"

    # ---- protocol
    def _collect(self, expect: str, timeout: float, progress: ProgressFn | None = None) -> list[Any]:
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(self.conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CellFailed(f"TP worker hung: no progress for {timeout:.0f} s (workers killed)")
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
                    deadline = time.monotonic() + timeout
                    if progress:
                        progress(data)
                elif kind == "error":
                    raise CellFailed(data.splitlines()[0] if data else f"rank {r} failed")
                elif kind == expect:
                    results[r] = data
                    del pending[r]
        return [results[r] for r in range(len(self.conns))]

    def _call(self, cmd: str, payload: tuple, progress: ProgressFn | None = None) -> Any:
        if not self.procs:
            raise CellFailed("TP workers are not running")
        try:
            for c in self.conns:
                c.send((cmd, payload))
            return self._collect("result", self.hang_timeout, progress)[0]
        except BaseException:
            self.keep_log = True
            self.close()
            raise

    def generate(
        self, prompts, prompt_ids, decoding: DecodingParams, batch_size: int, progress: ProgressFn | None = None
    ) -> list[Generation]:
        return self._call("generate", (list(map(list, prompts)), list(prompt_ids), decoding, batch_size), progress)

    def score(self, prompts, continuations, batch_size: int) -> list[list[float]]:
        return self._call("score", (list(map(list, prompts)), list(map(list, continuations)), batch_size))

    @property
    def last_timings(self) -> dict:
        """Rank 0's timings of the last generate call (empty for a hosted engine)."""
        return self._call("timings", ())

    def describe(self) -> dict:
        if self.hosted:  # knobs are known once vLLM is built for a batch size
            return self._call("describe", ())
        return {**self._describe, "workers": self.tp}

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
        log = self.spec.get("log")
        if log and not self.keep_log:  # the vLLM host's marker + log directory
            shutil.rmtree(os.path.dirname(log), ignore_errors=True)
