"""detaudit installed from its wheel, outside this repository, finds its built-in suites and runs a
sweep: the repository's suites/ ships inside the wheel as package data, found through
importlib.resources, not as files beside the source tree.

The wheel goes into a fresh venv. To avoid reinstalling torch & co. (no network is needed), the new
venv sees the test venv's site-packages through a `.pth` line; a plain path line does not process the
`.pth` files found there, so the editable install's finder (which maps `detaudit` to this source tree)
stays inactive, and the test checks that `detaudit` resolves to the new venv's copy.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from helpers import sweep_args

REPO = Path(__file__).resolve().parents[2]


def _run(cmd: list[str], cwd: Path, env: dict, timeout: int = 300) -> subprocess.CompletedProcess:
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{cmd} -> {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> tuple[Path, dict, Path, Path]:
    tmp = tmp_path_factory.mktemp("wheel")
    # build from a copy of the project files, so the build leaves no build/ or egg-info in the tree
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("detaudit", "suites"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    _run(
        [sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist")],
        cwd=src,
        env=env,
    )
    (wheel,) = (tmp / "dist").glob("detaudit-*.whl")

    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp, env=env)
    python = venv / "bin" / "python"
    _run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", str(wheel)],
        cwd=tmp,
        env=env,
    )
    purelib = Path(
        subprocess.check_output(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True
        ).strip()
    )
    outer = Path(sysconfig.get_paths()["purelib"])  # the test venv's dependencies (torch, transformers, ...)
    (purelib / "_detaudit_test_deps.pth").write_text(f"{outer}\n")
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return venv, env, purelib, tmp


@pytest.mark.slow
def test_wheel_install_finds_suites_and_sweeps(wheel_venv, smollm):
    venv, env, purelib, tmp = wheel_venv
    work = tmp / "elsewhere"  # a working directory outside the repository
    work.mkdir()
    assert REPO not in work.parents

    where = _run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import detaudit, json; from detaudit import paths; "
            "print(json.dumps([detaudit.__file__, str(paths.builtin_suites_dir())]))",
        ],
        cwd=work,
        env=env,
    )
    module, suites_dir = (Path(p) for p in json.loads(where.stdout))
    assert purelib in module.parents, f"detaudit imported from {module}, not from the wheel's venv"
    assert purelib in suites_dir.parents and REPO not in suites_dir.parents

    listed = json.loads(_run([str(venv / "bin" / "detaudit"), "suites", "ls", "--json"], cwd=work, env=env).stdout)
    assert {s["name"] for s in listed} == {"smoke", "aime24", "amc23", "quote"}

    out = work / "run"
    env = {**env, "DETAUDIT_HOME": os.environ["DETAUDIT_HOME"]}  # the embedded model prepared by `smollm`
    _run(
        [
            str(venv / "bin" / "detaudit"),
            "sweep",
            *sweep_args(limit=1, max_new_tokens=2, backends="bf16", tp=1, batch_sizes=1, output_path=out),
        ],
        cwd=work,
        env=env,
    )
    assert (out / "manifest.json").is_file() and list(out.rglob("*.parquet"))
    # bio's compiled kernels compile from the wheel's own copy (numba caches by source path, so a bio sweep
    # here would spend about a minute of CI compiling all of them; the checkout's sweeps run bio): one
    # kernel, compiled and cached beside the installed module, gives torch's silu * up within fp32 rounding
    # (its exp is the attention's polynomial, not torch's)
    check = (
        "import torch; from detaudit.backends.kernels import cpu_calls, fixed; "
        "g, u = torch.randn(3, 40), torch.randn(3, 40); rows = cpu_calls.compiled('cpu_rows'); "
        "assert rows is not None and rows.__file__.startswith(%r); "
        "torch.testing.assert_close(fixed.silu_mul(g, u), torch.nn.functional.silu(g) * u, rtol=1e-6, atol=1e-6); "
        "import pathlib; here = pathlib.Path(rows.__file__).parent; "
        "print(sorted(p.name for p in here.glob('__pycache__/cpu_rows*.nbi')))"
    ) % str(purelib)
    cached = _run([str(venv / "bin" / "python"), "-c", check], cwd=work, env=env)
    assert "cpu_rows" in cached.stdout, cached.stdout


def test_ci_example_installs_detaudit_as_a_package():
    """docs/ci-example.yml is for other repositories: it installs detaudit as a package (no editable
    install of a checkout of this repository) and sweeps a built-in suite by name."""
    workflow = yaml.safe_load((REPO / "docs" / "ci-example.yml").read_text())
    steps = workflow["jobs"]["audit"]["steps"]
    runs = "\n".join(s.get("run", "") for s in steps)
    install = next(s["run"] for s in steps if s.get("name") == "Install detaudit")
    assert "pip install" in install and " -e " not in install and '".[' not in install and " . " not in f"{install} "
    sweep = next(s["run"] for s in steps if s.get("name") == "Sweep")
    suites = sweep.split("--suites")[1].split()[0]
    assert suites in {"smoke", "aime24", "amc23"}
    assert "suites/" not in runs and "make " not in runs
    gate = next(s["run"] for s in steps if s.get("name") == "Gate")
    assert "--format markdown" in gate and "--junit gate-junit.xml" in gate  # GITHUB_STEP_SUMMARY: automatic
    report = next(s for s in steps if s.get("name") == "Publish the gate's checks")
    assert report["with"]["report_paths"] == "gate-junit.xml" and report["if"] == "always()"
