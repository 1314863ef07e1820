"""The command line's OpenMP wait (`detaudit.omp_wait`): set before torch loads libgomp, never over the
user's choice, and recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from detaudit import omp_wait

NO_TORCH: dict = {}


def test_the_default_is_set_where_nothing_chose_a_wait():
    env: dict = {}
    said = omp_wait.apply(env, NO_TORCH)
    assert env[omp_wait.SPIN_ENV] == omp_wait.SPINS
    assert said == f"GOMP_SPINCOUNT={omp_wait.SPINS} (detaudit's default)"


def test_the_users_choice_is_kept():
    env = {"GOMP_SPINCOUNT": "0"}
    assert omp_wait.apply(env, NO_TORCH) == "GOMP_SPINCOUNT=0 (set by the user)"
    assert env == {"GOMP_SPINCOUNT": "0"}
    # GOMP_SPINCOUNT would override OMP_WAIT_POLICY in libgomp: a policy alone is left alone
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert omp_wait.apply(env, NO_TORCH) == "OMP_WAIT_POLICY=PASSIVE (set by the user)"
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


def test_a_stale_marker_does_not_claim_the_users_value():
    env = {"GOMP_SPINCOUNT": "0", omp_wait.ORIGIN_ENV: omp_wait.SPINS}  # a marker left from a parent run
    assert omp_wait.describe(env) == "GOMP_SPINCOUNT=0 (set by the user)"


def test_the_wait_is_forwarded_where_the_environment_is_not_inherited():
    env: dict = {"PATH": "/bin"}
    omp_wait.apply(env, NO_TORCH)
    assert omp_wait.forwarded(env) == {"GOMP_SPINCOUNT": omp_wait.SPINS, omp_wait.ORIGIN_ENV: omp_wait.SPINS}
    assert omp_wait.forwarded({"OMP_WAIT_POLICY": "PASSIVE"}) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert omp_wait.forwarded({}) == {}


def test_a_ray_cluster_gets_the_wait_with_the_job(monkeypatch):
    """A mock stands in for ray.init: connecting to a second Ray cluster cannot run here. The job's
    runtime environment carries the wait the manifest records."""
    from detaudit.executors import ray as ray_executor

    seen: dict = {}

    class FakeRay:
        __version__ = "0"

        @staticmethod
        def is_initialized():
            return False

        @staticmethod
        def init(**kwargs):
            seen.update(kwargs)

    monkeypatch.setattr(ray_executor, "require_ray", lambda: FakeRay)
    monkeypatch.setenv("GOMP_SPINCOUNT", omp_wait.SPINS)
    monkeypatch.setenv(omp_wait.ORIGIN_ENV, omp_wait.SPINS)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    ray_executor.RayExecutor(address="10.0.0.1:6379")._connect()
    assert seen["address"] == "10.0.0.1:6379"
    assert seen["runtime_env"] == {"env_vars": {"GOMP_SPINCOUNT": omp_wait.SPINS, omp_wait.ORIGIN_ENV: omp_wait.SPINS}}


def test_nothing_is_set_once_torch_is_loaded():
    """libgomp read its settings when torch loaded it: a variable set now would be recorded but not used."""
    env: dict = {}
    said = omp_wait.apply(env, {"torch": object()})
    assert env == {} and said.startswith("libgomp's default")


@pytest.mark.slow
def test_the_command_line_sets_it_before_torch_and_records_it():
    """Through the real entry point: libgomp itself reports the command line's spin count as it loads
    (OMP_DISPLAY_ENV), so nothing the CLI imports before `main` loaded torch; the manifests' environment
    and `doctor` record the value."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", omp_wait.ORIGIN_ENV)}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    proc = subprocess.run(
        [sys.executable, "-c", "from detaudit.cli import main; main()", "doctor", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert f"GOMP_SPINCOUNT = '{omp_wait.SPINS}'" in proc.stderr, proc.stderr[-2000:]
    data = json.loads(proc.stdout)
    assert data["checks"]["omp_wait"] == f"GOMP_SPINCOUNT={omp_wait.SPINS} (detaudit's default)"
    assert data["environment"]["env"]["GOMP_SPINCOUNT"] == omp_wait.SPINS
