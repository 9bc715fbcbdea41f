"""Batched decode kernels: mvb_<fmt>(d0, d1, d2, X, o0, o1, o2), a few decode vectors per
pass over each weight row (GROUP at a time), every row bit-identical to the matvec
kernels' (the same block intrinsics run once per vector).
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.core import cgutils  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops._simd import tree_sum16  # noqa: E402
from edgerun.ops.int8.activations import (  # noqa: E402
    _hsum,
    quantize_k8,
    quantize_xn,
)
from edgerun.ops.int8.blocks import (  # noqa: E402
    _K4_KINDS,
    _X1_KINDS,
    KIND_IQ4_NL,
    KIND_IQ4_XS,
    KIND_Q2_G64,
    KIND_Q2_K,
    KIND_Q3_G64,
    KIND_Q3_K,
    KIND_Q4_0,
    KIND_Q4_1,
    KIND_Q4_K,
    KIND_Q5_0,
    KIND_Q5_1,
    KIND_Q5_K,
    KIND_Q6_K,
    KIND_Q8_0,
    _block_dot,
    _fold16,
    _folds,
    _prefetch_ahead,
    _unit_bytes,
    iq4_nl_pair,
    iq4_nl_single,
    iq4_xs_block,
    k4_kind,
    q2_g64_block,
    q2_k_block,
    q3_g64_block,
    q3_k_block,
    q4_0_pair,
    q4_0_single,
    q4_1_pair,
    q4_1_single,
    q5_0_pair,
    q5_0_single,
    q5_1_pair,
    q5_1_single,
    q8_0_pair,
    q8_0_single,
    row_layout,
    x1_span,
    x_bytes,
)
from edgerun.ops.int8.ir import (  # noqa: E402
    _IR,
    F32,
    I64,
    V8F,
    V16F,
    _v,
    acc16,
)
from edgerun.ops.int8.matvec import (  # noqa: E402
    _batch_row,
    _k8_block,
    _k8_bytes,
    _row_k8,
)

_ACC = 32  # floats of accumulator per vector (acc16 + a second acc16)


@intrinsic
def acc_vectors(typingctx, g):
    """Pointer to g * (_ACC + 8) zeroed float32 on the stack: g vectors' accumulators,
    then the bias lanes of batched blocks (up to 8 per vector, _bias_lanes)."""
    if not isinstance(g, types.IntegerLiteral):
        return None
    n = 1 << (g.literal_value * (_ACC + 8) - 1).bit_length()  # a power of two: SROA
    vt = _v(F32, n)

    def codegen(context, builder, sig, args):
        p = cgutils.alloca_once(builder, vt)
        builder.store(ir.Constant(vt, [0.0] * n), p)
        return builder.bitcast(p, F32.as_pointer())

    return types.CPointer(types.float32)(g), codegen


def _i64(builder, v):
    return v if v.type == I64 else builder.sext(v, I64)


def _block_of(kind, part):
    """The single-vector block intrinsic of a non-K format: part 0 its pair, 1 its odd
    last block (the 64-element low-bit formats have none: part 1 is typed in a branch
    that never runs)."""
    table = {
        KIND_Q4_1: (q4_1_pair, q4_1_single),
        KIND_Q4_0: (q4_0_pair, q4_0_single),
        KIND_Q5_0: (q5_0_pair, q5_0_single),
        KIND_Q8_0: (q8_0_pair, q8_0_single),
        KIND_Q5_1: (q5_1_pair, q5_1_single),
        KIND_IQ4_NL: (iq4_nl_pair, iq4_nl_single),
        KIND_Q2_G64: (q2_g64_block, q2_g64_block),
        KIND_Q3_G64: (q3_g64_block, q3_g64_block),
        KIND_Q3_K: (q3_k_block, q3_k_block),
        KIND_Q2_K: (q2_k_block, q2_k_block),
    }
    return table[kind][part]


# the super-block formats of _k16_block (scale and bias per 16): their intrinsic takes
# the per-16 sums (xs16, so16) too, and runs once per vector
_K16_KINDS = (KIND_Q3_K, KIND_Q2_K)


_PAIR_UNPACK = {  # the pair intrinsics, whose unpack and nbytes _pair_batch uses
    KIND_Q4_1: q4_1_pair,
    KIND_Q4_0: q4_0_pair,
    KIND_Q5_0: q5_0_pair,
    KIND_Q8_0: q8_0_pair,
    KIND_Q5_1: q5_1_pair,
    KIND_IQ4_NL: iq4_nl_pair,
    KIND_Q2_G64: q2_g64_block,
    KIND_Q3_G64: q3_g64_block,
}


def _pairs_batched(kind: int, g: int) -> bool:
    """Whether a g-vector pass runs the format's block pairs through _pair_batch (block_g
    and vector_results must agree on where the bias lanes are)."""
    return kind in _PAIR_UNPACK and g >= 2


def _bias_lanes(kind: int) -> int:
    """Bias lanes per vector after a batch's accumulators (_K4_KINDS: 8 bias terms)."""
    return 8 if kind in _K4_KINDS else 4


def _bias_add(r, g, vals):
    """The bias lanes after g vectors' accumulators (r.args[0]) += vals."""
    b = r.b
    p = b.bitcast(b.gep(r.args[0], [ir.Constant(I64, _ACC * g)]), vals.type.as_pointer())
    b.store(b.fadd(b.load(p), vals), p)


def _acc_fma(r, v, df, sv):
    """Vector v's acc16 (its first df.type.count lanes) += df * sv."""
    b = r.b
    vt = df.type
    a = b.bitcast(b.gep(r.args[0], [ir.Constant(I64, _ACC * v)]), vt.as_pointer())
    b.store(r.fma(df, sv, b.load(a)), a)


def _x_at(r, xstride, v, extra):
    """Byte offset of vector v's activations + extra (r.args[5]: vector 0's)."""
    b = r.b
    return b.add(r.args[5], b.add(b.mul(xstride, ir.Constant(I64, v)), ir.Constant(I64, extra)))


def _k4_batch(blk):
    """The batched run of a _K4_KINDS block intrinsic `blk` (blocks._k4_block)."""

    def batch(r, g, xstride):
        _k4_batch_run(r, g, xstride, blk.scales, blk.chunk, blk.nbytes)

    return batch


def _k4_batch_run(r, g, xstride, scales, chunk, nbytes):
    """One IQ4_XS super-block for g vectors (args as _pair_batch; aux at
    soi: the g vectors' 8 dx, then at soi + 32 their 8 sx, _mvb). Scales and biases are
    unpacked once; s dx of all vectors is one 8g-lane multiply and their bias terms one
    multiply and add into the bias lanes. Per vector: the 4 dots, conversions, lane
    shuffles and FMAs. The same products and sums per lane as the single block."""
    b = r.b
    off = r.args[3]
    _prefetch_ahead(r, off, nbytes)
    dsc, dmn = scales(r, off)
    n = 8 * g
    lanes = list(range(8)) * g
    ds = b.fmul(r.shuf(dsc, dsc, lanes), r.load(8, r.args[9], _v(F32, n)))
    _bias_add(r, g, b.fmul(r.shuf(dmn, dmn, lanes), r.load(8, r.args[9], _v(F32, n), 32)))
    for c in range(4):
        w = chunk(r, off, c)
        for v in range(g):
            df = b.sitofp(r.dpx(w, 4, _x_at(r, xstride, v, 128 * c), 64), V16F)
            _acc_fma(r, v, df, r.shuf(ds, ds, [8 * v + 2 * c] * 8 + [8 * v + 2 * c + 1] * 8))


def _pair_batch(r, g, pair, xstride):
    """One block pair (or 64-element low-bit block) for g vectors, r's args laid out as
    (acc, acc, row, off, xq, xo, xds, so, xsi, soi). The weights are unpacked once; the
    scale products of all g vectors are one 4g-lane multiply of [d_a, m_a, d_b, m_b]
    repeated by xsi[soi:soi + 4g] (each vector's [dx_a, sx_a, dx_b, sx_b], interleaved by
    _mvb) and their bias sums one add into the lanes after the g accumulators. Each lane
    is the product and sum _pair_common forms for one vector, so rows stay bit-identical;
    per vector only the dot, its conversion, one lane shuffle and the FMA remain (the
    single path repeats the scale load, multiply and bias add for every vector)."""
    b = r.b
    _prefetch_ahead(r, r.args[3], pair.nbytes)
    w, dm, lanes = pair.unpack(r, r.args[3])
    n = 4 * g
    prod = b.fmul(r.shuf(dm, dm, [0, 1, 2, 3] * g), r.load(8, r.args[9], _v(F32, n)))
    _bias_add(r, g, prod)
    fold = _folds(lanes)
    for v in range(g):
        dot = _block_dot(r, w, _x_at(r, xstride, v, 0), 64, pair.x1, lanes)
        if fold:  # as _pair_common
            df = b.sitofp(_fold16(r, dot), V8F)
            _acc_fma(r, v, df, r.shuf(prod, prod, [4 * v + i for i in lanes[:8]]))
        else:
            _acc_fma(r, v, b.sitofp(dot, V16F), r.shuf(prod, prod, [4 * v + i for i in lanes]))


@intrinsic
def block_g(typingctx, g, kind, part, cols, acc, row, off, xq, xo, xds, so, xs16, so16):
    """The format's block run for g vectors (g, kind, part literals): batched
    (_k4_batch, _pair_batch; xs16[so16] the group's interleaved scales) or
    the single-vector intrinsic (`_block_of(kind, part)`) once per vector, with vector
    v's accumulators at acc + _ACC v (two acc16), its x at xq[xo + 2 cols v] and its
    scales at xds[so + cols/16 v] (_K16_KINDS: its per-16 sums at xs16[so16 + cols/16 v])."""
    lits = (g, kind, part)
    if not all(isinstance(t, types.IntegerLiteral) for t in lits):
        return None
    i64, fp = types.int64, types.CPointer(types.float32)
    k = kind.literal_value
    batch_fn = {KIND_IQ4_XS: _k4_batch(iq4_xs_block)}.get(k)
    rest = (row, i64, xq, i64, xds, i64)
    if k in _K16_KINDS:
        rest = (*rest, xs16, i64)
    if batch_fn is not None:  # every K pass is batched (their part 1 is typed, never run)
        batched = True
    else:
        ssig, scg = _block_of(k, part.literal_value)._defn(typingctx, fp, fp, *rest)
        batched = part.literal_value == 0 and _pairs_batched(k, g.literal_value)

    def codegen(context, builder, sig, args):
        cols_v = _i64(builder, args[3])
        xb = 1 if k in _X1_KINDS else 2  # bytes of one vector's x per element
        xstride = builder.mul(cols_v, ir.Constant(I64, xb))
        sstride = builder.sdiv(cols_v, ir.Constant(I64, 16))  # its xds / xs16
        if batched:
            tys = (fp, fp, row, i64, xq, i64, xds, i64, xs16, i64)
            vals = [args[4], args[4]] + [
                context.cast(builder, a, t0, t1)
                for a, t0, t1 in zip(args[5:], sig.args[5:], tys[2:])
            ]
            r = _IR(context, builder, types.void(*tys), vals)
            if batch_fn is not None:
                batch_fn(r, g.literal_value, xstride)
            else:
                _pair_batch(r, g.literal_value, _PAIR_UNPACK[k], xstride)
            return context.get_dummy_value()
        base = [context.cast(builder, a, t0, t1) for a, t0, t1 in zip(args[5:], sig.args[5:], rest)]
        for v in range(g.literal_value):
            accs = [builder.gep(args[4], [ir.Constant(I64, _ACC * v + 16 * k)]) for k in (0, 1)]
            vargs = list(base)
            strides = ((3, xstride), (5, sstride), (7, sstride))[: 3 if k in _K16_KINDS else 2]
            for i, stride in strides:
                vargs[i] = builder.add(vargs[i], builder.mul(stride, ir.Constant(I64, v)))
            scg(context, builder, ssig, accs + vargs)
        return context.get_dummy_value()

    return types.void(g, kind, part, cols, acc, row, off, xq, xo, xds, so, xs16, so16), codegen


@intrinsic
def vector_results(typingctx, g, kind, acc, res):
    """res[v] = vector v's row result from its accumulators, for v < g (literals), in the
    single row function's float order (_row_<fmt>)."""
    if not isinstance(g, types.IntegerLiteral) or not isinstance(kind, types.IntegerLiteral):
        return None
    k = kind.literal_value

    def codegen(context, builder, sig, args):
        b = builder
        out = b.bitcast(args[3], F32.as_pointer())
        for v in range(g.literal_value):
            a = b.gep(args[2], [ir.Constant(I64, _ACC * v)])
            t = b.gep(args[2], [ir.Constant(I64, _ACC * v + 16)])
            h = tree_sum16(b, a)

            def lane(i, t=t):
                return b.load(b.gep(t, [ir.Constant(I64, i)]))

            if k in _K16_KINDS:  # _hsum(ab, 4): the second acc16's first 4 lanes, in order
                tail = ir.Constant(F32, 0.0)
                for i in range(4):
                    tail = b.fadd(tail, lane(i))
            elif k in _K4_KINDS:  # _hsum(p, n) for n < 16: from 0.0, in order
                tail = ir.Constant(F32, 0.0)
                nl = _bias_lanes(k)
                for i in range(nl):
                    at = _ACC * g.literal_value + nl * v + i
                    tail = b.fadd(tail, b.load(b.gep(args[2], [ir.Constant(I64, at)])))
            elif _pairs_batched(k, g.literal_value):
                # the batched pairs' bias lanes, then the odd last block's (0.0 if none):
                # the order in which the single path's acc4 summed them
                def both(i, v=v):
                    gl = b.load(
                        b.gep(args[2], [ir.Constant(I64, _ACC * g.literal_value + 4 * v + i)])
                    )
                    return b.fadd(gl, lane(i))

                tail = b.fadd(both(1), both(3))
            else:
                tail = b.fadd(lane(1), lane(3))  # the pair accumulator's bias lanes
            plus = (KIND_Q4_1, KIND_Q5_1, KIND_Q3_G64, KIND_Q2_G64)  # x = d q + m: + m sum(x)
            c = {k_: None for k_ in plus} | {KIND_Q4_0: 8.0, KIND_Q5_0: 16.0, KIND_Q8_0: 128.0}
            c = c | {KIND_IQ4_NL: 128.0}
            c = c.get(k, 1.0 if k in _K4_KINDS else 32.0)
            if c is None:
                r = b.fadd(h, tail)
            elif k in _K4_KINDS or k in _K16_KINDS:
                r = b.fsub(h, tail)
            else:
                r = b.fsub(h, b.fmul(ir.Constant(F32, c), tail))
            b.store(r, b.gep(out, [ir.Constant(I64, v)]))
        return context.get_dummy_value()

    return types.void(g, kind, acc, res), codegen


# ----------------------------------------------------------------- row dispatch, batch


GROUP = 4  # vectors per pass over a row (4 x two acc16 fill most of AVX2's registers)


@njit(inline="always")
def _rows_g(g, kind, flat, base, nunit, cols, xq, xo, xds, so, xs16, res):
    """One row . g vectors (the g from vector v0, whose x starts at xq[xo], its scales at
    xds[so]) -> res[0:g]: the block loop of _row_<fmt>, every block for all g. xs16: the
    group's interleaved scales (_mvb; _pair_batch, _k4_batch)."""
    acc = acc_vectors(g)
    ub = _unit_bytes(kind)
    if k4_kind(kind):  # xs16: the group's K scales (_mvb)
        for b in range(nunit):
            o, w = so + b * 16, base + b * ub
            a = so + 64 * b
            block_g(g, kind, 0, cols, acc, flat, w, xq, xo + b * 512, xds, o, xs16, a)
    elif kind == KIND_Q3_K or kind == KIND_Q2_K:  # xs16: every vector's per-16 sums
        for b in range(nunit):
            o, w = so + b * 16, base + b * ub
            block_g(g, kind, 0, cols, acc, flat, w, xq, xo + b * 512, xds, o, xs16, o)
    elif kind == KIND_Q3_G64 or kind == KIND_Q2_G64:
        for b in range(nunit):
            o = so + b * 4
            w = base + b * ub
            xp = xo + b * 64 * x_bytes(kind)
            block_g(g, kind, 0, cols, acc, flat, w, xq, xp, xds, o, xs16, so + b * 16)
    else:  # xs16: the interleaved scales of _mvb's vector group (_pair_batch)
        xb = x_bytes(kind)
        for p in range(nunit // 2):
            o, w = so + p * 4, base + p * 2 * ub
            xp = xo + p * 64 * xb
            block_g(g, kind, 0, cols, acc, flat, w, xq, xp, xds, o, xs16, so + p * 16)
        if nunit & 1:
            b = nunit - 1
            o, xp = so + b * 2, xo + b * 32 * xb
            block_g(g, kind, 1, cols, acc, flat, base + b * ub, xq, xp, xds, o, xs16, o)
    vector_results(g, kind, acc, res)


@njit(inline="always")
def _mvb(kind, d0, d1, d2, X, o0, o1, o2):
    """o_k[v] = W_k @ X[v] for up to three matrices W_k (d0, d1, d2) that share X: X is
    quantized once and the rows of all of them share one parallel loop (Q/K/V, gate/up;
    unused slots get 0-row arrays), as the mv_* kernels do for one vector."""
    nv, cols = X.shape
    unit, nib2 = row_layout(kind)
    nunit = cols // unit
    nb = cols // 32
    xs = 2 * nb  # scales per vector
    # A last group of 3 runs as 4 (the 4th a copy of the 3rd, its result dropped): the
    # 4-vector pass costs less than the 3-vector one (SmolLM2's 576x576 Q4_1: 2.0x
    # against 3.4x one vector's time)
    npad = nv + 1 if nv % GROUP == 3 else nv
    xq = np.empty(npad * 2 * cols, np.int8)
    xds = np.empty(npad * xs, np.float32)
    xs16 = np.empty(npad * xs, np.float32)
    xb = x_bytes(kind)  # bytes of x per element
    for v in range(nv):
        xv, sv = xq[xb * cols * v :], xds[v * xs : v * xs + xs]
        quantize_xn(X[v], x1_span(kind), nib2, xv, sv, xs16[v * xs :])
    if npad > nv:
        q = xb * cols * nv
        xq[q : q + xb * cols] = xq[q - xb * cols : q]
        xds[nv * xs : npad * xs] = xds[(nv - 1) * xs : nv * xs]
        xs16[nv * xs : npad * xs] = xs16[(nv - 1) * xs : nv * xs]
    # each group of GROUP vectors' scales side by side, so that a block's scale products
    # for all of them are one vector multiply (_pair_batch, _k4_batch)
    ng = (npad + GROUP - 1) // GROUP
    if k4_kind(kind):  # per super-block b at xs * v0 + 64 b: 8 dx per vector, then 8 sx
        aux = np.zeros(ng * GROUP * xs, np.float32)
        for v in range(npad):
            at, x0 = (v - v % GROUP) * xs + (v % GROUP) * 8, v * xs
            for b in range(nunit):
                for j in range(8):
                    aux[at + 64 * b + j] = xds[x0 + 16 * b + 2 * j]
                    aux[at + 64 * b + 32 + j] = xds[x0 + 16 * b + 2 * j + 1]
    elif kind == KIND_Q3_K or kind == KIND_Q2_K:  # each vector's own per-16 sums
        aux = xs16
    else:
        # block pairs: each group of GROUP vectors' [dx_a, sx_a, dx_b, sx_b] of pair q
        # side by side at xs * v0 + 16 q (_pair_batch loads them as one vector)
        aux = np.zeros(ng * GROUP * xs, np.float32)
        for v in range(npad):
            at = (v - v % GROUP) * xs + (v % GROUP) * 4
            for q in range(xs // 4):
                for j in range(4):
                    aux[at + 16 * q + j] = xds[v * xs + 4 * q + j]
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    n0, n1 = d0.shape[0], d1.shape[0]
    n01 = n0 + n1
    for row in prange(n01 + d2.shape[0]):
        res = acc_vectors(1)  # >= GROUP floats
        rv = numba.carray(res, GROUP)
        flat, base, out, r = _batch_row(row, f0, f1, f2, d0, d1, d2, o0, o1, o2)
        for v0 in range(0, nv, GROUP):
            g = min(GROUP, nv - v0)
            xo = xb * cols * v0
            so = xs * v0
            if g >= 3:
                _rows_g(4, kind, flat, base, nunit, cols, xq, xo, xds, so, aux, res)
            elif g == 2:
                _rows_g(2, kind, flat, base, nunit, cols, xq, xo, xds, so, aux, res)
            else:
                _rows_g(1, kind, flat, base, nunit, cols, xq, xo, xds, so, aux, res)
            for v in range(g):
                out[v0 + v, r] = rv[v]


# Batched decode, one kernel per format: o_k[v] = W_k @ X[v] for a few vectors and up to
# three matrices sharing them, each row read and unpacked once for GROUP vectors at a
# time. Row v equals the format's mv_* kernel on X[v] bit for bit (the same x
# quantization, the same per-vector IR).
@njit(parallel=True, cache=True, nogil=True)
def mvb_q4_0(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q4_0, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q4_1(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q4_1, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q5_0(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q5_0, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q8_0(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q8_0, d0, d1, d2, X, o0, o1, o2)


@njit(inline="always")
def _k8_rows4(kind, flat, base, nsb, cols, xb, xsb, xp, bs, v0, nv, rv):
    """One Q4_K / Q5_K / Q6_K row . vectors v0 .. v0 + 3 (clamped to nv - 1; a clamped copy's
    result is dropped) on quantize_x_sb8 activations: the block intrinsic for each
    vector in turn, the same IR as _row_k8's, so each result equals the single matvec's
    bit for bit; the four calls load and unpack the same weights, and LLVM does that
    once."""
    va, vb, vc, vd = v0, min(v0 + 1, nv - 1), min(v0 + 2, nv - 1), min(v0 + 3, nv - 1)
    a0, m0, a1, m1 = acc16(), acc16(), acc16(), acc16()
    a2, m2, a3, m3 = acc16(), acc16(), acc16(), acc16()
    nbytes = _k8_bytes(kind)
    for s in range(nsb):
        w, o = base + s * nbytes, s * 256
        _k8_block(kind, a0, m0, flat, w, xb, va * cols + o, xsb, xp, va * nsb + s, bs)
        _k8_block(kind, a1, m1, flat, w, xb, vb * cols + o, xsb, xp, vb * nsb + s, bs)
        _k8_block(kind, a2, m2, flat, w, xb, vc * cols + o, xsb, xp, vc * nsb + s, bs)
        _k8_block(kind, a3, m3, flat, w, xb, vd * cols + o, xsb, xp, vd * nsb + s, bs)
    rv[0] = _hsum(a0, 8) - _hsum(m0, 8)
    rv[1] = _hsum(a1, 8) - _hsum(m1, 8)
    rv[2] = _hsum(a2, 8) - _hsum(m2, 8)
    rv[3] = _hsum(a3, 8) - _hsum(m3, 8)


@njit(inline="always")
def _k8_rows2(kind, flat, base, nsb, cols, xb, xsb, xp, bs, v0, rv):
    a0, m0, a1, m1 = acc16(), acc16(), acc16(), acc16()
    v1 = v0 + 1
    nbytes = _k8_bytes(kind)
    for s in range(nsb):
        w, o = base + s * nbytes, s * 256
        _k8_block(kind, a0, m0, flat, w, xb, v0 * cols + o, xsb, xp, v0 * nsb + s, bs)
        _k8_block(kind, a1, m1, flat, w, xb, v1 * cols + o, xsb, xp, v1 * nsb + s, bs)
    rv[0] = _hsum(a0, 8) - _hsum(m0, 8)
    rv[1] = _hsum(a1, 8) - _hsum(m1, 8)


@njit(inline="always")
def _mvb_k8(kind, d0, d1, d2, X, o0, o1, o2):
    """_mvb for Q4_K / Q5_K / Q6_K on quantize_x_sb8 activations: rows
    equal mv_q4_k's / mv_q5_k's / mv_q6_k's."""
    nv, cols = X.shape
    n = cols // 256
    xb = np.empty(nv * cols, np.int8)
    xsb = np.empty(nv * 9 * n, np.float32)
    xp = np.empty(nv * 8 * n, np.int16)
    bs = np.empty(nv * 16 * n, np.int16)
    for v in range(nv):
        quantize_k8(
            kind,
            X[v],
            xb[v * cols : (v + 1) * cols],
            xsb[v * 9 * n : (v + 1) * 9 * n],
            xp[v * 8 * n : (v + 1) * 8 * n],
            bs[v * 16 * n : (v + 1) * 16 * n],
        )
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    n0, n1 = d0.shape[0], d1.shape[0]
    n01 = n0 + n1
    for row in prange(n01 + d2.shape[0]):
        res = acc_vectors(1)  # >= GROUP floats
        rv = numba.carray(res, GROUP)
        flat, base, out, r = _batch_row(row, f0, f1, f2, d0, d1, d2, o0, o1, o2)
        for v0 in range(0, nv, GROUP):
            g = min(GROUP, nv - v0)
            if g >= 3:
                _k8_rows4(kind, flat, base, n, cols, xb, xsb, xp, bs, v0, nv, rv)
            elif g == 2:
                _k8_rows2(kind, flat, base, n, cols, xb, xsb, xp, bs, v0, rv)
            else:
                rv[0] = _row_k8(
                    kind,
                    flat,
                    base,
                    n,
                    xb[v0 * cols :],
                    xsb[v0 * 9 * n :],
                    xp[v0 * 8 * n :],
                    bs[v0 * 16 * n :],
                )
            for v in range(g):
                out[v0 + v, r] = rv[v]


@njit(parallel=True, cache=True, nogil=True)
def mvb_q4_k(d0, d1, d2, X, o0, o1, o2):
    _mvb_k8(KIND_Q4_K, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q6_k(d0, d1, d2, X, o0, o1, o2):
    _mvb_k8(KIND_Q6_K, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q3_g64(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q3_G64, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q2_g64(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q2_G64, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q5_1(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q5_1, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_iq4_nl(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_IQ4_NL, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q5_k(d0, d1, d2, X, o0, o1, o2):
    _mvb_k8(KIND_Q5_K, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_iq4_xs(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_IQ4_XS, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q3_k(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q3_K, d0, d1, d2, X, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q2_k(d0, d1, d2, X, o0, o1, o2):
    _mvb(KIND_Q2_K, d0, d1, d2, X, o0, o1, o2)
