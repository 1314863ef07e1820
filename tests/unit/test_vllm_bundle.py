"""tools/vllm_bundle.py and tools/vllm_install.py on a fake, small wheel set (no network, no vLLM): the
parts stay under the size a device call carries and reassemble bit for bit over several calls, a
damaged or foreign part is refused, the requirement check names what is missing, of another version,
or left out on purpose, and the dist-info written for the checkout carries detaudit's vLLM plugin entry
point; the device-call plan names one part per call."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import zipfile
from importlib import metadata
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, TOOLS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bundle, install = _load("vllm_bundle"), _load("vllm_install")


def _wheel(where: Path, name: str, version: str, requires: list[str], payload: int = 0) -> Path:
    path = where / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
            f"Requires-Dist: {r}\n" for r in requires
        )
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
        z.writestr(f"{name}-{version}.dist-info/RECORD", "")
        z.writestr(f"{name}/__init__.py", "")
        if payload:
            z.writestr(f"{name}/blob.bin", os.urandom(payload), compress_type=zipfile.ZIP_STORED)
    return path


@pytest.fixture
def wheels(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    return {
        "wheels__alpha-1.0-py3-none-any.whl": _wheel(
            src,
            "alpha",
            "1.0",
            ["beta>=2", "gamma", "flashinfer-python==0.6", 'winonly; sys_platform == "win32"'],
            5000,
        ),
        "wheels__beta-2.0-py3-none-any.whl": _wheel(src, "beta", "2.0", [], 1200),
        "models__model-0.1-py3-none-any.whl": _wheel(src, "model", "0.1", [], 3000),
    }


def test_parts_fit_and_reassemble_over_several_calls(tmp_path, wheels):
    carry, work = tmp_path / ".carry", tmp_path / "work"
    n = bundle.split(wheels, carry, 2048, "b1")
    parts = sorted(carry.glob("vllm-part*"))
    assert len(parts) == n >= 5  # 5000 + 1200 + 3000 bytes of payload in chunks of <= 2048
    for p in parts:
        assert sum(f.stat().st_size for f in p.iterdir() if f.name != "part.json") <= 2048
    # one part per call: each call carries its own folder only
    for k, p in enumerate(parts, 1):
        call = tmp_path / f"call{k}"
        shutil.copytree(p, call / p.name)
        state = install.collect(call, work)
        assert state["have"] == list(range(1, k + 1)) and state["parts"] == n
    files = install.reassemble(work, state["files"])
    for flat, original in wheels.items():
        assert files[flat].read_bytes() == original.read_bytes()
    assert files["models__model-0.1-py3-none-any.whl"].parent.name == "models"


def test_a_damaged_or_foreign_part_is_refused(tmp_path, wheels):
    carry, work = tmp_path / ".carry", tmp_path / "work"
    bundle.split(wheels, carry, 4096, "b1")
    chunk = next(f for f in (carry / "vllm-part01").iterdir() if f.name != "part.json")
    good = chunk.read_bytes()
    chunk.write_bytes(good[:-1] + bytes([good[-1] ^ 1]))
    with pytest.raises(SystemExit, match="sha256 mismatch"):
        install.collect(carry, work)
    chunk.write_bytes(good)
    install.collect(carry, work)
    other = tmp_path / "other"
    bundle.split(wheels, other, 4096, "b2")
    with pytest.raises(SystemExit, match="from bundle b2"):
        install.collect(other, work)


def test_requirement_check_names_missing_version_and_left_out(tmp_path, wheels):
    site = tmp_path / "site"
    (site / "beta-1.0.dist-info").mkdir(parents=True)
    (site / "beta-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: beta\nVersion: 1.0\n")
    problems = install.check(site, [wheels["wheels__alpha-1.0-py3-none-any.whl"]], bundle.SKIP)
    assert "VERSION  beta>=2 needed by alpha, 1.0 installed" in problems
    assert "MISSING  gamma (needed by alpha)" in problems
    assert any(p.startswith("LEFT OUT flashinfer-python (needed by alpha: FlashInfer") for p in problems)
    assert not any("winonly" in p for p in problems)  # its marker excludes Linux


def test_the_checkout_dist_info_carries_the_plugin_entry_point(tmp_path):
    d = install.write_detaudit_dist_info(tmp_path)
    found = [e for dist in metadata.distributions(path=[str(tmp_path)]) for e in dist.entry_points]
    assert ("detaudit", "detaudit.vllm.plugin:register") in {(e.name, e.value) for e in found}
    assert d.name.startswith("detaudit-") and (d / "METADATA").read_text().startswith("Metadata-Version")


def test_requirements_follow_markers_and_extras(tmp_path):
    w = _wheel(
        tmp_path,
        "fastapi",
        "1.0",
        [
            "starlette>=1",
            'uvicorn; extra == "standard"',
            'pywin32; sys_platform == "win32"',
            "six; python_version > '3.11'",
        ],
    )
    assert {r.name for r in bundle.requirements(w, set())} == {"starlette", "six"}
    assert {r.name for r in bundle.requirements(w, {"standard"})} == {"starlette", "uvicorn", "six"}


def test_slim_drops_fa2_and_keeps_record_true(tmp_path):
    w = tmp_path / "vllm-0.25.1-cp38-abi3-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(w, "w") as z:
        z.writestr("vllm/__init__.py", "x = 1\n")
        z.writestr("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", b"fa2" * 100)
        z.writestr("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so", b"fa3" * 100)
        z.writestr("vllm-0.25.1.dist-info/RECORD", "stale\n")
    out_dir = tmp_path / "slim"
    out_dir.mkdir()
    slim = bundle.slim_vllm(w, out_dir)
    with zipfile.ZipFile(slim) as z:
        names = set(z.namelist())
        record = z.read("vllm-0.25.1.dist-info/RECORD").decode()
        init = z.read("vllm/__init__.py")
    assert (
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" not in names and "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" in names
    )
    assert "_vllm_fa2_C" not in record and "stale" not in record
    digest = hashlib.sha256(init).digest()
    import base64

    assert f"vllm/__init__.py,sha256={base64.urlsafe_b64encode(digest).rstrip(b'=').decode()},{len(init)}" in record


def test_the_device_call_plan_names_one_part_per_call(tmp_path):
    lines = bundle.device_calls(3, bundle.ROOT / ".carry")
    assert len(lines) == 3
    for k, line in enumerate(lines, 1):
        assert f"'.carry/vllm-part{k:02d}'" in line and "python3 tools/vllm_install.py --from .carry" in line
        assert len(line.split("command: ", 1)[1]) < 2000
    assert "installs" in lines[-1]
    assert json.dumps(lines)  # plain strings, printable as the plan
