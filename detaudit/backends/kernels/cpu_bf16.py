"""bf16 block products with fp32 accumulation on CPUs with AVX-512 BF16 or AMX, chosen once per process.

The product is oneDNN's brgemm micro-kernel as PyTorch exports it (`at::native::cpublas::brgemm`, the
call behind PyTorch's CPU flash attention and Inductor's CPU GEMM templates): C[M, N] fp32 = A[M, K]
bf16 @ B[K, N] bf16, B in VNNI pairs [K/2, N, 2]. The kernel is single-threaded code with no reduction
across rows, so here, as on the fp32 path (`cpu_gemm`), a product's calls have one shape: R
zero-padded rows, all of K, and one W-column panel of a weight packed panel-major ([P, K/2, W, 2], each
panel contiguous). oneDNN generates one kernel per call shape (M, N, K, strides, dtypes), so a call's
bits depend only on its operands; splitting the blocks or panels over threads changes which thread makes
a call, never the call. A decode product with fewer panel calls than threads makes its calls over
64-column-multiple parts of its panels (`sub_width`), which the self-check keeps only where a part's
outputs have the whole panel's bits (each output's K in the same order: so on both paths below). Two
paths, by what oneDNN runs on this CPU (its own answer, `_onednn_amx`):

- `avx512_bf16` (R = 8): each fp32 output lane is a run of `vdpbf16ps` over K in order (two exact bf16
  products per step, accumulated in fp32; bf16 denormals read as zero).
- `amx` (R = 16, one full tile of rows): `tdpbf16ps` on AMX tiles. oneDNN's AMX kernel
  (`jit_brgemm_amx_uker`, blocking in `brgemm_utils.cpp`) cuts the call into C tiles of R rows x 16
  columns and K into blocks of `rd_block` = the largest even divisor of K up to 32, accumulated into the
  C tile in K order; for M <= 16 none of that depends on anything but (M, N, K) (no cache-size or
  thread heuristic), and the instruction computes each row of a tile from that row of A alone. So
  the bits are again the block's and the weight's, but not `avx512_bf16`'s: a recorded path of its own.
  The tile configuration is per thread: a thread that made calls releases it (`brgemm_release`) at the
  end of its slice, so AMX code elsewhere on that thread (oneDNN's own bf16 GEMMs) and ours never find
  each other's tiles.

A start-up check (`_self_check`, three calls) compares a product with fp32 to rounding and checks
that a row's bits do not depend on the block's other rows or on its slot. tests/unit/test_bio.py
and test_tbik.py check batch, row-position, thread-count, column-shard and TP invariance on each path.

Where the CPU lacks AVX-512 BF16 (or oneDNN is capped below it), every product stays fp32
(`cpu_gemm.block_products`). `DETAUDIT_CPU_GEMM` = auto (default) | bf16 | fp32 overrides the choice;
bf16 where the machine cannot run it is refused. `ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16` on an AMX CPU
gives the `avx512_bf16` path. The choice is part of the backends' descriptions, so runs made on CPUs of
different kinds are never merged as one.
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

from detaudit.backends.kernels import cpu_calls, cpu_replay
from detaudit.errors import DetauditError

ENV = "DETAUDIT_CPU_GEMM"
CHOICES = ("auto", "bf16", "fp32")
# R: rows per call, per path. vdpbf16ps is compute bound and decode batches are small: padding costs, so
# 8. An AMX tile holds 16 rows and a call loads each 16-column tile of B once per block whatever its
# rows, so 16 rows halve B's loads per row in prefill and fill the tiles
ROWS = {"avx512_bf16": 8, "amx": 16}
# flops of calls worth a thread of their own (`cpu_calls.threads_for`), per path: a thread's share must pay
# for its hand-off. vdpbf16ps: 4 MFLOP, where a 2-core VM's decode products (14-28 MFLOP) gained from two
# threads; AMX calls are ~4x faster (6.5 against 29 us for one [16, 576] x [576, 256] call on one AMX
# host, tools/amx_calls.py), and there a decode product over 16 threads spent more in hand-offs than in
# calls (0.67 ms against torch's 45 us): 16 MFLOP (reports/cpu-bf16)
PER_THREAD = {"avx512_bf16": 4e6, "amx": 16e6}
# ...where the compiled team (`cpu_team`) makes the calls: its hand-off is ~30 us, not the pool's 0.1-0.2
# ms, and a decode product's weight is read from memory at the bandwidth of the threads that share it: on
# the 16-core AMX host 4 MFLOP (a decode product over 4-7 threads) doubled bio+tbik's decode against 16,
# and since the team's sleepers are woken by one bell 2 MFLOP (7-16 threads) beat 1, 4 and 8 there
# (reports/cpu-bf16). vdpbf16ps keeps its 4 (not measured with the team)
TEAM_PER_THREAD = {"avx512_bf16": 4e6, "amx": 2e6}
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
# at::native::cpublas::brgemm_release(bool is_vnni): releases this thread's AMX tiles
_RELEASE = "_ZN2at6native7cpublas14brgemm_releaseEb"
# at::native::cpublas::could_pack(c10::ScalarType): for BFloat16, whether oneDNN's effective ISA (its CPU
# checks, the OS's AMX permission and any ONEDNN_MAX_CPU_ISA cap) includes AMX: the ISA the kernel
# generator then picks for bf16 (brgemm_utils.cpp `set_isa_impl`)
_COULD_PACK = "_ZN2at6native7cpublas10could_packEN3c1010ScalarTypeE"
_BFLOAT16 = 15  # c10::ScalarType::BFloat16
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
_AMX_BF16 = ("amx_bf16", "amx_tile")


@dataclass(frozen=True)
class Choice:
    path: str  # "amx" | "avx512_bf16": bf16 operands through the micro-kernel; "fp32": fp32 products
    why: str  # the flags or setting that decided it, for the description

    @property
    def bf16(self) -> bool:
        return self.path != "fp32"

    @property
    def rows(self) -> int:
        """R of this path's calls (the fp32 path's blocks are `fixed.ROWS`)."""
        return ROWS.get(self.path, 0)

    def describe(self) -> str:
        if self.path == "amx":
            return f"bf16 inputs, fp32 accumulation on AMX tiles: {self.why}"
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


def decide(
    setting: str, flags: frozenset[str], environ, kernel_found: bool, onednn: bool, onednn_amx: bool | None
) -> Choice:
    """The path from the setting, the CPU flags, the environment's oneDNN cap, whether torch exports the
    micro-kernel, whether oneDNN is available and enabled, and whether oneDNN runs bf16 on AMX here
    (None: torch cannot say). Pure: the decision table."""
    if setting not in CHOICES:
        raise DetauditError(f"{ENV} must be one of {', '.join(CHOICES)}, got {setting!r}")
    if setting == "fp32":
        return Choice("fp32", f"{ENV}=fp32")
    blocker = None
    missing = [f for f in _AVX512_BF16 if f not in flags]
    caps = {k: environ[k] for k in _ISA_ENV if environ.get(k)}
    amx_cpu = all(f in flags for f in _AMX_BF16)
    if missing:
        blocker = f"CPU flags lack {', '.join(missing)}"
    elif caps and any(v.upper() not in _ISA_BF16_OR_ABOVE for v in caps.values()):
        blocker = "oneDNN capped below AVX512_CORE_BF16 (" + ", ".join(f"{k}={v}" for k, v in caps.items()) + ")"
    elif not onednn:
        blocker = "oneDNN (torch.backends.mkldnn) unavailable or disabled"
    elif not kernel_found:
        blocker = f"torch {torch.__version__} exports no at::native::cpublas::brgemm / brgemm_release for bf16"
    elif amx_cpu and onednn_amx is None:
        blocker = f"AMX CPU, and torch {torch.__version__} exports no cpublas::could_pack to say if oneDNN uses AMX"
    if blocker is not None:
        if setting == "bf16":
            raise DetauditError(f"{ENV}=bf16: this machine cannot run the bf16 products: {blocker}")
        return Choice("fp32", blocker)
    if amx_cpu and onednn_amx:
        # every AMX flag is named: a later AMX generation is recorded as another path, never merged with
        # this one unchecked
        amx = " ".join(sorted(f for f in flags if f.startswith("amx")))
        return Choice("amx", f"CPU flags {amx}, oneDNN on AMX: oneDNN brgemm micro-kernel, tdpbf16ps")
    if amx_cpu:  # oneDNN capped below AMX (ONEDNN_MAX_CPU_ISA) or AMX not permitted by the OS
        cap = ", ".join(f"{k}={v}" for k, v in caps.items()) or "no ONEDNN_MAX_CPU_ISA cap"
        return Choice(
            "avx512_bf16", f"CPU flags avx512_bf16, AMX unused by oneDNN ({cap}): oneDNN brgemm micro-kernel, vdpbf16ps"
        )
    return Choice("avx512_bf16", "CPU flags avx512_bf16 (no AMX): oneDNN brgemm micro-kernel, vdpbf16ps")


_kernel: cpu_calls.Kernel | None = None  # the micro-kernel where this process chose a bf16 path
_chosen: Choice | None = None
_parts_checked = False  # whether this kernel's calls over parts of a panel gave the whole panel's bits


@functools.cache
def _torch_cpu() -> ctypes.CDLL | None:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
    except OSError:
        return None


def _symbol(name: str, restype, argtypes: list):
    lib = _torch_cpu()
    try:
        fn = lib[name] if lib is not None else None
    except AttributeError:
        return None
    if fn is not None:
        fn.restype, fn.argtypes = restype, argtypes
    return fn


def _find_kernel():
    return _symbol(
        _SYMBOL,
        None,
        [ctypes.c_int64] * 6 + [ctypes.c_bool, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_bool],
    )


def _onednn_amx() -> bool | None:
    """Whether oneDNN runs bf16 products on AMX in this process (None: this torch cannot say)."""
    fn = _symbol(_COULD_PACK, ctypes.c_bool, [ctypes.c_int8])
    return None if fn is None else bool(fn(_BFLOAT16))


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value if fn is not None else 0


def choice() -> Choice:
    """The path of this process, decided on first use (CPU flags, oneDNN cap, `DETAUDIT_CPU_GEMM`)."""
    return _chosen or choose()


def choose(setting: str | None = None) -> Choice:
    """Decide the path from `setting` (auto | bf16 | fp32; None: `DETAUDIT_CPU_GEMM`, default auto) and
    keep it for this process. Called again only by tests, to run both paths on one machine."""
    global _chosen, _kernel, _parts_checked
    setting = (os.environ.get(ENV, "auto") if setting is None else setting).strip().lower()
    fn = _find_kernel()
    release = _symbol(_RELEASE, None, [ctypes.c_bool])
    onednn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    flags = cpu_flags()
    amx = _onednn_amx() if onednn and all(f in flags for f in _AMX_BF16) else False
    _chosen = decide(setting, flags, os.environ, fn is not None and release is not None, onednn, amx)
    _kernel = None
    if _chosen.bf16:
        amx = _chosen.path == "amx"
        path = _chosen.path
        shares = PER_THREAD[path], TEAM_PER_THREAD[path]
        _kernel = cpu_calls.Kernel(fn, _address(fn), release, _address(release), amx, *shares)
        _parts_checked = False  # (until `_self_check` compares them)
        if bad := _self_check():
            _kernel = None
            if setting == "bf16":
                _chosen = None
                raise DetauditError(f"{ENV}=bf16: {bad}")
            _chosen = Choice("fp32", bad)
    return _chosen


def _self_check() -> str | None:
    """The chosen kernel on three fixed blocks, before any result depends on it. A torch whose exported
    kernel computes something else (another B layout) fails the comparison with the fp32 product (the
    same exact products, summed in another order: agreement to fp32 rounding, not bits); a kernel whose
    rows interact (a row's bits changing with the block's other rows or with its slot) fails the second."""
    r = _chosen.rows
    g = torch.Generator().manual_seed(0)
    a = torch.randn(2 * r, 96, generator=g).bfloat16()
    w = torch.randn(160, 96, generator=g).bfloat16()
    packed = pack(w)

    def product(x: Tensor) -> Tensor:  # a block at a time: one call each, made here (no compiled loop)
        return torch.cat([matmul(x[i : i + r], packed, 160) for i in range(0, len(x), r)])

    got = product(a)
    want = a.float() @ w.float().t()
    if not torch.allclose(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max())):
        return f"the exported brgemm kernel of torch {torch.__version__} failed its self-check against fp32"
    # every row again, in another slot and among other rows: a[r+1..] then a[0] in block 0, a[1..r] in 1
    mixed = torch.cat([a[r + 1 :], a[: r + 1]])
    again = product(mixed)
    if not torch.equal(again[r - 1 :], got[: r + 1]) or not torch.equal(again[: r - 1], got[r + 1 :]):
        return f"the exported brgemm kernel of torch {torch.__version__}: a row's bits depend on the other rows"
    # the same block in 64-column parts of its panel (`sub_width`): kept only where its bits are the whole's.
    # A call at a time: `cpu_calls.run` of one call imports no numba (a description runs this check)
    global _parts_checked
    parts, shape, table, flops, _ = _calls(blocks_of(a[:r])[None], packed[None], PANEL_UNIT)
    for call in table:
        cpu_calls.run(_kernel, shape, call[None], flops)
    _parts_checked = torch.equal(parts.view(r, -1)[:, :160], got[:r])
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
    r = choice().rows
    nb, k2 = -(-m // r), k + (k & 1)
    if m == nb * r and k == k2 and x2.is_contiguous():
        return x2.view(nb, r, k)
    xp = torch.zeros(nb * r, k2, dtype=torch.bfloat16, device=x2.device)
    xp[:m, :k] = x2
    return xp.view(nb, r, k2)


def _operands(a: Tensor, packed: Tensor, what: str) -> tuple[int, int, int, int]:
    """a's (G, nb, R, K2), refusing operands the calls cannot take: rows other than this path's R, bf16
    rows not contiguous, a K2 unlike the packed weight's, a packed weight not contiguous."""
    g, nb, r, k2 = a.shape
    rows = choice().rows
    half = packed.shape[2]
    if r != rows or half * 2 != k2 or a.stride(3) != 1 or a.dtype != torch.bfloat16 or not packed.is_contiguous():
        raise ValueError(f"bf16 {what} need bf16 [G, nb, {rows}, K2] rows, got {tuple(a.shape)} {a.dtype}")
    return g, nb, r, k2


def products(a: Tensor, packed: Tensor, cols: int | None = None, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """fp32 [G, nb, R, P*W]: out[g, j] = a[g, j] @ packed[g], one call per (group, block, panel), or per
    (group, block, part of a panel) of `cols` columns (default: `sub_width`'s, where the self-check found
    parts give the whole panel's bits).

    a[G, nb, R, K2] bf16 may be a strided view (the tree's leaves are K slices of the rows' blocks) as
    long as each row is contiguous; packed[G, P, K2/2, W, 2] holds G weights packed by `pack`. All
    calls of one product, every group's, are one table run over the threads at once (`cpu_calls`).

    `out_dtype` bf16: the same products rounded to bf16 as `.to(torch.bfloat16)` rounds them, each call's
    in the thread's cache as it is made (`cpu_loop.loop`), where the calls are compiled; else the fp32
    output's cast. (A NaN product becomes 0x7FC0, c10's scalar rule: `cpu_rows._to_bf16`.)"""
    if out_dtype == torch.bfloat16:
        out, shape, table, flops, threads = _calls(a, packed, cols, torch.bfloat16)
        bits = out.view(torch.int16).numpy().reshape(-1)
        if table is None or cpu_calls.run(_kernel, shape, table, flops, threads, bits):
            return out
    out, shape, table, flops, threads = _calls(a, packed, cols)
    if table is not None:
        cpu_calls.run(_kernel, shape, table, flops, threads)
    return out.to(out_dtype)


def _calls(a: Tensor, packed: Tensor, cols: int | None, out_dtype: torch.dtype = torch.float32):
    """`products`' output, uninitialised, and its calls: (out, shape, table, flops, threads); table None
    where there is nothing to compute. A bf16 output's calls have C offsets relative to it (`cpu_loop.loop`
    rounds each product into it); an fp32 output's, its addresses."""
    g, nb, r, k2 = _operands(a, packed, "products")
    _, p, half, width, _ = packed.shape
    out = torch.empty(g, nb, r, p * width, dtype=out_dtype)
    if out.numel() == 0:
        return out, None, None, 0.0, 1
    kernel = _kernel
    if kernel is None or not torch.backends.mkldnn.enabled:  # (calling it then would abort the process)
        raise DetauditError("bf16 CPU products: oneDNN was disabled after the bf16 path was chosen")
    a_group, a_block, lda, _ = a.stride()
    per_thread = cpu_calls.share(kernel.per_thread, kernel.team_per_thread)
    shape, offsets, flops, threads = _plan(
        (g, nb, r, k2, p, half, width),
        (a_group, a_block, lda),
        cols,
        _parts_checked,
        per_thread,
        torch.get_num_threads(),
    )
    c_at = out.data_ptr() if out_dtype == torch.float32 else 0
    table = offsets + np.array([a.data_ptr(), packed.data_ptr(), c_at], dtype=np.int64)
    cpu_replay.keep(a, packed, out)  # (the table's addresses)
    return out, shape, table, flops, threads


@functools.lru_cache(maxsize=1024)
def _plan(dims: tuple, strides: tuple, cols: int | None, parts: bool, per_thread: float, torch_threads: int):
    """A product's calls apart from its operands' addresses: (shape, byte offsets, flops, threads), the
    same for every product of its dims and strides at one share of flops a thread (`cpu_calls.share`) and
    one torch thread count, so a decode step's products look them up instead of working them out again
    each. The threads are `cpu_calls.kernel_threads`' answer."""

    def threads(n: int, flops: float) -> int:
        return cpu_calls.threads_for(n, flops, cpu_calls.MIN_SPLIT_FLOPS, per_thread)

    g, nb, r, k2, p, half, width = dims
    a_group, a_block, lda = strides
    ldc = p * width
    flops = 2.0 * g * nb * r * k2 * p * width
    if cols is None:
        units = width // PANEL_UNIT if parts else 1
        cols = sub_width(g * nb * p, width, threads(g * nb * p * units, flops))
    offsets = _offsets(g, p, nb, a_group, a_block, r * ldc, half * width * 2 * 2, width, cols)
    shape = (r, cols, k2, lda, width, ldc)  # ldb: the panel's W, whatever columns a call makes
    return shape, offsets, flops, threads(len(offsets), flops)


def sub_width(calls: int, width: int, threads: int) -> int:
    """The columns of one call: all of a panel's W, or, where a product has fewer panel calls than the
    `threads` its flops are worth (a decode step: one block of rows, a few panels), W cut into the fewest
    equal parts, each a multiple of 64 columns, that give every thread a call. A call over a panel's
    column range reads the panel in place (ldb = W) and adds each output's K in the same order as the
    whole panel's call (`vdpbf16ps` runs per lane, AMX per 16-column tile), so the same bits; the
    panels' weights are read by more threads at once."""
    units = width // PANEL_UNIT
    for parts in range(1, units + 1):
        if units % parts == 0 and calls * parts >= threads:
            return width // parts
    return PANEL_UNIT


def leaf_sums(a: Tensor, packed: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor | None:
    """fp32 [nb, R, P*W]: the G leaf products of `products(a, packed)` (G a power of two, at least 2)
    added pairwise, ((l0 + l1) + (l2 + l3)) + ..., each output block's leaves summed by the thread that
    computed them while they are in its cache: `tree.pairwise`'s adds in its pairs, so its bits, without
    the [G, ...] products in memory. None where the calls are not compiled, or where a product worth
    splitting has fewer output blocks than threads: the caller adds the leaves. `out_dtype` bf16: each sum
    rounded to bf16 (torch's rounding) as it is stored, so the fp32 sums never reach memory either."""
    g, nb, r, k2 = _operands(a, packed, "leaf sums")
    if g < 2 or g & (g - 1):
        raise ValueError(f"leaf sums need a power-of-two number of leaves, at least 2, got {g}")
    _, p, half, width, _ = packed.shape
    if _kernel is None or not torch.backends.mkldnn.enabled:
        return None
    flops = 2.0 * g * nb * r * k2 * p * width
    if p * nb < cpu_calls.kernel_threads(_kernel, g * nb * p, flops):
        return None  # fewer jobs than threads (a decode step's few panels): the leaves' calls spread wider
    bf16 = out_dtype == torch.bfloat16
    out = torch.empty(nb, r, p * width, dtype=torch.bfloat16 if bf16 else torch.float32)
    if out.numel() == 0:
        return out
    a_group, a_block, lda, _ = a.stride()
    ldc = p * width
    table = _tree_offsets(g, p, nb, a_group, a_block, r * ldc, half * width * 2 * 2, width) + np.array(
        [a.data_ptr(), packed.data_ptr(), 0], dtype=np.int64
    )
    cpu_replay.keep(a, packed)  # (the table's addresses)
    shape = (r, width, k2, lda, width, ldc)
    flat = out.view(torch.int16 if bf16 else torch.float32).numpy().reshape(-1)
    done = cpu_calls.run_tree(_kernel, shape, table, g, None if bf16 else flat, flops, flat if bf16 else None)
    return out if done else None


def leaf_tree(leaves: Tensor, out_dtype: torch.dtype = torch.float32) -> Tensor | None:
    """fp32 leaves[G, ...] (G a power of two, at least 2) added pairwise, ((l0 + l1) + (l2 + l3)) + ...:
    `tree.pairwise`'s adds in its pairs, so its bits, in compiled calls (spread over threads where the
    elements are many: `cpu_calls.pairwise`) instead of a torch op per level. Where `leaf_sums` leaves the
    sums to the caller (a decode step's few output blocks), those torch adds were a parallel region each
    on a many-core host (reports/cpu-bf16). `out_dtype` bf16: the sums rounded to bf16 as they are stored
    (torch's rounding, as `leaf_sums`), the caller's cast then none. None where nothing is compiled."""
    g = leaves.shape[0]
    mod = cpu_calls.compiled("cpu_loop")
    if mod is None or g < 2 or g & (g - 1) or leaves.dtype != torch.float32 or not leaves.is_contiguous():
        return None
    out = torch.empty(g // 2, *leaves.shape[1:], dtype=torch.float32)
    bf16 = out_dtype == torch.bfloat16
    out16 = torch.empty(leaves.shape[1:] if bf16 else (0,), dtype=torch.bfloat16)
    flat16 = out16.view(torch.int16).view(-1).numpy()
    cpu_calls.pairwise(leaves.view(g, -1).numpy(), out.view(g // 2, -1).numpy(), flat16)
    return out16 if bf16 else out[0]


@functools.lru_cache(maxsize=1024)
def _tree_offsets(
    g: int, p: int, nb: int, a_group: int, a_block: int, c_block: int, b_panel: int, width: int
) -> np.ndarray:
    """`_offsets` in (panel, block, leaf) order, a job's G leaves together, C the leaf-0 call's offset
    (its place in the summed [nb, R, P*W] output)."""
    table = _offsets(g, p, nb, a_group, a_block, c_block, b_panel, width).reshape(g, p * nb, 3)
    table = table.transpose(1, 0, 2).reshape(-1, 3).copy()  # (the cached `_offsets` stays read-only)
    table[:, 2] = np.repeat(table[::g, 2], g)
    table.flags.writeable = False
    return table


@functools.lru_cache(maxsize=1024)
def _offsets(
    g: int, p: int, nb: int, a_group: int, a_block: int, c_block: int, b_panel: int, width: int, cols: int | None = None
) -> np.ndarray:
    """Byte offsets (A, B, C) of every call of a product, one row per call in (group, panel, part, block)
    order, a call making `cols` (default W) of a panel's columns: a thread's contiguous share of the table
    walks a panel across the blocks it meets, so the panel is read from memory once for them. The same
    for every product of one shape (cached)."""
    cols = cols or width
    axes = (np.arange(g), np.arange(p), np.arange(width // cols), np.arange(nb))
    gi, q, part, j = (x.ravel() for x in np.meshgrid(*axes, indexing="ij"))
    table = np.empty((gi.size, 3), dtype=np.int64)
    table[:, 0] = (gi * a_group + j * a_block) * 2  # bf16 rows
    table[:, 1] = (gi * p + q) * b_panel + part * cols * 2 * 2  # a part's first column: VNNI pairs of bf16
    table[:, 2] = ((gi * nb + j) * c_block + q * width + part * cols) * 4  # fp32 output
    table.flags.writeable = False
    return table


def matmul(x2: Tensor, packed: Tensor, n: int, out_dtype: torch.dtype = torch.float32) -> Tensor:
    """x2[M, K] @ w^T for w packed by `pack` (N = n columns), accumulated in fp32, rounded once to
    `out_dtype` (`products`)."""
    m = x2.shape[0]
    out = products(blocks_of(x2)[None], packed[None], out_dtype=out_dtype)
    return out.view(-1, out.shape[-1])[:m, :n]
