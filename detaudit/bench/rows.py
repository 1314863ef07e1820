"""`detaudit bench rows`: the GPU backends' per-token kernels (`kernels/fused.py`) at one prefill's shapes,
per launch layout, against a device copy of the same bytes.

Workloads, as the engines call them on `tokens` rows of a model with `hidden` columns, `heads` query / KV
heads of `head_dim` and an MLP of `intermediate`:
- `add_norm`: the residual add + RMSNorm of the hidden rows (every layer twice);
- `q_norm` / `k_norm`: Qwen3's RMSNorm of each q / k head, where vLLM leaves them (heads of a column
  slice of one q/k/v product);
- `rotary_q` / `rotary_k`: the vLLM plugin's rotary of q / k alone (`fused.rope_rows`);
- `silu_mul`: silu(gate) * up of the merged gate/up product's halves.

Layouts: the head norms read in place or (`copied`) from a contiguous copy, as before the kernel took
strides; heads a program for the rotary (`default`: as many as fill `fused.ROPE_LANES`). Every layout
of one workload must give the first's bits (`bits_as_default`: no layout is a bit, by construction;
this checks it on the device). `bytes_moved`: what the kernel must read and write at least; `vs_copy`:
the time of a device-to-device copy of that many bytes over the kernel's, in the same call (1.0: the
kernel runs at copy bandwidth). Times: median seconds per graph-replayed call (`bench.kernels._times`).
"""

from __future__ import annotations

import pandas as pd
import torch

from detaudit.backends.kernels import fused
from detaudit.bench.kernels import _times

ROPE_HEADS = (1, 4, 16)  # heads a program compared for the rotary
# the table's rows, in `_workloads`' order: add_norm; q / k norms in place and copied; q / k rotary at the
# default and each ROPE_HEADS; silu_mul
ROWS = 1 + 2 * 2 + 2 * (1 + len(ROPE_HEADS)) + 1


def _workloads(tokens: int, hidden: int, hq: int, hkv: int, d: int, inter: int, dtype, device: str) -> list:
    """(workload, layout, fn, bytes moved) for every row of the table, the default layout first per workload."""
    g = torch.Generator(device=device).manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, device=device, generator=g).to(dtype)

    x, delta, w = rand(tokens, hidden), rand(tokens, hidden), 1 + 0.1 * rand(hidden)
    qkv = rand(tokens, (hq + 2 * hkv) * d)
    q, k, _ = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    hw = 1 + 0.1 * rand(d)
    pos = torch.arange(tokens, device=device)
    angles = pos[:, None].float() * torch.linspace(0, 1, d, device=device)[None]
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    gate_up = rand(tokens, 2 * inter)
    size = x.element_size()
    rows = []
    rows.append(("add_norm", "1 row", lambda: fused.rms_norm(x, w, 1e-6, delta)[0], 4 * tokens * hidden * size))
    for name, t, h in (("q_norm", q, hq), ("k_norm", k, hkv)):
        heads = t.view(tokens, h, d)
        moved = 2 * tokens * h * d * size
        rows.append((name, "in place", lambda v=heads: fused.rms_norm(v, hw, 1e-6)[0], moved))
        rows.append((name, "copied", lambda v=heads: fused.rms_norm(v.contiguous(), hw, 1e-6)[0], moved))
    for name, t, h in (("rotary_q", q, hq), ("rotary_k", k, hkv)):
        moved = 2 * tokens * h * d * size
        rows.append((name, "default", lambda t=t: fused.rope_rows(t, cos, sin, d), moved))
        for n in ROPE_HEADS:
            rows.append((name, f"{n} heads", lambda t=t, n=n: fused.rope_rows(t, cos, sin, d, heads=n), moved))
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    rows.append(("silu_mul", "default", lambda: fused.silu_mul(gate, up), 3 * tokens * inter * size))
    return rows


def bench_rows(
    tokens: int,
    hidden: int,
    heads: tuple[int, int],
    head_dim: int,
    intermediate: int,
    dtype: torch.dtype,
    device: str = "cuda",
    progress=None,
) -> pd.DataFrame:
    hq, hkv = heads
    work = _workloads(tokens, hidden, hq, hkv, head_dim, intermediate, dtype, device)
    out, defaults = [], {}
    for name, layout, fn, moved in work:
        got = fn()
        want = defaults.setdefault(name, got)
        src = torch.empty(moved // 2, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)
        kernel_s, copy_s = _times([lambda _i: fn(), lambda _i: dst.copy_(src)], torch.device(device))
        out.append(
            {
                "workload": name,
                "layout": layout,
                "ms": kernel_s * 1e3,
                "bytes_moved": moved,
                "gb_per_s": moved / kernel_s / 1e9,
                "vs_copy": copy_s / kernel_s,
                "bits_as_default": bool(torch.equal(got, want)),
            }
        )
        if progress is not None:
            progress(f"{name} {layout}")
    return pd.DataFrame(out)
