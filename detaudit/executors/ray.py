"""The Ray executor: each (engine, backend, TP) group runs in one Ray actor on a Ray cluster.

Placement: a group gets a placement group of TP bundles, `{"GPU": 1}` per rank on GPUs and
`{"CPU": 1}` per rank on CPU, strategy STRICT_PACK (a TP group stays on one node). The group's actor
asks for no resources itself and is scheduled into that placement group; it runs the same worker code
as the local executor (`executors.local.run_job` on an engine from `engines.open_engine`). The built-in
engine's real TP starts its own rank processes on that node, inside the bundles' resources; on GPUs the
actor learns which GPUs its bundles hold (one probe task per bundle) and sets CUDA_VISIBLE_DEVICES to
them before any engine starts.

Nothing the driver waits for blocks it: a placement group's readiness, the GPU probes and every cell
are object refs in one `ray.wait` loop. (A blocking wait for a TP-2 group's probes, while TP-1 groups
held the GPUs and their finished cells waited to be collected, deadlocked the sweep.) Groups that do not
fit at once wait their turn; a group that cannot be placed while nothing else holds resources, and a
cell whose engine reports no token for `hang_timeout` seconds, fail with one line (a hung actor is
killed and its cell retried like a lost one).

Data flow: the driver hands the actor one cell at a time (`run_cell`) and gets one `CellOutput` back,
which it writes with the run directory's atomic store (the driver alone writes; no shared file system).
Teacher forcing: the driver reads a reference cell's outputs (`reference(cell_id)`) and passes them to
the actor (`ray.put`). A group whose cells score a reference computed by another group starts only
once that reference has landed (or failed), so the groups holding reference cells run first and the
rest follow in parallel, as the cluster's resources allow.

Model path: the actor opens the model at the driver's path (`manifest.model.path`). On one machine it is
the same path; on a cluster the model (and detaudit) must be installed at the same path on every node.
The actor checks and fails with one line naming the node otherwise.

Faults: a lost actor or node (`RayActorError`: the actor's process or node died) fails only its group's
unfinished cells, which are retried on a new actor and placement group, at most `max_retries` times per
group; then the remaining cells are recorded as failed and the sweep goes on. A cell never lands twice.
Ctrl-C kills every actor, removes every placement group, and shuts Ray down when this executor started
it. Test hooks: `DETAUDIT_RAY_FAULT=kill:<cell id>` makes the actor exit (os._exit) after computing that
cell and before returning it, `hang:<cell id>` makes it hang before computing it, on the cell's first
attempt only; `RayExecutor(accelerator="GPU")` places CPU
groups on GPU bundles as GPU groups are placed (Ray's logical GPUs: the scheduling of a GPU cluster,
tested on a CPU machine).
"""

from __future__ import annotations

import os
import re
import socket
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from detaudit import compiling, omp_wait
from detaudit.errors import DetauditError
from detaudit.executors import CellGroup, CellJob, CellOutput, EventFn, OutputFn, ReferenceFn
from detaudit.workers import ENGINE_START_S

FAULT_ENV = "DETAUDIT_RAY_FAULT"  # tests: "kill:<cell id>" or "hang:<cell id>"


def require_ray():
    try:
        import ray
    except ImportError:
        raise DetauditError("--executor ray needs Ray: pip install 'detaudit[ray]'") from None
    return ray


def safe_address(address: str | None) -> str | None:
    """The address without credentials (user:password@ or ?token=... are dropped)."""
    if not address:
        return address
    address = re.sub(r"^([a-z+]+://)?[^@/]*@", r"\1", address)
    return address.split("?", 1)[0]


# ---- the actor (runs on a cluster node) ------------------------------------------------------------


class GroupActor:
    """Holds one group's engine; runs one cell per call. It runs two threads (max_concurrency=2) so the
    driver can read `tokens()` while a cell runs."""

    def __init__(self, group: CellGroup, cuda_visible_devices: str | None) -> None:
        if cuda_visible_devices is not None:  # before any CUDA initialisation in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        if group.options.multi_node:  # the engine's own Ray executor (in its child process) joins this cluster
            import ray

            os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        self.group = group
        self.runner: Any = None  # executors.local.GroupEngine, created on the first cell
        self._tokens = 0  # tokens produced so far (any cell): the driver's hang detection and progress
        self._opening = False  # the engine is being opened (loading a model is not a hang)

    def tokens(self) -> tuple[int, bool]:
        """Tokens so far, and whether the engine is opening or compiling kernels (here or in its TP ranks):
        neither is a hang."""
        return self._tokens, self._opening or compiling.active()

    def _event(self, cell_id: str, event: str, n: int) -> None:
        if event == "engine":
            self._opening = True
        elif event == "tokens":
            self._opening = False
            self._tokens += n

    def placement(self) -> dict:
        import ray

        ctx = ray.get_runtime_context()
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:
            cores = os.cpu_count() or 1
        gpus = ctx.get_accelerator_ids().get("GPU") or []
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return {
            "executor": "ray",
            "node_id": ctx.get_node_id(),
            "node_ip": _node_ip(),
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "gpu_ids": list(gpus) or ([d for d in visible.split(",") if d] if visible else []),
            "cuda_visible_devices": visible,
            "cpu_cores": cores,
            "model_path": str(self.group.options.model.path),
        }

    def run_cell(self, job: CellJob, continuations: list[list[int]] | None, fault: str = "") -> CellOutput:
        from detaudit.executors.local import GroupEngine

        if self.runner is None:
            path = self.group.options.model.path
            if not path.exists():
                raise DetauditError(
                    f"model path {path} does not exist on Ray node {socket.gethostname()} "
                    f"({_node_ip()}); on a cluster the model must be at the same "
                    "path on every node"
                )
            self.runner = GroupEngine(self.group)
        while fault == "hang":
            time.sleep(60)
        out = self.runner.run(job, lambda _ref: continuations, self._event)
        if fault == "kill":
            os._exit(17)
        out.placement = self.placement()
        return out

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()


def _node_ip() -> str:
    import ray

    try:
        return ray._private.worker.global_worker.node_ip_address
    except Exception:
        return ray.util.get_node_ip_address()


def _gpu_ids() -> list[str]:
    import ray

    return [str(i) for i in ray.get_runtime_context().get_accelerator_ids().get("GPU", [])]


# ---- the driver side -------------------------------------------------------------------------------


@dataclass
class _Slot:
    """One group's state on the driver: `phase` runs pending -> placing (its placement group is being
    scheduled) -> probing (GPU ids of its bundles) -> running (an actor, a cell in flight) -> finished."""

    index: int
    group: CellGroup
    pending: deque = field(default_factory=deque)  # CellJobs not yet landed (the first one may be in flight)
    phase: str = "pending"
    actor: Any = None
    pg: Any = None
    ref: Any = None  # what the driver waits for now: pg.ready(), the probes, or the in-flight run_cell
    probes: list = field(default_factory=list)
    since: float = 0.0  # when the phase (or the cell's last token) began
    tokens: int = 0  # the actor's token count when last read
    opening: bool = False  # the actor is opening its engine (when last read)
    tokens_ref: Any = None
    lost: int = 0  # actors lost so far

    @property
    def holding(self) -> bool:
        """It holds cluster resources (a placed group)."""
        return self.phase in ("probing", "running")


class RayExecutor:
    name = "ray"

    def __init__(
        self,
        address: str | None = None,
        max_retries: int = 2,
        num_cpus: int | None = None,
        poll_s: float = 0.5,
        *,
        num_gpus: int | None = None,
        accelerator: str | None = None,
        placement_timeout: float = 120.0,
    ) -> None:
        if max_retries < 0:
            raise DetauditError(f"--max-retries must be >= 0 (got {max_retries})")
        self.ray = require_ray()
        self.address = address or None
        self.max_retries = max_retries
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        self.poll_s = poll_s
        self.accelerator = accelerator  # tests: the resource every group is placed on (see the docstring)
        self.placement_timeout = placement_timeout  # a group that cannot be placed while nothing else runs
        self.started_ray = False
        self.fault = os.environ.get(FAULT_ENV, "")
        self._actor_cls: Any = None

    def describe(self) -> dict:
        return {
            "name": self.name,
            "ray_version": self.ray.__version__,
            "address": safe_address(self.address) or "local (started by detaudit on 127.0.0.1)",
            "max_retries": self.max_retries,
            "model_path": "the driver's model path, required at the same path on every node",
        }

    # -- Ray runtime

    def _connect(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            return
        import logging

        if self.address:
            try:
                # a cluster's workers get the cluster's environment, not this process's: the OpenMP wait the
                # manifest records goes with the job (`omp_wait`)
                env = omp_wait.forwarded()
                ray.init(
                    address=self.address,
                    logging_level=logging.WARNING,
                    log_to_driver=False,
                    runtime_env={"env_vars": env} if env else None,
                )
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise DetauditError(
                    f"--ray-address {safe_address(self.address)}: cannot connect to a Ray cluster "
                    f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
                ) from None
        else:  # a private single-node runtime, every port on 127.0.0.1
            self._loopback(True)
            ray.init(
                address="local",
                num_cpus=self.num_cpus,
                num_gpus=self.num_gpus,
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
        self.started_ray = True

    def _shutdown(self) -> None:
        if self.started_ray:
            self.ray.shutdown()
            self.started_ray = False
            self._loopback(False)

    _saved: Any = None

    def _loopback(self, on: bool) -> None:
        """Ray resolves 127.0.0.1 to the host's reachable IP (and binds its servers there) unless its
        single-machine mode is on: the env var for the processes ray.init starts, the constant for this
        one (read at import)."""
        try:
            from ray._private import ray_constants
        except ImportError:  # another Ray layout: the env var alone
            ray_constants = None
        key = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
        if on:
            self._saved = (os.environ.get(key), getattr(ray_constants, "ENABLE_RAY_CLUSTER", None))
            os.environ[key] = "0"
            if ray_constants is not None:
                ray_constants.ENABLE_RAY_CLUSTER = False
        elif self._saved is not None:
            env, const = self._saved
            if env is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = env
            if ray_constants is not None and const is not None:
                ray_constants.ENABLE_RAY_CLUSTER = const
            self._saved = None

    # -- placement

    def _resource(self, group: CellGroup) -> str:
        return self.accelerator or ("GPU" if group.options.settings.cuda else "CPU")

    def _spans_nodes(self, group: CellGroup) -> bool:
        """A GPU group larger than any node, whose engine can place its own ranks across nodes."""
        from detaudit.engines import get_engine

        return (
            get_engine(group.options.settings.name).spans_nodes
            and self._resource(group) == "GPU"
            and group.options.tp > self._largest_node("GPU")
        )

    def _largest_node(self, resource: str) -> float:
        return max((n.get("Resources", {}).get(resource, 0.0) for n in self.ray.nodes() if n.get("Alive")), default=0.0)

    def _place(self, slot: _Slot) -> None:
        """Ask for the slot's placement group (not waiting for it: its readiness is a ref of the loop)."""
        from ray.util.placement_group import placement_group

        slot.since = time.monotonic()
        if self._spans_nodes(slot.group):  # the engine places its own ranks across nodes (vLLM's Ray executor)
            slot.group = replace(slot.group, options=replace(slot.group.options, multi_node=True))
            self._start_actor(slot, "DEFAULT", None)
            return
        bundles = [{self._resource(slot.group): 1}] * slot.group.options.tp
        slot.pg = placement_group(bundles, strategy="STRICT_PACK", name=f"detaudit-{slot.group.label}")
        slot.ref, slot.phase = slot.pg.ready(), "placing"

    def _placed(self, slot: _Slot) -> None:
        """The placement group is ready: probe its bundles' GPU ids (GPU groups) or start the actor."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot.since = time.monotonic()
        if self._resource(slot.group) != "GPU":
            strategy = PlacementGroupSchedulingStrategy(slot.pg, placement_group_capture_child_tasks=True)
            self._start_actor(slot, strategy, None)
            return
        probe = self.ray.remote(num_gpus=1, num_cpus=0)(_gpu_ids)
        slot.probes = [
            probe.options(
                scheduling_strategy=PlacementGroupSchedulingStrategy(slot.pg, placement_group_bundle_index=i)
            ).remote()
            for i in range(slot.group.options.tp)
        ]
        slot.ref, slot.phase = None, "probing"

    def _start_actor(self, slot: _Slot, strategy: Any, visible: str | None) -> None:
        if self._actor_cls is None:
            self._actor_cls = self.ray.remote(
                num_cpus=0, num_gpus=0, max_restarts=0, max_task_retries=0, max_concurrency=2
            )(GroupActor)
        slot.actor = self._actor_cls.options(scheduling_strategy=strategy, name=None).remote(
            replace(slot.group, jobs=[]), visible
        )
        slot.ref, slot.phase, slot.tokens, slot.tokens_ref, slot.opening = None, "running", 0, None, False

    def _stop(self, slot: _Slot, graceful: bool) -> None:
        ray = self.ray
        from ray.util.placement_group import remove_placement_group

        if slot.actor is not None:
            if graceful:
                try:
                    ray.get(slot.actor.close.remote(), timeout=60)
                except Exception:  # a dead actor has nothing to close
                    pass
            try:
                ray.kill(slot.actor, no_restart=True)
            except Exception:
                pass
            slot.actor = None
        if slot.pg is not None:
            try:
                remove_placement_group(slot.pg)
            except Exception:
                pass
            slot.pg = None
        slot.ref, slot.probes, slot.tokens_ref = None, [], None
        if slot.phase != "finished":
            slot.phase = "pending"

    # -- scheduling

    def run(self, groups: list[CellGroup], reference: ReferenceFn, on_output: OutputFn, progress: EventFn) -> None:
        if not groups:
            return
        self._connect()
        slots = [_Slot(i, g, deque(g.jobs)) for i, g in enumerate(groups)]
        try:
            _Loop(self, slots, reference, on_output, progress).run()
            for slot in slots:
                self._stop(slot, graceful=True)
        except BaseException:  # Ctrl-C or an error: no actor or placement group is left behind
            for slot in slots:
                self._stop(slot, graceful=False)
            raise
        finally:
            self._shutdown()


class _Loop:
    """The driver's event loop over every slot (see the module docstring)."""

    def __init__(
        self, ex: RayExecutor, slots: list[_Slot], reference: ReferenceFn, on_output: OutputFn, progress: EventFn
    ) -> None:
        self.ex, self.ray, self.slots = ex, ex.ray, slots
        self.reference, self.on_output, self.progress = reference, on_output, progress
        self.owner = {job.cell_id: s.index for s in slots for job in s.pending}
        self.landed: set[str] = set()
        self.begun: set[str] = set()  # cells whose progress bar exists
        self.attempts: dict[str, int] = {}
        self.idle_since: float | None = None  # since when no slot has held resources (None: one does)
        self.lost_errors: tuple = tuple(
            getattr(self.ray.exceptions, n)
            for n in (
                "RayActorError",
                "ActorDiedError",
                "ActorUnavailableError",
                "NodeDiedError",
                "WorkerCrashedError",
                "ObjectLostError",
                "OwnerDiedError",
                "ActorPlacementGroupRemoved",
            )
            if hasattr(self.ray.exceptions, n)
        )

    # -- cells

    def begin(self, cell_id: str) -> None:
        if cell_id not in self.begun:
            self.begun.add(cell_id)
            self.progress(cell_id, "start", 0)

    def settled(self, cell_id: str) -> bool:
        return cell_id not in self.owner or cell_id in self.landed

    def ready(self, slot: _Slot) -> bool:
        """Every reference its cells score has landed (or is its own)."""
        return all(self.settled(j.reference_id) or self.owner.get(j.reference_id) == slot.index for j in slot.pending)

    def land(self, out: CellOutput) -> None:
        if out.cell_id in self.landed:  # never twice
            return
        self.landed.add(out.cell_id)
        self.begin(out.cell_id)
        try:
            self.on_output(out)
        finally:
            self.progress(out.cell_id, "end", 0)

    def give_up(self, slot: _Slot, why: str) -> None:
        self.ex._stop(slot, graceful=False)
        while slot.pending:
            self.land(CellOutput(slot.pending.popleft().cell_id, error=why))
        slot.phase = "finished"

    def dispatch(self, slot: _Slot) -> None:
        """Send the slot's next cell to its actor (placing the group first where it has none)."""
        while slot.pending and slot.pending[0].cell_id in self.landed:
            slot.pending.popleft()
        if not slot.pending:
            self.ex._stop(slot, graceful=True)
            slot.phase = "finished"
            return
        job = slot.pending[0]
        self.begin(job.cell_id)
        if slot.phase == "pending":
            need = self.ex._resource(slot.group)
            if not self.ex._spans_nodes(slot.group) and self.ex._largest_node(need) < slot.group.options.tp:
                self.give_up(
                    slot,
                    f"no Ray node has {slot.group.options.tp} {need}(s) for {slot.group.label} "
                    "(a TP group is packed onto one node)",
                )
                return
            self.ex._place(slot)
            self.progress(job.cell_id, "engine", 0)
            if slot.phase != "running":
                return  # the loop sends the cell once the group is placed
        conts = None if job.reference_id == job.cell_id else self.reference(job.reference_id)
        kind, _, cell = self.ex.fault.partition(":")
        fault = kind if cell == job.cell_id and self.attempts.get(job.cell_id, 0) == 0 else ""
        slot.ref = slot.actor.run_cell.remote(job, self.ray.put(conts) if conts is not None else None, fault)
        slot.since = time.monotonic()

    def lost(self, slot: _Slot, why: str) -> None:
        """The slot's actor is gone (or was killed as hung): retry its unfinished cells on a new one."""
        job = slot.pending[0]
        slot.lost += 1
        self.attempts[job.cell_id] = self.attempts.get(job.cell_id, 0) + 1
        self.ex._stop(slot, graceful=False)
        if slot.lost > self.ex.max_retries:
            self.give_up(
                slot,
                f"Ray actor for {slot.group.label} lost {slot.lost} time(s) (max retries {self.ex.max_retries}): {why}",
            )
            return
        self.dispatch(slot)

    # -- the loop

    def run(self) -> None:
        while not all(s.phase == "finished" for s in self.slots):
            for slot in self.slots:
                if slot.phase == "pending" and self.ready(slot):
                    self.dispatch(slot)
            waiting = {}
            for slot in self.slots:
                for ref in ([slot.ref] if slot.ref is not None else []) + slot.probes:
                    waiting[ref] = slot
                if slot.tokens_ref is not None:
                    waiting[slot.tokens_ref] = slot
            if not waiting:
                stuck = [s for s in self.slots if s.phase == "pending"]
                for slot in stuck:  # cannot happen (a reference is always settled or in flight); never hang
                    self.give_up(slot, "internal: no runnable group")
                continue
            done, _ = self.ray.wait(list(waiting), num_returns=1, timeout=self.ex.poll_s)
            for ref in done:
                self.handle(waiting[ref], ref)
            self.watch()

    def handle(self, slot: _Slot, ref: Any) -> None:
        if not (ref is slot.ref or ref is slot.tokens_ref or any(ref is p for p in slot.probes)):
            return  # a ref of a phase the slot has left (it was stopped in this round)
        if ref is slot.tokens_ref:
            slot.tokens_ref = None
            try:
                tokens, opening = self.ray.get(ref)
            except Exception:  # the actor died: its run_cell ref says how
                return
            if tokens != slot.tokens and slot.pending:
                self.progress(slot.pending[0].cell_id, "tokens", tokens - slot.tokens)
            if tokens != slot.tokens or opening != slot.opening:  # a compile's end starts the hang timeout afresh
                slot.tokens, slot.opening, slot.since = tokens, opening, time.monotonic()
            return
        if slot.phase == "placing" and ref is slot.ref:
            self.ex._placed(slot)
            if slot.phase == "running":
                self.dispatch(slot)
            return
        if slot.phase == "probing":
            if not all(
                r in self.ray.wait(slot.probes, num_returns=len(slot.probes), timeout=0)[0] for r in slot.probes
            ):
                return
            visible = ",".join(i for ids in self.ray.get(slot.probes) for i in ids)
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            slot.probes = []
            self.ex._start_actor(
                slot, PlacementGroupSchedulingStrategy(slot.pg, placement_group_capture_child_tasks=True), visible
            )
            self.dispatch(slot)
            return
        self.finished_cell(slot, ref)

    def finished_cell(self, slot: _Slot, ref: Any) -> None:
        from ray.exceptions import RayTaskError

        slot.ref = None
        job = slot.pending[0]
        try:
            out = self.ray.get(ref)
        except RayTaskError as e:  # the actor raised (bad input, not a lost actor): as the local executor
            cause = getattr(e, "cause", None)
            if isinstance(cause, BaseException) and not isinstance(cause, self.lost_errors):
                raise cause from None
            raise
        except self.lost_errors as e:
            self.lost(slot, type(e).__name__)
            return
        out.placement = {
            **out.placement,
            "attempt": self.attempts.get(job.cell_id, 0) + 1,
            "group_actor_restarts": slot.lost,
        }
        slot.pending.popleft()
        self.land(out)
        self.dispatch(slot)

    def watch(self) -> None:
        """Progress and hang detection: read each running actor's token count now and then; a cell without
        a new token for the hang timeout has its actor killed (and is retried); a group that stays
        unplaced while no other group holds resources can never be placed, and fails."""
        now = time.monotonic()
        busy = any(s.holding for s in self.slots)
        # the placement timeout counts from when nothing held resources, not from when the group began to
        # wait: a TP-2 group that waited minutes behind TP-1 groups is not unplaceable in the instant
        # between the last of them letting its bundles go and Ray placing it
        if busy:
            self.idle_since = None
        elif self.idle_since is None:
            self.idle_since = now
        idle = now if self.idle_since is None else self.idle_since
        for slot in self.slots:
            if slot.phase == "running" and slot.ref is not None:
                if slot.tokens_ref is None:
                    slot.tokens_ref = slot.actor.tokens.remote()
                timeout = slot.group.options.settings.hang_timeout
                if slot.opening:  # as the local executor's worker pool allows an engine to start
                    timeout = max(timeout, ENGINE_START_S)
                if now - slot.since > timeout:
                    self.lost(slot, f"no token for {timeout:.0f} s (actor killed as hung)")
            elif slot.phase == "placing" and not busy and now - max(slot.since, idle) > self.ex.placement_timeout:
                self.give_up(
                    slot,
                    f"{slot.group.label}: its placement group of {slot.group.options.tp} "
                    f"{self.ex._resource(slot.group)} bundle(s) was not placed within "
                    f"{self.ex.placement_timeout:.0f} s while no other group held resources",
                )
