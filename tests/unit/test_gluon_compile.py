"""The Gluon tree kernel compiled for Hopper (sm_90a) on a machine without a GPU: Triton's compiler and
the ptxas it bundles run on CPU; only the driver that asks the GPU for its target is replaced (a mock,
because there is no GPU here). Checks that the kernel builds against the installed Triton's Gluon API
for every leaf count and both weight layouts, without register spills (the tree holds up to three
fp32 tiles of 64 registers per thread; a spill costs it half its speed, reports/gpu/kernels/README.md)
and within Hopper's 227 KB of shared memory. Its bits and speed are checked on a GPU (tests/gpu)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import require

triton = require("triton", "triton")
from detaudit.backends.kernels import gluon_tree  # noqa: E402

pytestmark = [
    pytest.mark.slow,  # Triton's compiler runs ptxas processes
    pytest.mark.skipif(gluon_tree.gluon is None, reason="this Triton has no Gluon"),
    # with a GPU the real driver stays in place; tests/gpu runs the kernel itself
    pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: tests/gpu covers the kernel"),
]


class _HopperTarget:
    """Stands in for the CUDA driver: reports an sm_90 target and device 0."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")


@pytest.fixture(scope="module")
def hopper(tmp_path_factory):
    from triton.runtime import driver

    previous = driver._active  # without a GPU there is no default driver to reset to
    driver.set_active(_HopperTarget())
    try:
        yield tmp_path_factory.mktemp("cubin")
    finally:
        driver._active = previous


def _cuobjdump() -> str | None:
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else shutil.which("cuobjdump")


@pytest.mark.parametrize(
    "leaves,transposed,out_dtype,routed",
    [
        (8, False, torch.float32, False),
        (4, False, torch.float32, False),
        (2, False, torch.float32, False),
        (1, False, torch.float32, False),
        (8, True, torch.float32, False),
        (8, False, torch.bfloat16, False),  # a TP-1 layer's tree, rounded in the store
        (2, False, torch.float32, True),  # TP 4's subtree, stored into the all-reduce owners' areas
        (4, False, torch.float32, True),
        (1, False, torch.float32, True),
    ],
)
def test_gluon_tree_compiles_for_hopper_without_spills(hopper, leaves, transposed, out_dtype, routed):
    x = torch.empty(4096, 4096, dtype=torch.bfloat16)
    w = torch.empty(4096, 4096, dtype=torch.bfloat16)
    if transposed:
        w = w.t().contiguous().t()
    if routed:
        areas = [torch.empty(4096, 4096) for _ in range(4)]
        route = torch.zeros(32, dtype=torch.int32)
        kernel = gluon_tree.tree_mm_routed(x, w, leaves, areas, route, 1024, 1, warmup=True, num_programs=132)
    else:
        kernel = gluon_tree.tree_mm(x, w, leaves, num_programs=132, warmup=True, out_dtype=out_dtype)
    assert kernel.metadata.shared <= 227 * 1024
    assert "wgmma.mma_async" in kernel.asm["ptx"]
    tool = _cuobjdump()
    if tool is None:
        pytest.skip("no cuobjdump to read the cubin's resource usage")
    cubin = hopper / f"tree{leaves}{transposed}{out_dtype}{routed}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    usage = subprocess.run(
        [tool, "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
    ).stdout
    stack = [int(v) for v in re.findall(r"STACK:(\d+)", usage)]
    local = [int(v) for v in re.findall(r"LOCAL:(\d+)", usage)]
    assert stack and max(stack) == 0 and max(local) == 0, usage
