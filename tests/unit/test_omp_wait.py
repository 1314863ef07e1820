"""The command line's OpenMP wait (`detaudit.omp_wait`): set before torch loads libgomp, never over the
user's choice, and recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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


def test_nothing_is_set_once_torch_is_loaded():
    """libgomp read its settings when torch loaded it: a variable set now would be recorded but not used."""
    env: dict = {}
    said = omp_wait.apply(env, {"torch": object()})
    assert env == {} and said.startswith("libgomp's default")


def test_the_command_line_sets_it_before_torch_and_records_it():
    """Through the real entry point: nothing the CLI imports before `main` loads torch (else `apply` could
    not reach libgomp), and the manifests' environment and `doctor` record the value."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", omp_wait.ORIGIN_ENV)}
    proc = subprocess.run(
        [sys.executable, "-c", "from detaudit.cli import main; main()", "doctor", "--json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["checks"]["omp_wait"] == f"GOMP_SPINCOUNT={omp_wait.SPINS} (detaudit's default)"
    assert data["environment"]["env"]["GOMP_SPINCOUNT"] == omp_wait.SPINS
