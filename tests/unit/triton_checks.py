"""Checks of the Triton kernels, run by test_triton_interpret.py in a subprocess with
TRITON_INTERPRET=1 (the variable must be set before triton is imported). Small shapes: the interpreter
is slow. Exits non-zero with a message on the first failed check."""

from __future__ import annotations

import sys

import torch

from detaudit.backends import get_backend
from detaudit.backends.kernels import tree, triton_attn, triton_mm, triton_rows


def check(cond: bool, what: str) -> None:
    if not cond:
        sys.exit(f"FAILED: {what}")


def main() -> None:
    g = torch.Generator().manual_seed(0)
    for dt in (torch.float32, torch.bfloat16):
        for k, n in ((64, 20), (48, 33), (40, 16)):
            x = torch.randn(40, k, generator=g).to(dt)
            w = torch.randn(n, k, generator=g).to(dt)
            full = triton_mm.mm(x, w)
            if dt != torch.float32:  # the bf16 epilogue rounds like a cast of the fp32 result
                check(torch.equal(triton_mm.mm(x, w, out_dtype=dt), full.to(dt)), f"rounded store {dt} {k}x{n}")
            ref = x.double() @ w.double().t()
            check(((full.double() - ref).abs().max() < 1e-4 * ref.abs().max()).item(), f"accuracy {dt} {k}x{n}")
            for m in range(1, 41):
                check(torch.equal(triton_mm.mm(x[:m], w), full[:m]), f"mm prefix {dt} {k}x{n} m={m}")
            # (no row-position check here: the interpreter's tl.dot is numpy's BLAS, whose bits for a row
            # can depend on its slot in the block; tests/gpu checks row positions on the real kernel)
            # the tree kernel: rank r of C owns K/C columns; subtrees combined along the top of the tree
            if k % 8 == 0:
                one = triton_mm.mm(x, w, leaves=8)
                check(((one.double() - ref).abs().max() < 1e-4 * ref.abs().max()).item(), f"tree accuracy {dt} {k}x{n}")
                for c in (2, 4, 8):
                    kc = k // c
                    parts = [triton_mm.mm(x[:, r * kc : (r + 1) * kc].contiguous(), w[:, r * kc : (r + 1) * kc], leaves=8 // c)
                             for r in range(c)]
                    check(torch.equal(tree.tree_sum(parts), one), f"tree TP invariance {dt} {k}x{n} C={c}")
                check(torch.equal(triton_mm.mm(x[:3], w, leaves=8), one[:3]), f"tree batch invariance {dt}")
        # batched (attention-shaped) products: invariant in the batch count
        a = torch.randn(6, 5, 16, generator=g).to(dt)
        b = torch.randn(6, 16, 16, generator=g).to(dt)
        full = triton_mm.mm(a, b)
        check(torch.equal(triton_mm.mm(a[2:3], b[2:3]), full[2:3]), f"batched mm {dt}")
        check(torch.equal(triton_mm.mm(a, b.transpose(1, 2).contiguous().transpose(1, 2)), full), f"strided operand {dt}")
    # the attention kernel: the same function as the PyTorch formulation (its bits are its own: on a GPU
    # tests/gpu checks prefill == decode and batch invariance; here numpy's BLAS stands in for tl.dot)
    for dt in (torch.float32, torch.bfloat16):
        q = torch.randn(3, 20, 16, generator=g).to(dt)
        k = torch.randn(3, 70, 16, generator=g).to(dt)
        v = torch.randn(3, 70, 16, generator=g).to(dt)
        pos = torch.randint(0, 70, (3, 20), generator=g)
        out = triton_attn.attention(q, k, v, pos, 0.25, 64)
        ref = get_backend("bf16").attention(q.float()[:, None], k.float()[:, None], v.float()[:, None],
                                            pos, 0.25)[:, 0]
        tol = 1e-5 if dt == torch.float32 else 3e-2
        check(torch.allclose(out.float(), ref, atol=tol, rtol=tol), f"attention kernel accuracy {dt}")
    # row sums: one program per row
    x = torch.randn(9, 2500, generator=g)
    sums = triton_rows.row_sum(x)
    check(torch.allclose(sums.double(), x.double().sum(1), atol=1e-3), "row sum accuracy")
    check(all(torch.equal(triton_rows.row_sum(x[:m]), sums[:m]) for m in (1, 4)), "row sum batch invariance")
    gluon_fallback()
    print("ok")


def gluon_fallback() -> None:
    """Where the Gluon tree kernel fails to build (its API is experimental), mm warns once and runs the
    Triton tree kernel: the same bits. (The Gluon kernel itself cannot run here: no Hopper GPU; its
    eligibility and build failure are simulated.)"""
    import warnings

    from detaudit.backends.kernels import gluon_tree

    def broken(*args, **kwargs):
        raise RuntimeError("simulated build failure")

    g = torch.Generator().manual_seed(5)
    x = torch.randn(24, 64, generator=g).bfloat16()
    w = torch.randn(20, 64, generator=g).bfloat16()
    want = triton_mm.mm(x, w, leaves=8)
    saved = gluon_tree.supports, gluon_tree.tree_mm
    gluon_tree.supports, gluon_tree.tree_mm = (lambda *a, **k: True), broken
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = triton_mm.mm(x, w, leaves=8, config=dict(triton_mm.INTERPRET_CONFIG, GLUON=1))
            again = triton_mm.mm(x, w, leaves=8, config=dict(triton_mm.INTERPRET_CONFIG, GLUON=1))
    finally:
        gluon_tree.supports, gluon_tree.tree_mm = saved
    check(torch.equal(got, want) and torch.equal(again, want), "Gluon fallback gives the Triton bits")
    check(len([c for c in caught if "Gluon tree kernel did not build" in str(c.message)]) == 1,
          "one warning for a failed Gluon build")
    check(bool(gluon_tree._disabled) and not gluon_tree.available(x), "a failed build turns the kernel off")


if __name__ == "__main__":
    main()
