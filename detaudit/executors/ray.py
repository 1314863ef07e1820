"""The Ray executor: each (engine, backend, TP) group runs in one Ray actor on a Ray cluster.

Placement: a group gets a placement group of TP bundles, `{"GPU": 1}` per rank on GPUs and
`{"CPU": 1}` per rank on CPU, strategy STRICT_PACK (a TP group stays on one node). The group's actor
asks for no resources itself and is scheduled into that placement group; it runs the same worker code
as the local executor (`executors.local.run_job` on an engine from `engines.open_engine`). The built-in
engine's real TP starts its own rank processes on that node, inside the bundles' resources; on GPUs the
actor learns which GPUs its bundles hold (one probe task per bundle) and sets CUDA_VISIBLE_DEVICES to
them before any engine starts.

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
it. Test hook: `DETAUDIT_RAY_FAULT=kill:<cell id>` makes the actor exit (os._exit) after computing that
cell and before returning it, on its first attempt only.
"""

from __future__ import annotations

import os
import re
import socket
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

from detaudit.errors import DetauditError
from detaudit.executors import CellGroup, CellJob, CellOutput, EventFn, OutputFn, ReferenceFn

FAULT_ENV = "DETAUDIT_RAY_FAULT"  # tests: "kill:<cell id>"


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
    """Holds one group's engine; runs one cell per call."""

    def __init__(self, group: CellGroup, cuda_visible_devices: str | None) -> None:
        if cuda_visible_devices is not None:  # before any CUDA initialisation in this process
            os.environ["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
        if group.options.multi_node:  # the engine's own Ray executor (in its child process) joins this cluster
            import ray

            os.environ.setdefault("RAY_ADDRESS", ray.get_runtime_context().gcs_address)
        self.group = group
        self.runner: Any = None  # executors.local.GroupEngine, created on the first cell

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
            "model_path": str(self.group.options.model_path),
        }

    def run_cell(self, job: CellJob, continuations: list[list[int]] | None, fault: bool) -> CellOutput:
        from detaudit.executors.local import GroupEngine

        if self.runner is None:
            path = self.group.options.model_path
            if not path.exists():
                raise DetauditError(
                    f"model path {path} does not exist on Ray node {socket.gethostname()} "
                    f"({_node_ip()}); on a cluster the model must be at the same "
                    "path on every node"
                )
            self.runner = GroupEngine(self.group)
        out = self.runner.run(job, lambda _ref: continuations, lambda *a: None)
        if fault:
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
    """One group's state on the driver."""

    index: int
    group: CellGroup
    pending: deque = field(default_factory=deque)  # CellJobs not yet landed (the first one may be in flight)
    actor: Any = None
    pg: Any = None
    ref: Any = None  # the in-flight run_cell call
    lost: int = 0  # actors lost so far
    started: bool = False
    finished: bool = False


class RayExecutor:
    name = "ray"

    def __init__(
        self, address: str | None = None, max_retries: int = 2, num_cpus: int | None = None, poll_s: float = 0.5
    ) -> None:
        if max_retries < 0:
            raise DetauditError(f"--max-retries must be >= 0 (got {max_retries})")
        self.ray = require_ray()
        self.address = address or None
        self.max_retries = max_retries
        self.num_cpus = num_cpus
        self.poll_s = poll_s
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
                ray.init(address=self.address, logging_level=logging.WARNING, log_to_driver=False)
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

    @staticmethod
    def _resource(group: CellGroup) -> str:
        return "GPU" if group.options.settings.cuda else "CPU"

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

    def _start(self, slot: _Slot) -> None:
        """A new placement group and actor for the slot's group."""
        ray = self.ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group, tp = slot.group, slot.group.options.tp
        resource = self._resource(group)
        pg = None
        visible = None
        if self._spans_nodes(group):  # the engine places its own ranks across nodes (vLLM's Ray executor)
            group = replace(group, options=replace(group.options, multi_node=True))
            strategy: Any = "DEFAULT"
        else:
            pg = placement_group([{resource: 1}] * tp, strategy="STRICT_PACK", name=f"detaudit-{group.label}")
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_capture_child_tasks=True)
            if resource == "GPU":
                probes = [
                    ray.remote(num_gpus=1, num_cpus=0)(_gpu_ids)
                    .options(scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i))
                    .remote()
                    for i in range(tp)
                ]
                visible = ",".join(i for ids in ray.get(probes) for i in ids)
        if self._actor_cls is None:
            self._actor_cls = ray.remote(num_cpus=0, num_gpus=0, max_restarts=0, max_task_retries=0)(GroupActor)
        actor_cls = self._actor_cls
        slot.pg = pg
        slot.actor = actor_cls.options(scheduling_strategy=strategy, name=None).remote(replace(group, jobs=[]), visible)
        slot.started = True

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
        slot.ref = None

    # -- scheduling

    def run(self, groups: list[CellGroup], reference: ReferenceFn, on_output: OutputFn, progress: EventFn) -> None:
        if not groups:
            return
        self._connect()
        slots = [_Slot(i, g, deque(g.jobs)) for i, g in enumerate(groups)]
        try:
            self._loop(slots, reference, on_output, progress)
            for slot in slots:
                self._stop(slot, graceful=True)
        except BaseException:  # Ctrl-C or an error: no actor or placement group is left behind
            for slot in slots:
                self._stop(slot, graceful=False)
            raise
        finally:
            self._shutdown()

    def _loop(self, slots: list[_Slot], reference: ReferenceFn, on_output: OutputFn, progress: EventFn) -> None:
        ray = self.ray
        from ray.exceptions import RayTaskError

        lost_errors: tuple = tuple(
            getattr(ray.exceptions, n)
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
            if hasattr(ray.exceptions, n)
        )
        owner = {job.cell_id: s.index for s in slots for job in s.pending}
        landed: set[str] = set()
        begun: set[str] = set()  # cells whose progress bar exists
        attempts: dict[str, int] = {}

        def begin(cell_id: str) -> None:
            if cell_id not in begun:
                begun.add(cell_id)
                progress(cell_id, "start", 0)

        def settled(cell_id: str) -> bool:
            return cell_id not in owner or cell_id in landed

        def ready(slot: _Slot) -> bool:
            return all(settled(j.reference_id) or owner.get(j.reference_id) == slot.index for j in slot.pending)

        def land(out: CellOutput) -> None:
            if out.cell_id in landed:  # never twice
                return
            landed.add(out.cell_id)
            begin(out.cell_id)
            try:
                on_output(out)
            finally:
                progress(out.cell_id, "end", 0)

        def give_up(slot: _Slot, why: str) -> None:
            self._stop(slot, graceful=False)
            while slot.pending:
                land(CellOutput(slot.pending.popleft().cell_id, error=why))
            slot.finished = True

        def dispatch(slot: _Slot) -> None:
            while slot.pending and slot.pending[0].cell_id in landed:
                slot.pending.popleft()
            if not slot.pending:
                self._stop(slot, graceful=True)
                slot.finished = True
                return
            job = slot.pending[0]
            begin(job.cell_id)
            if slot.actor is None:
                need = self._resource(slot.group)
                if not self._spans_nodes(slot.group) and self._largest_node(need) < slot.group.options.tp:
                    give_up(
                        slot,
                        f"no Ray node has {slot.group.options.tp} {need}(s) for {slot.group.label} "
                        "(a TP group is packed onto one node)",
                    )
                    return
                self._start(slot)
                progress(job.cell_id, "engine", 0)
            conts = None if job.reference_id == job.cell_id else reference(job.reference_id)
            attempt = attempts.get(job.cell_id, 0)
            fault = self.fault == f"kill:{job.cell_id}" and attempt == 0
            slot.ref = slot.actor.run_cell.remote(job, ray.put(conts) if conts is not None else None, fault)

        while not all(s.finished for s in slots):
            for slot in slots:
                if not slot.started and not slot.finished and ready(slot):
                    dispatch(slot)
            inflight = {s.ref: s for s in slots if s.ref is not None}
            if not inflight:
                if all(s.finished for s in slots):
                    break
                stuck = [s for s in slots if not s.finished and not s.started]
                for slot in stuck:  # cannot happen (a reference is always settled or in flight); never hang
                    give_up(slot, "internal: no runnable group")
                continue
            done, _ = ray.wait(list(inflight), num_returns=1, timeout=self.poll_s)
            for ref in done:
                slot = inflight[ref]
                slot.ref = None
                job = slot.pending[0]
                try:
                    out = ray.get(ref)
                except RayTaskError as e:  # the actor raised (bad input, not a lost actor): as the local executor
                    cause = getattr(e, "cause", None)
                    if isinstance(cause, BaseException) and not isinstance(cause, lost_errors):
                        raise cause from None
                    raise
                except lost_errors as e:
                    slot.lost += 1
                    attempts[job.cell_id] = attempts.get(job.cell_id, 0) + 1
                    self._stop(slot, graceful=False)
                    if slot.lost > self.max_retries:
                        give_up(
                            slot,
                            f"Ray actor for {slot.group.label} lost {slot.lost} time(s) "
                            f"(max retries {self.max_retries}): {type(e).__name__}",
                        )
                        continue
                    dispatch(slot)  # the group's unfinished cells, on a new actor and placement group
                    continue
                out.placement = {
                    **out.placement,
                    "attempt": attempts.get(job.cell_id, 0) + 1,
                    "group_actor_restarts": slot.lost,
                }
                slot.pending.popleft()
                land(out)
                dispatch(slot)
