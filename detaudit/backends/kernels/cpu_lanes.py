"""The compiled attention's two inner loops as 16-lane fp32 vector code (numba intrinsics that emit LLVM
vector IR; imported only where numba is installed).

The lanes are one `<16 x float>`: lane l takes q[i] * k[i] + lane for i = l, l + 16, ... in order, each a
fused multiply-add (`llvm.fma`: the exact product and sum, rounded once), then the lanes are added
pairwise (0+8, 0+4, 0+2, 0+1): `cpu_attention._fused_dot`'s operations, so its bits. A weighted sum's
element takes e[j] * v[j] + element the same way, key after key. `llvm.fma` is IEEE fusedMultiplyAdd on
every target (one instruction where the CPU has FMA3, a correctly rounded library call where not), and
the adds carry no fast-math flags, so LLVM never reorders them: a 16-lane vector is one AVX-512 register
or two AVX2 ones, with the same bits either way. Fused rather than a product rounded then added: on
Intel cores a product and an add are two micro-ops on the same two vector ports, where an FMA is one.

Operands are addresses (int64) of rows whose D elements are contiguous: fp32, or bf16 stored as int16
bits (a bf16 is the top half of an fp32: widened exactly). `blocks` is D / 16; a D that 16 does not
divide takes `cpu_attention`'s scalar path."""

from __future__ import annotations

from llvmlite import binding, ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from detaudit.backends.kernels import numba_cache

numba_cache.fresh()  # before any cache is loaded: a caller's cache holds its callees' code

LANES = 16
_F32 = ir.FloatType()
_I32 = ir.IntType(32)
_VEC = ir.VectorType(_F32, LANES)
ROWS = 4  # query rows (a run of `cpu_attention`) whose scores and weighted sums share their reads of a key


def _avx512() -> bool:
    """Whether numba compiles for AVX-512 here (its `NUMBA_CPU_FEATURES`, else the host's; False where LLVM
    cannot read the host's: a row at a time is right on any CPU)."""
    from numba.core import config

    try:
        features = config.CPU_FEATURES if config.CPU_FEATURES is not None else binding.get_host_cpu_features().flatten()
    except RuntimeError:
        return False
    return "+avx512f" in features.split(",")


# query rows whose scores take one call per four keys: all of a run's where AVX-512's 32 vector registers
# hold their 16 accumulators; one where AVX2's 16 do not (spilled, sharing the keys' reads was slower)
SCORE_ROWS = ROWS if _avx512() else 1


def _lanes(builder, addr, element: int, bf16: bool):
    """The 16 fp32 lanes at element `element` of the row at address `addr` (int64)."""
    if not bf16:
        at = builder.gep(builder.inttoptr(addr, _F32.as_pointer()), [element])
        return builder.load(builder.bitcast(at, _VEC.as_pointer()), align=4)
    halves = ir.VectorType(ir.IntType(16), LANES)
    at = builder.gep(builder.inttoptr(addr, ir.IntType(16).as_pointer()), [element])
    wide = builder.zext(builder.load(builder.bitcast(at, halves.as_pointer()), align=2), ir.VectorType(_I32, LANES))
    return builder.bitcast(builder.shl(wide, ir.Constant(ir.VectorType(_I32, LANES), [16] * LANES)), _VEC)


def _nth(builder, at, step, i: int):
    """The address of row i of rows `step` bytes apart from address `at` (int64s)."""
    return builder.add(at, builder.mul(step, ir.Constant(step.type, i)))


def _fma(builder, a, b, c):
    """a * b + c rounded once (`llvm.fma` on fp32 or a vector of them)."""
    lanes = a.type.count if isinstance(a.type, ir.VectorType) else 0
    name = f"llvm.fma.v{lanes}f32" if lanes else "llvm.fma.f32"
    fn = builder.module.globals.get(name) or ir.Function(builder.module, ir.FunctionType(a.type, [a.type] * 3), name)
    return builder.call(fn, [a, b, c])


@intrinsic
def fma(typingctx, a, b, c):
    """a * b + c for fp32 scalars, rounded once: the lanes' operation, for `cpu_attention`'s scalar path."""

    def codegen(context, builder, signature, args):
        return _fma(builder, *args)

    return types.float32(types.float32, types.float32, types.float32), codegen


def _fold(builder, x, y, keys: int, width: int):
    """One level of the lanes' pairwise tree for `keys` keys of `width` lanes held one after the other in
    x then y (y's lanes numbered after x's; y = x where x holds them all): lane i + lane i + width / 2 of
    each key, the keys' halves side by side in one vector of keys * width / 2 lanes."""
    half = width // 2
    starts = [key * width for key in range(keys)]
    low = ir.Constant(ir.VectorType(_I32, keys * half), [s + i for s in starts for i in range(half)])
    high = ir.Constant(ir.VectorType(_I32, keys * half), [s + half + i for s in starts for i in range(half)])
    return builder.fadd(builder.shuffle_vector(x, y, low), builder.shuffle_vector(x, y, high))


def _accumulate(builder, queries, keys, count, bf16: bool):
    """Each query's 16 lane sums with each key: lane l = q[i] * k[i] + lane, fused, for i = l, l + 16, ... in
    order, from +0 (`count` blocks of 16; the queries fp32, the keys bf16 bits where `bf16`; all addresses).
    A block's lanes of every query and every key are loaded (a key's widened) once for all the sums."""
    accs = [[cgutils.alloca_once_value(builder, ir.Constant(_VEC, None)) for _ in keys] for _ in queries]  # zeros
    with cgutils.for_range(builder, count) as loop:
        element = builder.mul(loop.index, ir.Constant(loop.index.type, LANES))
        qvs = [_lanes(builder, q_at, element, False) for q_at in queries]
        for b, key in enumerate(keys):
            kv = _lanes(builder, key, element, bf16)
            for qv, row_accs in zip(qvs, accs):
                builder.store(_fma(builder, qv, kv, builder.load(row_accs[b])), row_accs[b])
    return [[builder.load(acc) for acc in row_accs] for row_accs in accs]


def _by_rows(builder, n, body):
    """body(r) for the r = n (1 .. ROWS) known when the code is generated: one specialised copy per r."""
    end = builder.append_basic_block("rows.end")
    switch = builder.switch(n, end)
    for r in range(1, ROWS + 1):
        case = builder.append_basic_block(f"rows.{r}")
        switch.add_case(ir.Constant(n.type, r), case)
        builder.position_at_end(case)
        body(r)
        builder.branch(end)
    builder.position_at_end(end)


def _dot(bf16: bool):
    """An intrinsic: `cpu_attention._fused_dot` of the fp32 row at address q and the row at address k
    (bf16 bits where `bf16`), both `blocks` * 16 long."""

    @intrinsic
    def dot(typingctx, q, k, blocks):
        def codegen(context, builder, signature, args):
            q_at, k_at, count = args
            ((lanes,),) = _accumulate(builder, [q_at], [k_at], count, bf16)
            for width in (16, 8, 4, 2):
                lanes = _fold(builder, lanes, lanes, 1, width)
            return builder.extract_element(lanes, ir.Constant(_I32, 0))

        return types.float32(types.int64, types.int64, types.int64), codegen

    return dot


def _dots4(bf16: bool):
    """An intrinsic: `cpu_attention._fused_dot` of each of `rows` (1 .. ROWS) fp32 query rows, at addresses
    q + i * q_step, with the four key rows at addresses k, k + k_step, k + 2 k_step, k + 3 k_step (bf16
    bits where `bf16`), all `blocks` * 16 long, written to the four fp32 at address dest + i * dest_step.
    The rows share the keys' loads; a row's four keys' trees share their shuffles (`_fold`); every lane's
    operation is the one `_fused_dot` makes."""

    @intrinsic
    def dots4(typingctx, q, q_step, k, k_step, blocks, dest, dest_step, rows):
        def codegen(context, builder, signature, args):
            q_at, q_step_, k_at, step, count, dest_at, dest_step_, n = args
            keys = [_nth(builder, k_at, step, r) for r in range(4)]

            def body(r: int):
                queries = [_nth(builder, q_at, q_step_, i) for i in range(r)]
                for i, (a, b, c, d) in enumerate(_accumulate(builder, queries, keys, count, bf16)):
                    four = _fold(builder, _fold(builder, a, b, 2, 16), _fold(builder, c, d, 2, 16), 4, 8)
                    two = _fold(builder, four, four, 4, 4)
                    one = _fold(builder, two, two, 4, 2)
                    dest = builder.inttoptr(_nth(builder, dest_at, dest_step_, i), ir.VectorType(_F32, 4).as_pointer())
                    builder.store(one, dest, align=4)

            _by_rows(builder, n, body)
            return context.get_dummy_value()

        return types.void(*([types.int64] * 8)), codegen

    return dots4


GROUP = 4  # blocks of lanes a weighted sum carries at once: independent addition chains per key and row


def _splat(builder, value):
    """A `<16 x float>` of `value` in every lane."""
    first = builder.insert_element(ir.Constant(_VEC, ir.Undefined), value, ir.Constant(_I32, 0))
    return builder.shuffle_vector(
        first, ir.Constant(_VEC, ir.Undefined), ir.Constant(ir.VectorType(_I32, LANES), [0] * LANES)
    )


def _weighted_rows(builder, rows: int, out_at, out_step, e_at, e_step, v_at, step, lo, hi, count, bf16: bool):
    """`rows` rows' weighted sums over keys lo .. hi: row i's output at out_at + i * out_step bytes, its weights
    at e_at + i * e_step bytes; each pass over the keys carries up to GROUP blocks of every row, so a key's
    value lanes are loaded (and widened from bf16) once for all the rows."""
    i64 = lo.type
    outs = [_nth(builder, out_at, out_step, r) for r in range(rows)]
    weights = [builder.inttoptr(_nth(builder, e_at, e_step, r), _F32.as_pointer()) for r in range(rows)]
    accs = [[cgutils.alloca_once(builder, _VEC) for _ in range(GROUP)] for _ in range(rows)]

    def passes(first, width: int):
        """Blocks first .. first + width - 1 of every row over every key."""
        elements = [builder.mul(builder.add(first, ir.Constant(i64, b)), ir.Constant(i64, LANES)) for b in range(width)]
        for out, row_accs in zip(outs, accs):
            for acc, element in zip(row_accs, elements):
                builder.store(_lanes(builder, out, element, False), acc)
        with cgutils.for_range(builder, builder.add(hi, ir.Constant(i64, 1)), start=lo) as key:
            splats = [_splat(builder, builder.load(builder.gep(w, [key.index]))) for w in weights]
            row = builder.add(v_at, builder.mul(key.index, step))
            for b, element in enumerate(elements):
                value = _lanes(builder, row, element, bf16)
                for splat, row_accs in zip(splats, accs):
                    builder.store(_fma(builder, splat, value, builder.load(row_accs[b])), row_accs[b])
        for out, row_accs in zip(outs, accs):
            for acc, element in zip(row_accs, elements):
                at = builder.bitcast(
                    builder.gep(builder.inttoptr(out, _F32.as_pointer()), [element]), _VEC.as_pointer()
                )
                builder.store(builder.load(acc), at, align=4)

    whole = builder.udiv(count, ir.Constant(i64, GROUP))
    with cgutils.for_range(builder, whole) as group:
        passes(builder.mul(group.index, ir.Constant(i64, GROUP)), GROUP)
    with cgutils.for_range(builder, count, start=builder.mul(whole, ir.Constant(i64, GROUP))) as block:
        passes(block.index, 1)


def _weighted(bf16: bool):
    """An intrinsic: for each of `rows` rows (1 .. ROWS), out_i[:] = e_i[j] * v[j, :] + out_i[:], fused, for
    j = lo .. hi in order, each element in its lane: row i's output fp32 at address out + i * out_step, its
    weights fp32 at e + i * e_step, row j of v at address v + j * v_step bytes (bf16 bits where `bf16`),
    every row `blocks` * 16 long. The rows and up to GROUP blocks of lanes go through the keys together
    (their chains are independent, so the core overlaps them, and a key's values are read once for the
    rows); an element's operations are the same whichever rows and blocks share its pass."""

    @intrinsic
    def weighted(typingctx, out, out_step, e, e_step, v, v_step, lo, hi, blocks, rows):
        def codegen(context, builder, signature, args):
            *addresses, n = args
            _by_rows(builder, n, lambda r: _weighted_rows(builder, r, *addresses, bf16))
            return context.get_dummy_value()

        return types.void(*([types.int64] * 10)), codegen

    return weighted


dot_f32, dot_bf16 = _dot(False), _dot(True)
dots4_f32, dots4_bf16 = _dots4(False), _dots4(True)
weighted_f32, weighted_bf16 = _weighted(False), _weighted(True)
