"""The CPU product path: which one a machine gets (the decision table, with made-up flag sets for the
kinds of CPU this machine may not be: AVX2-only, AVX-512 BF16, AMX), that the backends' descriptions
name it, and that runs made on two paths are refused as one run. The products themselves are tested in test_bio.py
and test_tbik.py on each path this machine has."""

from __future__ import annotations

import pytest
import torch

from detaudit.backends import get_backend
from detaudit.backends.kernels import cpu_bf16, fixed
from detaudit.errors import DetauditError
from detaudit.runs.manifest import numerics_conflicts

AVX2 = frozenset("fpu sse sse2 avx fma f16c avx2 bmi2".split())
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni"}
AVX512_BF16 = AVX512 | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_tile", "amx_int8"}


@pytest.fixture
def bf16_chosen():
    """The bf16 product path for the test (skipped where this machine cannot run it); after it, the
    environment's path and torch's thread count as they were."""
    threads = torch.get_num_threads()
    try:
        cpu_bf16.choose("bf16")
    except DetauditError as e:
        pytest.skip(str(e))
    yield
    torch.set_num_threads(threads)
    cpu_bf16.choose()


def _decide(setting="auto", flags=AVX512_BF16, environ=None, kernel=True, onednn=True, onednn_amx=False):
    c = cpu_bf16.decide(setting, flags, environ or {}, kernel, onednn, onednn_amx)
    return c.path, c.why


def test_bf16_where_the_cpu_has_avx512_bf16_and_amx_where_onednn_runs_it():
    assert _decide() == ("avx512_bf16", "CPU flags avx512_bf16 (no AMX): oneDNN brgemm micro-kernel, vdpbf16ps")
    path, why = _decide(flags=AVX2)
    assert path == "fp32" and "avx512_bf16" in why and "avx512f" in why
    assert _decide(flags=AVX512) == ("fp32", "CPU flags lack avx512_bf16")
    # AMX: its own path where oneDNN runs bf16 on AMX, named with every AMX flag (another generation's
    # flags make another path)
    assert _decide(flags=AMX, onednn_amx=True) == (
        "amx",
        "CPU flags amx_bf16 amx_int8 amx_tile, oneDNN on AMX: oneDNN brgemm micro-kernel, tdpbf16ps",
    )
    assert _decide(flags=AMX | {"amx_fp16"}, onednn_amx=True)[1].startswith("CPU flags amx_bf16 amx_fp16 amx_int8")
    # ...the vdpbf16ps path where oneDNN does not (capped, or the OS refused AMX), saying so
    path, why = _decide(flags=AMX, environ={"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"})
    assert path == "avx512_bf16" and "AMX unused by oneDNN (ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16)" in why
    assert "no ONEDNN_MAX_CPU_ISA cap" in _decide(flags=AMX)[1]
    # ...and fp32 where torch cannot tell which
    path, why = _decide(flags=AMX, onednn_amx=None)
    assert path == "fp32" and "could_pack" in why
    assert _decide(onednn=False)[0] == "fp32"
    assert "exports no" in _decide(kernel=False)[1]


def test_paths_name_their_rows_and_describe_themselves_apart():
    amx = cpu_bf16.Choice("amx", "x")
    avx = cpu_bf16.Choice("avx512_bf16", "x")
    assert (amx.rows, avx.rows, amx.bf16, avx.bf16, cpu_bf16.Choice("fp32", "x").bf16) == (16, 8, True, True, False)
    assert amx.describe() != avx.describe()
    assert avx.describe() == "bf16 inputs, fp32 accumulation: x"  # unchanged: earlier AVX-512 runs still merge


def test_onednn_cap_below_bf16_means_fp32():
    path, why = _decide(environ={"ONEDNN_MAX_CPU_ISA": "AVX2"})
    assert path == "fp32" and "ONEDNN_MAX_CPU_ISA=AVX2" in why
    assert _decide(flags=AMX, onednn_amx=True, environ={"ONEDNN_MAX_CPU_ISA": "AVX2"})[0] == "fp32"
    assert _decide(environ={"DNNL_MAX_CPU_ISA": "avx512_core"})[0] == "fp32"
    assert _decide(environ={"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"})[0] == "avx512_bf16"
    assert _decide(environ={"ONEDNN_MAX_CPU_ISA": "ALL"})[0] == "avx512_bf16"


def test_settings_force_or_refuse():
    assert _decide("fp32") == ("fp32", "DETAUDIT_CPU_GEMM=fp32")
    assert _decide("bf16")[0] == "avx512_bf16"
    assert _decide("bf16", flags=AMX, onednn_amx=True)[0] == "amx"
    for flags, amx in ((AVX2, False), (AMX, None)):
        with pytest.raises(DetauditError, match="DETAUDIT_CPU_GEMM=bf16: this machine cannot"):
            _decide("bf16", flags=flags, onednn_amx=amx)
    with pytest.raises(DetauditError, match="auto, bf16, fp32"):
        _decide("fast")


def test_bad_setting_from_the_environment_is_refused(monkeypatch):
    monkeypatch.setenv(cpu_bf16.ENV, "fast")
    try:
        with pytest.raises(DetauditError, match="DETAUDIT_CPU_GEMM must be one of"):
            cpu_bf16.choose()
    finally:
        monkeypatch.delenv(cpu_bf16.ENV)
        cpu_bf16.choose()


def test_panel_width_divides_n_padded_to_64():
    widths = {n: cpu_bf16.panel_width(n) for n in (64, 192, 512, 576, 1536, 49152, 37, 300)}
    assert widths == {64: 64, 192: 192, 512: 256, 576: 192, 1536: 256, 49152: 256, 37: 64, 300: 64}
    leaves = {n: cpu_bf16.panel_width(n, cpu_bf16.LEAF_PANEL_MAX) for n in (576, 1536, 4096, 300)}
    assert leaves == {576: 576, 1536: 768, 4096: 1024, 300: 320}


def test_panels_are_cut_into_column_parts_only_where_threads_would_idle():
    """`sub_width`: a call makes a whole panel unless the product's panel calls are fewer than its threads
    (a decode step); then the fewest equal parts (multiples of 64 columns) that give each thread a call."""
    assert cpu_bf16.sub_width(3, 192, 1) == 192  # one thread: whole panels
    assert cpu_bf16.sub_width(3, 192, 3) == 192
    assert cpu_bf16.sub_width(3, 192, 4) == 64  # 3 panels of 3 units: 9 calls
    assert cpu_bf16.sub_width(3, 192, 16) == 64  # no narrower than 64 columns
    assert cpu_bf16.sub_width(6, 256, 8) == 128  # a [8, 1536] gate: 12 calls of 128 columns
    assert cpu_bf16.sub_width(6, 256, 20) == 64
    assert cpu_bf16.sub_width(40, 256, 16) == 256  # prefill: calls enough
    assert cpu_bf16.sub_width(1, 64, 8) == 64
    table = cpu_bf16._offsets(1, 2, 1, 0, 0, 16 * 384, 288 * 192 * 4, 192, 64)
    assert table[:, 1].tolist() == [0, 256, 512, 288 * 192 * 4, 288 * 192 * 4 + 256, 288 * 192 * 4 + 512]
    assert table[:, 2].tolist() == [0, 256, 512, 768, 1024, 1280]  # columns 0, 64, ... 320 (fp32)


@pytest.mark.parametrize("rows, k, n", [(8, 576, 576), (8, 576, 1536), (16, 1536, 576), (5, 104, 384)])
def test_column_parts_give_the_whole_panels_bits(bf16_chosen, monkeypatch, rows, k, n):
    """A product made in 64-column parts of its panels (a decode step's calls spread over more threads)
    has the bits of the same product made a whole panel a call: each output's K is added in the same
    order, whatever columns share its call."""
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    packed = cpu_bf16.pack(w)
    assert packed.shape[2] > cpu_bf16.PANEL_UNIT  # panels of several parts
    outs = {}
    for parts in ("whole", "parts"):
        cut = (lambda calls, width, threads: width) if parts == "whole" else (lambda *a: cpu_bf16.PANEL_UNIT)
        monkeypatch.setattr(cpu_bf16, "sub_width", cut)
        for threads in (1, 3):
            torch.set_num_threads(threads)
            outs[parts, threads] = cpu_bf16.matmul(x, packed, n)
    want = outs["whole", 1]
    assert all(torch.equal(out, want) for out in outs.values())
    assert torch.allclose(want, x.float() @ w.float().t(), rtol=1e-4, atol=1e-3)


def test_a_table_takes_one_thread_per_share_that_pays_for_its_hand_off(monkeypatch):
    """`cpu_calls.threads_for`: one thread below the split threshold, else one per `per_thread` flops (a
    decode step's products on a 16-core host take a few threads, not all), never more than the pieces or
    torch's thread count; the share is the path's (AMX's calls are faster than vdpbf16ps')."""
    from detaudit.backends.kernels import cpu_calls

    monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
    assert cpu_calls.threads_for(10, 3.9e6, 4e6, 16e6) == 1
    assert cpu_calls.threads_for(10, 4e6, 4e6, 16e6) == 1
    assert cpu_calls.threads_for(10, 24e6, 4e6, 16e6) == 2  # a decode q/k/v product of the embedded model
    assert cpu_calls.threads_for(10, 1e9, 4e6, 16e6) == 10  # at most one thread a piece
    assert cpu_calls.threads_for(100, 1e9, 4e6, 16e6) == 16  # and torch's thread count
    amx = cpu_calls.Kernel(None, 0, None, 0, True, cpu_bf16.PER_THREAD["amx"], cpu_bf16.TEAM_PER_THREAD["amx"])
    vdp = "avx512_bf16"
    vdpbf16ps = cpu_calls.Kernel(None, 0, None, 0, False, cpu_bf16.PER_THREAD[vdp], cpu_bf16.TEAM_PER_THREAD[vdp])
    monkeypatch.setattr(cpu_calls, "_team_wanted", lambda: False)  # the Python pool
    assert cpu_calls.kernel_threads(amx, 100, 40e6) == 3  # AMX: a thread per 16 MFLOP of calls
    assert cpu_calls.kernel_threads(vdpbf16ps, 100, 5e6) == 2  # vdpbf16ps: any table past the threshold splits
    monkeypatch.setattr(cpu_calls, "_team_wanted", lambda: True)  # the compiled team: a cheaper hand-off
    assert cpu_calls.kernel_threads(amx, 100, 20e6) == 10  # AMX: a thread per 2 MFLOP
    assert cpu_calls.kernel_threads(amx, 100, 40e6) == 16  # (a decode gate / up product: every thread)
    assert cpu_calls.kernel_threads(vdpbf16ps, 100, 5e6) == 2


def test_description_names_the_path(cpu_path):
    d = get_backend("bio+tbik").describe()
    assert d["cpu_gemm"] == cpu_path.describe()
    if cpu_path.path == "amx":
        assert d["cpu_gemm"].startswith("bf16 inputs, fp32 accumulation on AMX tiles: CPU flags amx_bf16")
    elif cpu_path.bf16:
        assert d["cpu_gemm"].startswith("bf16 inputs, fp32 accumulation: CPU flags avx512_bf16")
    if cpu_path.bf16:
        assert f"R={cpu_path.rows} rows" in d["matmul_cpu"] and f"R={fixed.ROWS} rows" in d["matmul_cpu"]
    else:
        assert d["cpu_gemm"] == "fp32 products: DETAUDIT_CPU_GEMM=fp32"
        assert d["matmul_cpu"].startswith(f"fp32 products on zero-padded blocks of R={fixed.ROWS} rows")


def test_runs_on_the_two_paths_are_not_merged():
    """Resume and merge compare the backends' descriptions: a run's cells made on the fp32 path and new
    ones on the bf16 path (another kind of CPU) are refused as different numerics."""
    try:
        cpu_bf16.choose("fp32")
        fp32 = {"bio@tp1": {"backend": get_backend("bio").describe()}}
        try:
            cpu_bf16.choose("bf16")
        except DetauditError as e:
            pytest.skip(str(e))
        bf16 = {"bio@tp1": {"backend": get_backend("bio").describe()}}
    finally:
        cpu_bf16.choose()
    conflicts = numerics_conflicts(fp32, bf16)
    assert conflicts and "cpu_gemm" in conflicts[0] and "matmul_cpu" in conflicts[0]
    assert numerics_conflicts(bf16, bf16) == []


def test_self_check_passes_and_bf16_products_match_fp32_to_rounding(cpu_path):
    """The kernel's products are the exact bf16 products summed in fp32 (in its own order)."""
    g = torch.Generator().manual_seed(3)
    a = torch.randn(19, 200, generator=g).bfloat16()
    w = torch.randn(130, 200, generator=g).bfloat16()
    got, want = fixed.matmul(a, w), a.double() @ w.double().t()
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    if cpu_path.bf16:
        assert cpu_bf16._self_check() is None


@pytest.mark.parametrize("rows, n", [(8, 512), (480, 1536)])  # one thread; split over the threads
def test_compiled_and_python_dispatch_give_the_same_bits(bf16_chosen, monkeypatch, rows, n):
    """The call loop compiled by numba (`cpu_loop`) and the Python loop make the same calls, so every
    product has the same bits; with 2 threads the 480-row product is split between them."""
    from helpers import require

    require("numba", "cpu")
    from detaudit.backends.kernels import cpu_calls

    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 576, generator=g).bfloat16()
    w = torch.randn(n, 576, generator=g).bfloat16()
    outs = {}
    torch.set_num_threads(2)
    for how in ("auto", "off"):
        monkeypatch.setenv(cpu_calls.ENV, how)
        assert cpu_calls.dispatcher().startswith("numba" if how == "auto" else "python loop")
        outs[how] = fixed.matmul(x, w)
    assert torch.equal(outs["auto"], outs["off"])
    assert torch.allclose(outs["auto"], x.float() @ w.float().t(), rtol=1e-4, atol=1e-3)


# (rows, K, N): a decode step's column parts, a prefill over 2 threads, an odd K and panels past N
@pytest.mark.parametrize("rows, k, n", [(8, 576, 2560), (480, 576, 1536), (19, 201, 130)])
def test_products_rounded_in_the_loop_are_torchs_cast_of_the_fp32_products(bf16_chosen, monkeypatch, rows, k, n):
    """out_dtype bf16: each call's product rounded to bf16 in the thread's scratch (`cpu_loop.loop`), and a
    TP-1 tree's sums as `leaf_sums` stores them, give `.to(torch.bfloat16)` of the fp32 output, bit for bit,
    on 1 and 2 threads; with nothing compiled, the fp32 output's cast."""
    from helpers import require

    require("numba", "cpu")
    from detaudit.backends.kernels import cpu_calls, tree

    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    k8 = k - k % 8
    want = fixed.matmul(x, w).to(torch.bfloat16)
    want_tree = tree.tree_matmul(x[:, :k8], w[:, :k8], 1).to(torch.bfloat16)
    for how, count in (("auto", 1), ("auto", 2), ("off", 2)):
        monkeypatch.setenv(cpu_calls.ENV, how)
        torch.set_num_threads(count)
        got = fixed.matmul(x, w, torch.bfloat16)
        got_tree = tree.tree_matmul(x[:, :k8], w[:, :k8], 1, out_dtype=torch.bfloat16)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16)), how
        assert torch.equal(got_tree.view(torch.int16), want_tree.view(torch.int16)), (how, count)


# (rows, K, N, TP): an o_proj prefill split over 2 threads, decode rows, an odd leaf (K / 8 = 13: each
# leaf's columns blocked on their own), 4 and 2 leaves a rank (TP 2 and 4), many column panels
@pytest.mark.parametrize(
    "rows, k, n, tp",
    [(480, 1536, 576, 1), (8, 576, 576, 1), (16, 104, 64, 1), (24, 96, 40, 2), (40, 64, 200, 4), (33, 104, 1088, 1)],
)
def test_leaf_sums_in_the_threads_cache_give_the_pairwise_trees_bits(bf16_chosen, monkeypatch, rows, k, n, tp):
    """The tree matmul with each output block's leaves summed by the compiled loop that computed them
    (`cpu_bf16.leaf_sums`) gives the fp32 bits of the leaf products summed by `tree.pairwise` (the Python
    loop's path, DETAUDIT_CPU_COMPILED=off), on 1 and 2 threads."""
    from helpers import require

    require("numba", "cpu")
    from detaudit.backends.kernels import cpu_calls, tree

    g = torch.Generator().manual_seed(rows + k)
    x = torch.randn(rows, k // tp, generator=g).bfloat16()
    w = torch.randn(n, k // tp, generator=g).bfloat16()
    outs = {}
    for how, count in (("auto", 1), ("auto", 2), ("off", 2)):
        monkeypatch.setenv(cpu_calls.ENV, how)
        torch.set_num_threads(count)
        outs[how, count] = tree.tree_matmul(x, w, tp)
    assert outs["auto", 1].dtype == torch.float32
    assert torch.equal(outs["auto", 1], outs["off", 2]) and torch.equal(outs["auto", 2], outs["off", 2])
    assert torch.allclose(outs["off", 2], x.float() @ w.float().t(), rtol=1e-4, atol=1e-3)


def test_leaf_sums_are_the_pairwise_sums_of_the_leaf_products_or_left_to_the_caller(bf16_chosen, monkeypatch):
    """Called directly: over many panels and blocks, `leaf_sums` is `tree.pairwise` of `products`, bit for
    bit; a product worth splitting with fewer output blocks than threads (one decode block, one panel) is
    left to the caller (None), whose leaf calls spread over the threads."""
    from helpers import require

    require("numba", "cpu")
    from detaudit.backends.kernels import cpu_calls, tree

    monkeypatch.setenv(cpu_calls.ENV, "auto")
    torch.set_num_threads(2)
    for rows, k, n, wanted in ((100, 1536, 2112, True), (8, 8192, 1024, False)):
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, k, generator=g).bfloat16()
        w = torch.randn(n, k, generator=g).bfloat16()
        xb = cpu_bf16.blocks_of(x)
        leaves = xb.view(xb.shape[0], xb.shape[1], 8, k // 8).permute(2, 0, 1, 3)
        packed = tree._packed_bf16(w, 8, k // 8)
        got = cpu_bf16.leaf_sums(leaves, packed)
        assert (got is not None) == wanted, (rows, k, n)
        if wanted:
            assert packed.shape[1] > 1 and xb.shape[0] > 2  # several panels and blocks
            assert torch.equal(got, tree.pairwise(cpu_bf16.products(leaves, packed)))


@pytest.mark.parametrize("dispatch", ["team", "pool"])
@pytest.mark.parametrize(
    "leaves, shape", [(2, (16, 576)), (4, (3, 5)), (8, (16, 576)), (8, (2, 16, 77)), (8, (32, 1, 576))]
)
def test_leaf_tree_is_the_pairwise_tree_bit_for_bit(monkeypatch, leaves, shape, dispatch):
    """The compiled tree over leaf products (`cpu_bf16.leaf_tree`: a decode step's leaves where
    `leaf_sums` leaves them to the caller) adds what `tree.pairwise`'s torch ops add, in the same pairs:
    the same fp32 bits, on magnitudes where another order would round differently, and rounded to bf16
    as it stores them, torch's cast of them; many elements spread over threads (the team's PAIRWISE jobs,
    or the Python pool's slices where the team is off). Any CPU with numba."""
    from helpers import require

    require("numba", "cpu")
    from detaudit.backends.kernels import cpu_calls, tree

    monkeypatch.setenv(cpu_calls.ENV, "auto")
    monkeypatch.setenv(cpu_calls.TEAM_ENV, "auto" if dispatch == "team" else "off")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)  # (the threads' rule reads it)
    g = torch.Generator().manual_seed(leaves)
    x = torch.randn(leaves, *shape, generator=g) * torch.logspace(-6, 6, leaves).view(-1, *[1] * len(shape))
    team = cpu_calls.team()
    jobs = team.job if team else 0
    got = cpu_bf16.leaf_tree(x)
    assert got is not None and got.shape == shape
    assert torch.equal(got, tree.pairwise(x))
    rounded = cpu_bf16.leaf_tree(x, torch.bfloat16)
    assert rounded.dtype == torch.bfloat16 and torch.equal(rounded, got.bfloat16())
    spread = cpu_calls.row_threads("pairwise", -(-got.numel() // 2048), x.numel()) > 1
    assert spread or x.numel() < 100_000  # a batch-32 decode step's 8 leaves spread on every dispatch
    if team:  # both went to the team's workers where they were many (batch 16 and 32 decode steps)
        assert spread == (x.numel() > 50_000) and team.job == jobs + 2 * spread, (x.numel(), team.job, jobs)
    if leaves >= 4 and got.numel() > 1000:  # in leaf order the sum rounds otherwise: the pairs are tested
        in_order = x[0]
        for leaf in x[1:]:
            in_order = in_order + leaf
        assert not torch.equal(got, in_order)
    monkeypatch.setenv(cpu_calls.ENV, "off")
    assert cpu_bf16.leaf_tree(x) is None  # nothing compiled: the caller's torch adds


def test_products_and_leaf_sums_refuse_rows_the_calls_cannot_take(bf16_chosen):
    r, bf16 = cpu_bf16.choice().rows, torch.bfloat16
    packed = torch.zeros(2, 1, 32, 64, 2, dtype=bf16)  # K2 = 64
    wrong_rows, fp32_rows, wrong_k = (
        torch.zeros(2, 1, r + 1, 64, dtype=bf16),
        torch.zeros(2, 1, r, 64),
        torch.zeros(2, 1, r, 66, dtype=bf16),
    )
    for a in (wrong_rows, fp32_rows, wrong_k):
        for fn, what in ((cpu_bf16.products, "products"), (cpu_bf16.leaf_sums, "leaf sums")):
            with pytest.raises(ValueError, match=f"bf16 {what} need bf16"):
                fn(a, packed)


def test_leaf_sums_refuse_a_leaf_count_that_is_no_tree(bf16_chosen):
    a = torch.zeros(3, 1, cpu_bf16.choice().rows, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="power-of-two"):
        cpu_bf16.leaf_sums(a, torch.zeros(3, 1, 32, 64, 2, dtype=torch.bfloat16))


@pytest.mark.slow  # a Python process of its own
def test_describing_the_backends_imports_no_numba():
    """Descriptions are made before any kernel runs, in vLLM's engine process too, where an early
    llvmlite import breaks vLLM's CPU worker start-up (it scans every module's attributes): the path is
    decided from the installed packages, and numba is imported at the first compiled call."""
    import subprocess
    import sys

    code = (
        "import sys; from detaudit.backends import get_backend; "
        "d = get_backend('bio+tbik').describe(); "
        "print(d['cpu_kernels'][:8], 'numba' in sys.modules, 'llvmlite' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[-2:] == ["False", "False"], out


def test_self_check_refuses_a_kernel_whose_rows_interact(monkeypatch):
    """A stand-in for a kernel that mixes a block's rows (none of the real ones does, so a mock: the
    real matmul plus 2^-20 of the block's first row, within the fp32 comparison's tolerance)."""
    try:
        cpu_bf16.choose("bf16")
    except DetauditError as e:
        pytest.skip(str(e))
    try:
        real = cpu_bf16.matmul
        assert cpu_bf16._self_check() is None

        def mixing(x, packed, n):
            out = real(x, packed, n)
            return out + out[:1] * 2.0**-20

        monkeypatch.setattr(cpu_bf16, "matmul", mixing)
        assert "a row's bits depend on the other rows" in cpu_bf16._self_check()
    finally:
        monkeypatch.undo()
        cpu_bf16.choose()


def test_column_parts_only_where_the_self_check_found_the_whole_panels_bits(monkeypatch):
    """The self-check makes one block in 64-column parts and keeps the parts only where its bits are the
    whole panel's: on this machine's kernel they are, and a decode product of six 256-column panels with
    more threads' worth of flops makes narrower calls; with a stand-in whose parts differ (a mock: the
    part calls read their weight one column early) it makes whole panels again."""
    from detaudit.backends.kernels import cpu_calls

    try:
        cpu_bf16.choose("bf16")
    except DetauditError as e:
        pytest.skip(str(e))
    try:
        real, run = cpu_bf16._calls, cpu_calls.run
        shapes = []
        monkeypatch.setattr(cpu_calls, "run", lambda kernel, shape, *a: shapes.append(shape) or run(kernel, shape, *a))
        monkeypatch.setattr(cpu_calls, "_team_wanted", lambda: True)  # a thread per 4 MFLOP
        monkeypatch.setattr(torch, "get_num_threads", lambda: 16)
        x, w = torch.ones(8, 1536, dtype=torch.bfloat16), torch.ones(1536, 1536, dtype=torch.bfloat16)
        operands = cpu_bf16.blocks_of(x)[None], cpu_bf16.pack(w)[None]
        assert operands[1].shape[1:4] == (6, 768, 256)
        flops = 2.0 * cpu_bf16.choice().rows * 1536 * 1536
        parts = cpu_bf16.sub_width(6, 256, cpu_calls.kernel_threads(cpu_bf16._kernel, 24, flops))
        assert parts < 256  # this path's threads for it: more than its six panels
        for drift, cols in ((False, parts), (True, 256)):
            if drift:
                monkeypatch.setattr(cpu_bf16, "_calls", lambda a, packed, c: _drifting(real, a, packed, c))
            assert cpu_bf16._self_check() is None and cpu_bf16._parts_checked is not drift
            shapes.clear()
            cpu_bf16.products(*operands)
            assert [s[1] for s in shapes] == [cols] and shapes[0][4] == 256  # ldb: the panel's W
    finally:
        monkeypatch.undo()
        cpu_bf16.choose()


def _drifting(real, a, packed, cols):
    """`_calls`, but where calls make parts, every call after the first reads its weight one column early
    (within the panel): a stand-in for a kernel whose parts give other bits."""
    out, shape, table, flops, threads = real(a, packed, cols)
    if cols == cpu_bf16.PANEL_UNIT:
        table = table.copy()
        table[1:, 1] -= 4  # one column of VNNI pairs (2 bf16)
    return out, shape, table, flops, threads


@pytest.mark.parametrize("release", [True, False])
def test_each_thread_releases_the_kernel_after_its_calls_where_the_path_says(monkeypatch, release):
    """On AMX every thread that made calls releases its tiles once, after its slice (`Kernel.release`);
    elsewhere none does. Counted through the Python loop (the release function swapped for a counter;
    the compiled loop calls the same symbol, bound in `cpu_loop`), on 2 threads."""
    import dataclasses
    import threading

    from detaudit.backends.kernels import cpu_calls

    try:
        cpu_bf16.choose("bf16")
    except DetauditError as e:
        pytest.skip(str(e))
    threads = torch.get_num_threads()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(480, 576, generator=g).bfloat16()
    w = torch.randn(1536, 576, generator=g).bfloat16()
    try:
        want = fixed.matmul(x, w)
        seen: list[int] = []
        fake = dataclasses.replace(
            cpu_bf16._kernel, release_fn=lambda _: seen.append(threading.get_ident()), release=release
        )
        monkeypatch.setattr(cpu_bf16, "_kernel", fake)
        monkeypatch.setenv(cpu_calls.ENV, "off")
        torch.set_num_threads(2)
        assert torch.equal(fixed.matmul(x, w), want)
    finally:
        torch.set_num_threads(threads)
        monkeypatch.undo()
        cpu_bf16.choose()
    assert len(seen) == (2 if release else 0) and len(set(seen)) == len(seen)


def test_micro_kernel_products_and_compiled_attention_leave_torchs_thread_count_alone(bf16_chosen, monkeypatch):
    """A split bf16 product (the micro-kernel over 2 threads) and the compiled attention run no torch op in
    their jobs, so they never set torch's thread count (`cpu_gemm.run_jobs(torch_ops=False)`): ATen's
    set_num_threads resizes torch's thread pool and clears oneDNN's cache, twice per call where they did.
    The fp32 path's jobs run torch's bmm and still hold one intra-op thread (test_bio's thread-count test)."""
    from helpers import require

    require("numba", "cpu")
    from detaudit.backends.kernels import cpu_calls, cpu_gemm

    cpu_gemm._workers(1).submit(int).result()  # the pool's worker set to one thread once, when it starts
    calls = []
    monkeypatch.setattr(cpu_gemm, "_set_num_threads", calls.append)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(480, 576, generator=g).bfloat16()
    w = torch.randn(1536, 576, generator=g).bfloat16()
    q = torch.randn(2, 6, 70, 16, generator=g).bfloat16()
    k, v = (torch.randn(2, 2, 70, 16, generator=g).bfloat16() for _ in range(2))
    torch.set_num_threads(2)
    with get_backend("bio").activate():
        fixed.matmul(x, w)
        get_backend("bio").attention(q, k, v, torch.arange(70).expand(2, 70), 0.25)
    assert cpu_calls.compiled("cpu_attention") is not None
    assert calls == [], calls


def test_starting_the_pool_leaves_every_threads_count_as_it_was(monkeypatch):
    """The workers' initializer sets torch's intra-op count to 1, process-wide: a pool started by jobs that
    leave the count alone (compiled code) must still hand the caller, and threads that start after, the
    count they had (it left the whole process on 1 thread: every later torch op ran single-threaded)."""
    import threading

    from detaudit.backends.kernels import cpu_gemm

    monkeypatch.setattr(cpu_gemm, "_pool", None)
    monkeypatch.setattr(cpu_gemm, "_pool_size", 0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        cpu_gemm.run_jobs([0, 1, 2], lambda job: None, torch_ops=False)
        seen = []
        later = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        later.start()
        later.join()
        assert (torch.get_num_threads(), seen) == (2, [2])
    finally:
        torch.set_num_threads(threads)
