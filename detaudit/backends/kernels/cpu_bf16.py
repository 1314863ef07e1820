"""bf16 block products with fp32 accumulation on CPUs with AVX-512 BF16, chosen once per process.

The product is oneDNN's brgemm micro-kernel as PyTorch exports it (`at::native::cpublas::brgemm`, the
call behind PyTorch's CPU flash attention and Inductor's CPU GEMM templates): C[M, N] fp32 = A[M, K]
bf16 @ B[K, N] bf16, B in VNNI pairs [K/2, N, 2]. On AVX-512 BF16 each fp32 output lane is a run of
`vdpbf16ps` over K in order (two exact bf16 products per step, accumulated in fp32; bf16 denormals
read as zero). The kernel is single-threaded code with no reduction across rows, so here, as on the
fp32 path (`cpu_gemm`), every call has one shape per weight: R = 8 zero-padded rows, all of K, and one
W-column panel of a weight packed panel-major ([P, K/2, W, 2], each panel contiguous). A call's bits
then depend only on its operands; splitting the blocks or panels over threads changes which thread
makes a call, never the call. tests/unit/test_bio.py and test_tbik.py check batch, row-position,
thread-count, column-shard and TP invariance on both paths.

Where the CPU lacks AVX-512 BF16 (or oneDNN is capped below it, or the CPU has AMX, whose tile
instructions round differently and which no test here has run on), every product stays fp32
(`cpu_gemm.block_products`). `DETAUDIT_CPU_GEMM` = auto (default) | bf16 | fp32 overrides the choice;
bf16 where the machine cannot run it is refused. The choice is part of the backends' descriptions, so
runs made on CPUs of different kinds are never merged as one.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from detaudit.backends.kernels import cpu_calls
from detaudit.errors import DetauditError

ENV = "DETAUDIT_CPU_GEMM"
CHOICES = ("auto", "bf16", "fp32")
ROWS = 8  # R: rows per call (decode batches are small and the micro-kernel is compute bound: padding costs)
PANEL_UNIT = 64  # W is a multiple of this...
PANEL_MAX = 256  # ...and at most this for a linear layer (of 64..512, 256 was at or near the fastest for
# the embedded model's shapes here; all of a wide N in one call was slower)
# ...and for a tree leaf (`tree`): a leaf's K is 1/8 of the layer's, and a call has a fixed cost of
# ~1.5 us, so fewer, wider calls
LEAF_PANEL_MAX = 1024
# at::native::cpublas::brgemm(int64 M, N, K, ld_a, ld_b, ld_c, bool add_C, const BFloat16* A,
# const BFloat16* B, float* C, bool is_vnni); the mangled name encodes every parameter type, so a torch
# whose function takes other arguments has no such symbol and gets the fp32 path
_SYMBOL = "_ZN2at6native7cpublas6brgemmEllllllbPKN3c108BFloat16ES5_Pfb"
_ISA_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
# oneDNN ISA caps (ONEDNN_MAX_CPU_ISA values) that leave the AVX-512 BF16 kernels enabled
_ISA_BF16_OR_ABOVE = frozenset(
    {
        "ALL",
        "DEFAULT",
        "AVX512_CORE_BF16",
        "AVX512_CORE_FP16",
        "AVX10_1_512",
        "AVX512_CORE_AMX",
        "AVX10_1_512_AMX",
        "AVX512_CORE_AMX_FP16",
        "AVX10_1_512_AMX_FP16",
        "AVX10_2_512",
        "AVX10_2_512_AMX_2",
    }
)
_AVX512_BF16 = ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")


@dataclass(frozen=True)
class Choice:
    bf16: bool  # bf16 operands go through the micro-kernel; fp32 products otherwise
    why: str  # the flags or setting that decided it, for the description

    def describe(self) -> str:
        return f"{'bf16 inputs, fp32 accumulation' if self.bf16 else 'fp32 products'}: {self.why}"


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty elsewhere)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def decide(setting: str, flags: frozenset[str], environ, kernel_found: bool, onednn: bool) -> tuple[bool, str]:
    """(bf16 path?, why) from the setting, the CPU flags, the environment's oneDNN cap, whether torch
    exports the micro-kernel and whether oneDNN is available and enabled. Pure: the decision table."""
    if setting not in CHOICES:
        raise DetauditError(f"{ENV} must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting == "fp32":
        return False, f"{ENV}=fp32"
    blocker = None
    missing = [f for f in _AVX512_BF16 if f not in flags]
    caps = {k: environ[k] for k in _ISA_ENV if environ.get(k)}
    if missing:
        blocker = f"CPU flags lack {', '.join(missing)}"
    elif "amx_bf16" in flags or "amx_tile" in flags:
        blocker = "AMX CPU (the micro-kernel would use AMX tiles; the bf16 path is validated on AVX-512 BF16 only)"
    elif caps and any(v.upper() not in _ISA_BF16_OR_ABOVE for v in caps.values()):
        blocker = "oneDNN capped below AVX512_CORE_BF16 (" + ", ".join(f"{k}={v}" for k, v in caps.items()) + ")"
    elif not onednn:
        blocker = "oneDNN (torch.backends.mkldnn) unavailable or disabled"
    elif not kernel_found:
        blocker = f"torch {torch.__version__} exports no at::native::cpublas::brgemm for bf16"
    if blocker is None:
        return True, "CPU flags avx512_bf16 (no AMX): oneDNN brgemm micro-kernel, vdpbf16ps"
    if setting == "bf16":
        raise DetauditError(f"{ENV}=bf16: this machine cannot run the bf16 products: {blocker}")
    return False, blocker


_kernel = None
_kernel_addr = 0
_chosen: Choice | None = None


def _find_kernel():
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
        fn = lib[_SYMBOL]
    except (OSError, AttributeError):
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_int64] * 6 + [
        ctypes.c_bool,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_void_p,
        ctypes.c_bool,
    ]
    return fn


def choice() -> Choice:
    """The path of this process, decided on first use (CPU flags, oneDNN cap, `DETAUDIT_CPU_GEMM`)."""
    return _chosen or choose()


def choose(setting: str | None = None) -> Choice:
    """Decide the path from `setting` (auto | bf16 | fp32; None: `DETAUDIT_CPU_GEMM`, default auto) and
    keep it for this process. Called again only by tests, to run both paths on one machine."""
    global _chosen, _kernel, _kernel_addr
    setting = (os.environ.get(ENV, "auto") if setting is None else setting).strip().lower()
    fn = _find_kernel()
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    bf16, why = decide(setting, cpu_flags(), os.environ, fn is not None, onednn)
    _kernel = fn if bf16 else None
    _kernel_addr = ctypes.cast(fn, ctypes.c_void_p).value if bf16 else 0
    if bf16 and (bad := _self_check()):
        if setting == "bf16":
            raise DetauditError(f"{ENV}=bf16: {bad}")
        bf16, why, _kernel = False, bad, None
    _chosen = Choice(bf16, why)
    return _chosen


def _self_check() -> str | None:
    """A torch whose exported kernel computes something else (another B layout) fails here, before any
    result depends on it: a fixed product against the fp32 one (the same exact products, summed in
    another order: agreement to fp32 rounding, not bits)."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(ROWS, 96, generator=g).bfloat16()
    w = torch.randn(160, 96, generator=g).bfloat16()
    got = matmul(a, pack(w), 160)
    want = a.float() @ w.float().t()
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
        return f"the exported brgemm kernel of torch {torch.__version__} failed its self-check against fp32"
    return None


def usable(x: Tensor, w: Tensor) -> bool:
    """Whether x @ w^T runs here: both bf16 on CPU and this process chose the bf16 path."""
    return x.dtype == torch.bfloat16 and w.dtype == torch.bfloat16 and x.device.type == "cpu" and choice().bf16


def panel_width(n: int, widest: int = PANEL_MAX) -> int:
    """W for a weight of N output columns: the widest multiple of 64, up to `widest`, that divides N
    rounded up to 64 (no padding beyond that; one panel shape per weight)."""
    units = -(-n // PANEL_UNIT)
    return PANEL_UNIT * max(d for d in range(1, widest // PANEL_UNIT + 1) if units % d == 0)


def pack(w: Tensor, widest: int = PANEL_MAX) -> Tensor:
    """w[N, K] as bf16 panels [P, K2/2, W, 2] (W = `panel_width(N, widest)`): panel p holds output
    columns p*W.. in VNNI pairs (element [p, i, j, t] = w[p*W + j, 2*i + t]); K2 is K rounded up to
    even, padding zero."""
    n, k = w.shape
    width = panel_width(n, widest)
    p, k2 = -(-n // width), k + (k & 1)
    wp = torch.zeros(p * width, k2, dtype=torch.bfloat16, device=w.device)
    wp[:n, :k] = w
    return wp.view(p, width, k2 // 2, 2).permute(0, 2, 1, 3).contiguous()


def blocks_of(x2: Tensor) -> Tensor:
    """x2[M, K] bf16 as [ceil(M/R), R, K2] (rows and an odd K zero padded; no copy when nothing is)."""
    m, k = x2.shape
    nb, k2 = -(-m // ROWS), k + (k & 1)
    if m == nb * ROWS and k == k2 and x2.is_contiguous():
        return x2.view(nb, ROWS, k)
    xp = torch.zeros(nb * ROWS, k2, dtype=torch.bfloat16, device=x2.device)
    xp[:m, :k] = x2
    return xp.view(nb, ROWS, k2)


def products(a: Tensor, packed: Tensor) -> Tensor:
    """fp32 [G, nb, R, P*W]: out[g, j] = a[g, j] @ packed[g], one call per (group, block, panel).

    a[G, nb, R, K2] bf16 may be a strided view (the tree's leaves are K slices of the rows' blocks) as
    long as each row is contiguous; packed[G, P, K2/2, W, 2] holds G weights packed by `pack`. All
    calls of one product, every group's, are one table run over the threads at once (`cpu_calls`)."""
    g, nb, r, k2 = a.shape
    _, p, half, width, _ = packed.shape
    if r != ROWS or half * 2 != k2 or a.stride(3) != 1 or a.dtype != torch.bfloat16 or not packed.is_contiguous():
        raise ValueError(f"bf16 products need bf16 [G, nb, {ROWS}, K2] rows, got {tuple(a.shape)} {a.dtype}")
    out = torch.empty(g, nb, r, p * width, dtype=torch.float32)
    if out.numel() == 0:
        return out
    fn = _kernel
    if fn is None or not torch.backends.mkldnn.enabled:  # (calling it then would abort the process)
        raise DetauditError("bf16 CPU products: oneDNN was disabled after the bf16 path was chosen")
    a_group, a_block, lda, _ = a.stride()
    ldc = p * width
    table = _offsets(g, p, nb, a_group, a_block, r * ldc, half * width * 2 * 2, width) + np.array(
        [a.data_ptr(), packed.data_ptr(), out.data_ptr()], dtype=np.int64
    )
    cpu_calls.run(fn, _kernel_addr, (r, width, k2, lda, width, ldc), table, 2.0 * g * nb * r * k2 * p * width)
    return out


@functools.lru_cache(maxsize=1024)
def _offsets(g: int, p: int, nb: int, a_group: int, a_block: int, c_block: int, b_panel: int, width: int) -> np.ndarray:
    """Byte offsets (A, B, C) of every call of a product, one row per call in (group, panel, block)
    order: a thread's contiguous share of the table walks a panel across the blocks it meets, so the
    panel is read from memory once for them. The same for every product of one shape (cached)."""
    gi, q, j = (x.ravel() for x in np.meshgrid(np.arange(g), np.arange(p), np.arange(nb), indexing="ij"))
    table = np.empty((gi.size, 3), dtype=np.int64)
    table[:, 0] = (gi * a_group + j * a_block) * 2  # bf16 rows
    table[:, 1] = (gi * p + q) * b_panel
    table[:, 2] = ((gi * nb + j) * c_block + q * width) * 4  # fp32 output
    table.flags.writeable = False
    return table


def matmul(x2: Tensor, packed: Tensor, n: int) -> Tensor:
    """fp32 x2[M, K] @ w^T for w packed by `pack` (N = n columns)."""
    m = x2.shape[0]
    out = products(blocks_of(x2)[None], packed[None])
    return out.view(-1, out.shape[-1])[:m, :n]
