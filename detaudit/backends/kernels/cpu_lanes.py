"""The compiled attention's two inner loops as 16-lane fp32 vector code (numba intrinsics that emit LLVM
vector IR; imported only where numba is installed).

LLVM does not vectorize `cpu_attention._dot`'s 16 scalar accumulators by itself (numba's code for it is
scalar: ~40 ns a 64-long dot), so the lanes are written here as one `<16 x float>`: lane l adds
q[i] * k[i] for i = l, l + 16, ... in order, then the lanes are added pairwise (0+8, 0+4, 0+2, 0+1), the
additions `_dot` makes, so the same bits. Every operation is an IEEE fp32 `fmul` or `fadd` without
fast-math flags, so LLVM neither contracts them into FMAs nor reorders them: a 16-lane vector is one
AVX-512 register or two AVX2 ones, with the same bits either way.

Operands are addresses (int64) of rows whose D elements are contiguous: fp32, or bf16 stored as int16
bits (a bf16 is the top half of an fp32: widened exactly). `blocks` is D / 16; a D that 16 does not
divide takes `cpu_attention`'s scalar path."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from detaudit.backends.kernels import numba_cache

numba_cache.fresh()  # before any cache is loaded: a caller's cache holds its callees' code

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_VEC = ir.VectorType(_F32, LANES)


def _lanes(builder, addr, element: int, bf16: bool):
    """The 16 fp32 lanes at element `element` of the row at address `addr` (int64)."""
    if not bf16:
        at = builder.gep(builder.inttoptr(addr, _F32.as_pointer()), [element])
        return builder.load(builder.bitcast(at, _VEC.as_pointer()), align=4)
    halves = ir.VectorType(ir.IntType(16), LANES)
    at = builder.gep(builder.inttoptr(addr, ir.IntType(16).as_pointer()), [element])
    wide = builder.zext(builder.load(builder.bitcast(at, halves.as_pointer()), align=2), ir.VectorType(_I32, LANES))
    return builder.bitcast(builder.shl(wide, ir.Constant(ir.VectorType(_I32, LANES), [16] * LANES)), _VEC)


def _fold(builder, x, y, keys: int, width: int):
    """One level of the lanes' pairwise tree for `keys` keys of `width` lanes held one after the other in
    x then y (y's lanes numbered after x's; y = x where x holds them all): lane i + lane i + width / 2 of
    each key, the keys' halves side by side in one vector of keys * width / 2 lanes."""
    half = width // 2
    starts = [key * width for key in range(keys)]
    low = ir.Constant(ir.VectorType(_I32, keys * half), [s + i for s in starts for i in range(half)])
    high = ir.Constant(ir.VectorType(_I32, keys * half), [s + half + i for s in starts for i in range(half)])
    return builder.fadd(builder.shuffle_vector(x, y, low), builder.shuffle_vector(x, y, high))


def _accumulate(builder, q_at, rows, count, bf16: bool):
    """Each row's 16 lane sums with q: lane l adds q[i] * row[i] for i = l, l + 16, ... in order, from
    +0 (`count` blocks of 16; q fp32, the rows bf16 bits where `bf16`), q's lanes loaded once a block."""
    accs = [cgutils.alloca_once_value(builder, ir.Constant(_VEC, None)) for _ in rows]  # zeros
    with cgutils.for_range(builder, count) as loop:
        element = builder.mul(loop.index, ir.Constant(loop.index.type, LANES))
        qv = _lanes(builder, q_at, element, False)
        for acc, row in zip(accs, rows):
            builder.store(builder.fadd(builder.load(acc), builder.fmul(qv, _lanes(builder, row, element, bf16))), acc)
    return [builder.load(acc) for acc in accs]


def _dot(bf16: bool):
    """An intrinsic: `cpu_attention._dot` of the fp32 row at address q and the row at address k (bf16
    bits where `bf16`), both `blocks` * 16 long."""

    @intrinsic
    def dot(typingctx, q, k, blocks):
        def codegen(context, builder, signature, args):
            q_at, k_at, count = args
            (lanes,) = _accumulate(builder, q_at, [k_at], count, bf16)
            for width in (16, 8, 4, 2):
                lanes = _fold(builder, lanes, lanes, 1, width)
            return builder.extract_element(lanes, ir.Constant(_I32, 0))

        return types.float32(types.int64, types.int64, types.int64), codegen

    return dot


def _dots4(bf16: bool):
    """An intrinsic: `cpu_attention._dot` of the fp32 row at address q with the four rows at addresses
    k, k + k_step, k + 2 k_step, k + 3 k_step (bf16 bits where `bf16`), all `blocks` * 16 long, written
    to the four fp32 at address `dest`. The four keys' trees share their shuffles (`_fold`); every lane's
    addition is the one `_dot` makes."""

    @intrinsic
    def dots4(typingctx, q, k, k_step, blocks, dest):
        def codegen(context, builder, signature, args):
            q_at, k_at, step, count, dest_at = args
            rows = [builder.add(k_at, builder.mul(step, ir.Constant(step.type, r))) for r in range(4)]
            a, b, c, d = _accumulate(builder, q_at, rows, count, bf16)
            four = _fold(builder, _fold(builder, a, b, 2, 16), _fold(builder, c, d, 2, 16), 4, 8)
            two = _fold(builder, four, four, 4, 4)
            one = _fold(builder, two, two, 4, 2)
            at = builder.bitcast(builder.inttoptr(dest_at, _F32.as_pointer()), ir.VectorType(_F32, 4).as_pointer())
            builder.store(one, at, align=4)
            return context.get_dummy_value()

        return types.void(*([types.int64] * 5)), codegen

    return dots4


GROUP = 4  # blocks of lanes a weighted sum carries at once: four independent addition chains per key


def _weighted(bf16: bool):
    """An intrinsic: out[:] += e[j] * v[j, :] for j = lo .. hi in order, each element accumulated in its
    lane: out fp32 at address `out`, e fp32 at address `e`, row j of v at address v + j * v_step bytes
    (bf16 bits where `bf16`), every row `blocks` * 16 long. Up to GROUP blocks of lanes go through the keys
    together (their chains are independent, so the core overlaps them); an element's additions are the
    same whichever blocks share its pass."""

    @intrinsic
    def weighted(typingctx, out, e, v, v_step, lo, hi, blocks):
        def codegen(context, builder, signature, args):
            out_at, e_at, v_at, step, lo_, hi_, count = args
            i64 = lo_.type
            weights = builder.inttoptr(e_at, _F32.as_pointer())
            outs = builder.inttoptr(out_at, _F32.as_pointer())
            zeros = ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES)
            accs = [cgutils.alloca_once(builder, _VEC) for _ in range(GROUP)]

            def passes(first, width: int):
                """Blocks first .. first + width - 1 over every key."""
                elements = [
                    builder.mul(builder.add(first, ir.Constant(i64, b)), ir.Constant(i64, LANES)) for b in range(width)
                ]
                for acc, element in zip(accs, elements):
                    builder.store(_lanes(builder, out_at, element, False), acc)
                with cgutils.for_range(builder, builder.add(hi_, ir.Constant(i64, 1)), start=lo_) as key:
                    weight = builder.load(builder.gep(weights, [key.index]))
                    splat = builder.shuffle_vector(
                        builder.insert_element(ir.Constant(_VEC, ir.Undefined), weight, ir.Constant(_I32, 0)),
                        ir.Constant(_VEC, ir.Undefined),
                        zeros,
                    )
                    row = builder.add(v_at, builder.mul(key.index, step))
                    for acc, element in zip(accs, elements):
                        product = builder.fmul(splat, _lanes(builder, row, element, bf16))
                        builder.store(builder.fadd(builder.load(acc), product), acc)
                for acc, element in zip(accs, elements):
                    at = builder.bitcast(builder.gep(outs, [element]), _VEC.as_pointer())
                    builder.store(builder.load(acc), at, align=4)

            whole = builder.udiv(count, ir.Constant(i64, GROUP))
            with cgutils.for_range(builder, whole) as group:
                passes(builder.mul(group.index, ir.Constant(i64, GROUP)), GROUP)
            with cgutils.for_range(builder, count, start=builder.mul(whole, ir.Constant(i64, GROUP))) as block:
                passes(block.index, 1)
            return context.get_dummy_value()

        return types.void(*([types.int64] * 7)), codegen

    return weighted


dot_f32, dot_bf16 = _dot(False), _dot(True)
dots4_f32, dots4_bf16 = _dots4(False), _dots4(True)
weighted_f32, weighted_bf16 = _weighted(False), _weighted(True)
