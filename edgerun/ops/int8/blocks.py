"""Block intrinsics: one weight block (or block pair) of each format unpacked to bytes in
registers and multiplied with int8 activations into the accumulators (the matvec and
batched kernels' inner step), the formats' kind numbers (KIND_<fmt>) and their layouts
(row_layout, x1_span, x_bytes).
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

from llvmlite import ir  # noqa: E402
from llvmlite.binding import llvm_version_info  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops.int8.ir import (  # noqa: E402
    _IR,
    DOT,
    F32,
    HALF,
    I1,
    I8,
    I16,
    I32,
    I64,
    V2F,
    V4F,
    V8F,
    V16F,
    V16I8,
    V32I8,
    V64I8,
    _acc_add,
    _v,
)
from edgerun.quant.iquants import KVALUES  # noqa: E402

# ----------------------------------------------------------------- block intrinsics
# Conventions: (a16, a4) are acc16()/acc4() pointers; row is the uint8 row of W; off a
# byte offset into it; xq the int8 activations, xo a byte offset; xds the float32
# [dx_0, sx_0, dx_1, sx_1, ...] (sx = dx * sum(q_x) of a block), so = index of dx_b.
# a4 collects [d dx, bias sx, d dx, bias sx] per block pair; lanes 1 and 3 are the bias
# sums the caller scales by the format's constant (m: 1, Q4_0: -8, Q5_0: -16, Q8_0: -128).

_SV_NIB2 = [0] * 4 + [2] * 4 + [0] * 4 + [2] * 4  # lanes of a nib2 dot -> block a/b
_SV_NAT2 = [0] * 8 + [2] * 8  # lanes of a natural 2-block dot -> block a/b
_SV_SHARED = [0] * 16  # a G64 block on X1's x: one d and one dx for all 64 (quantize_x1)


def _folds(sv_idx) -> bool:
    """Whether a pair's 16 dot lanes are summed to 8 in integers before the float scale:
    on the vpmaddwd paths (AVX2, int8) the nib2 lane map puts the same blocks in lanes
    0-7 and 8-15 ([a a a a b b b b] twice), so their exact int32 sum takes one conversion
    and one 8-lane FMA where 16 lanes take two of each (VNNI's 16 lanes are one zmm op).
    A G64 block on X1's activations (_SV_SHARED) folds its two halves the same way."""
    return DOT != "vnni" and list(sv_idx) in (_SV_NIB2, _SV_SHARED)


def _fold16(ir_, dot):
    if dot.type.count == 8:  # dot_x1 folded it in int16
        return dot
    return ir_.b.add(ir_.shuf(dot, dot, range(8)), ir_.shuf(dot, dot, range(8, 16)))


def _pair_common(ir_, dot, dm, sx, sv_idx):
    prod = ir_.b.fmul(dm, sx)  # [d_a dx_a, bias_a sx_a, d_b dx_b, bias_b sx_b]
    if _folds(sv_idx):
        sv = ir_.shuf(prod, prod, sv_idx[:8])
        df = ir_.b.sitofp(_fold16(ir_, dot), V8F)
        _acc_add(ir_, 0, V8F, lambda a: ir_.fma(df, sv, a))  # acc16's first 8 lanes
    else:
        sv = ir_.shuf(prod, prod, sv_idx)
        df = ir_.b.sitofp(dot, V16F)
        _acc_add(ir_, 0, V16F, lambda a: ir_.fma(df, sv, a))
    _acc_add(ir_, 1, V4F, lambda a: ir_.b.fadd(a, prod))


def _single_common(ir_, dot8, dm2, sx2):
    prod = ir_.b.fmul(dm2, sx2)  # [d dx, bias sx]
    sv = ir_.shuf(prod, prod, [0] * 8 + [2] * 8)  # lanes 8..15 multiply zeros
    df = ir_.shuf(ir_.b.sitofp(dot8, V8F), ir.Constant(V8F, [0.0] * 8), range(16))
    _acc_add(ir_, 0, V16F, lambda a: ir_.fma(df, sv, a))
    p4 = ir_.shuf(prod, ir.Constant(V2F, [0.0, 0.0]), [0, 1, 2, 3])
    _acc_add(ir_, 1, V4F, lambda a: ir_.b.fadd(a, p4))


def _nib_pair(ir_, q32):
    """<32 x i8> [qs_a | qs_b] -> <64 x u8> [lo_a lo_b | hi_a hi_b]."""
    lo = ir_.b.and_(q32, ir_.splat_i8(32, 15))
    hi = ir_.b.lshr(q32, ir_.splat_i8(32, 4))
    return ir_.concat(lo, hi)


def _nib_single(ir_, q16):
    lo = ir_.b.and_(q16, ir_.splat_i8(16, 15))
    hi = ir_.b.lshr(q16, ir_.splat_i8(16, 4))
    return ir_.concat(lo, hi)


def _sig(a16, a4, row, off, xq, xo, xds, so):
    return types.void(a16, a4, row, off, xq, xo, xds, so)


def _unpack_q4_1(r, off):
    """A Q4_1 block pair at off -> (64 weight bytes in the nib2 order, [d_a, m_a, d_b,
    m_b], the dot lanes' block map)."""
    b = r.b
    q = r.concat(r.load(2, off, V16I8, 4), r.load(2, off, V16I8, 24))
    # both (d, m) pairs as one <2 x i32> -> <4 x half> -> one vcvtph2ps
    w2 = r.pack2(r.load(2, off, I32), r.load(2, off, I32, 20))
    dm = b.fpext(b.bitcast(w2, _v(HALF, 4)), V4F)
    return _nib_pair(r, q), dm, _SV_NIB2


def _block_dot(r, w, xo, n, x1, lanes):
    """A block (pair)'s integer dot at x byte offset xo: dpx on quantize_x's two levels,
    or (x1: X1's formats) dot_x1 on quantize_x1's bytes."""
    if x1:
        return r.dot_x1(w, 4, xo, n, _folds(lanes))
    return r.dpx(w, 4, xo, n)


def _pair_intrinsic(unpack, name, nbytes, x1=False):
    """The block-pair intrinsic of a format whose `unpack(r, off)` gives (weight bytes,
    4 scale lanes, lane map) of the nbytes at off: one dot (_block_dot), then
    _pair_common. x1: one of X1's formats, whose activations are quantize_x1's."""

    def pair(typingctx, a16, a4, row, off, xq, xo, xds, so):
        def codegen(context, builder, sig, args):
            r = _IR(context, builder, sig, args)
            _prefetch_ahead(r, args[3], nbytes)
            w, dm, lanes = unpack(r, args[3])
            dot = _block_dot(r, w, args[5], 64, x1, lanes)
            _pair_common(r, dot, dm, r.load(6, args[7], V4F), lanes)
            return context.get_dummy_value()

        return _sig(a16, a4, row, off, xq, xo, xds, so), codegen

    pair.__name__ = name
    fn = intrinsic(pair)
    # for the batched blocks (_pair_batch)
    fn.unpack, fn.nbytes, fn.x1 = unpack, nbytes, x1
    return fn


q4_1_pair = _pair_intrinsic(_unpack_q4_1, "q4_1_pair", 40)


def _single_intrinsic(unpack, name, x1=False):
    """The odd-last-block intrinsic of a format whose `unpack(r, off)` gives its 32
    weight bytes and [d, m] (or [d, d]): one 32-byte dot, then _single_common."""

    def single(typingctx, a16, a4, row, off, xq, xo, xds, so):
        def codegen(context, builder, sig, args):
            r = _IR(context, builder, sig, args)
            w, dm = unpack(r, args[3])
            dot = _block_dot(r, w, args[5], 32, x1, ())
            _single_common(r, dot, dm, r.load(6, args[7], V2F))
            return context.get_dummy_value()

        return _sig(a16, a4, row, off, xq, xo, xds, so), codegen

    single.__name__ = name
    return intrinsic(single)


def _unpack1_q4_1(r, off):
    return _nib_single(r, r.load(2, off, V16I8, 4)), r.f16x(2, off, 2)


q4_1_single = _single_intrinsic(_unpack1_q4_1, "q4_1_single")


def _dd(r, off, extra):
    d = r.f16(2, off, extra)
    return r.splat(d, 2)


def _dd2(r, off, stride):
    """fp16 d of blocks a (at off) and b (at off + stride) -> <4 x float> [da, da, db, db]
    with one conversion."""
    h = r.pack2(r.load(2, off, I16), r.load(2, off, I16, stride))
    f = r.b.fpext(r.b.bitcast(h, _v(HALF, 2)), V2F)
    return r.shuf(f, f, [0, 0, 1, 1])


def _unpack_q4_0(r, off):
    q = r.concat(r.load(2, off, V16I8, 2), r.load(2, off, V16I8, 20))
    return _nib_pair(r, q), _dd2(r, off, 18), _SV_NIB2


q4_0_pair = _pair_intrinsic(_unpack_q4_0, "q4_0_pair", 36)


def _unpack1_q4_0(r, off):
    return _nib_single(r, r.load(2, off, V16I8, 2)), _dd(r, off, 0)


q4_0_single = _single_intrinsic(_unpack1_q4_0, "q4_0_single")


def _hbits(r, off, extra):
    return r.load(2, off, I32, extra)


def _bit_bytes(r, bits, n, value):
    """<n x i8>: `value` in lane j where bit j of the n-bit integer `bits` is set, else 0.
    AVX-512 moves the bits into a mask register (select on <n x i1>). Without it, LLVM
    spreads that select over scalar bit tests (a Q5_0 matvec at 2.4 GB/s on avx2 against
    15 for Q4_K), so there each lane takes its byte of `bits` (one byte shuffle), keeps its
    bit (an and) and compares."""
    b = r.b
    if DOT == "vnni":
        return b.select(b.bitcast(bits, _v(I1, n)), r.splat_i8(n, value), r.splat_i8(n, 0))
    by = b.bitcast(bits, _v(I8, n // 8))
    spread = r.shuf(by, by, [j >> 3 for j in range(n)])
    bit = r.const(_v(I8, n), [1 << (j & 7) for j in range(n)])
    on = b.icmp_unsigned("!=", b.and_(spread, bit), r.splat_i8(n, 0))
    return b.select(on, r.splat_i8(n, value), r.splat_i8(n, 0))


def _unpack_q5_0(r, off):
    b = r.b
    q = r.concat(r.load(2, off, V16I8, 6), r.load(2, off, V16I8, 28))
    w = _nib_pair(r, q)  # [lo_a lo_b | hi_a hi_b]
    # the high bits in the same order, [a 0:16, b 0:16, a 16:32, b 16:32]: one 16-bit
    # lane shuffle of the two 32-bit qh (scalar shifts and ors take ~10 instructions)
    h4 = b.bitcast(r.pack2(_hbits(r, off, 2), _hbits(r, off, 24)), _v(I16, 4))
    mask = b.bitcast(r.shuf(h4, h4, [0, 2, 1, 3]), I64)
    hv = _bit_bytes(r, mask, 64, 16)
    return b.or_(w, hv), _dd2(r, off, 22), _SV_NIB2


q5_0_pair = _pair_intrinsic(_unpack_q5_0, "q5_0_pair", 44, x1=True)


def _unpack1_q5_0(r, off):
    b = r.b
    w = _nib_single(r, r.load(2, off, V16I8, 6))
    hv = _bit_bytes(r, _hbits(r, off, 2), 32, 16)
    return b.or_(w, hv), _dd(r, off, 0)


q5_0_single = _single_intrinsic(_unpack1_q5_0, "q5_0_single", x1=True)


def _unpack_q8_0(r, off):
    w = r.concat(r.load(2, off, V32I8, 2), r.load(2, off, V32I8, 36))
    w = r.b.xor(w, r.splat_i8(64, 0x80))  # signed -> unsigned (+128)
    return w, _dd2(r, off, 34), _SV_NAT2


q8_0_pair = _pair_intrinsic(_unpack_q8_0, "q8_0_pair", 68)


def _unpack1_q8_0(r, off):
    return r.b.xor(r.load(2, off, V32I8, 2), r.splat_i8(32, 0x80)), _dd(r, off, 0)


q8_0_single = _single_intrinsic(_unpack1_q8_0, "q8_0_single")


def _unpack_q5_1(r, off):
    """A Q5_1 block pair: Q4_1's nibbles and (d, m) lanes, bit 4 from each block's qh
    in the nib2 order (as _unpack_q5_0)."""
    b = r.b
    q = r.concat(r.load(2, off, V16I8, 8), r.load(2, off, V16I8, 32))
    h4 = b.bitcast(r.pack2(_hbits(r, off, 4), _hbits(r, off, 28)), _v(I16, 4))
    hv = _bit_bytes(r, b.bitcast(r.shuf(h4, h4, [0, 2, 1, 3]), I64), 64, 16)
    w2 = r.pack2(r.load(2, off, I32), r.load(2, off, I32, 24))
    dm = b.fpext(b.bitcast(w2, _v(HALF, 4)), V4F)
    return b.or_(_nib_pair(r, q), hv), dm, _SV_NIB2


q5_1_pair = _pair_intrinsic(_unpack_q5_1, "q5_1_pair", 48)


def _unpack1_q5_1(r, off):
    w = _nib_single(r, r.load(2, off, V16I8, 8))
    return r.b.or_(w, _bit_bytes(r, _hbits(r, off, 4), 32, 16)), r.f16x(2, off, 2)


q5_1_single = _single_intrinsic(_unpack1_q5_1, "q5_1_single")

# IQ4's 16 levels + 128 as unsigned bytes (1..241): the dots' bias lanes take the 128 off
_IQ4_U8 = [int(v) + 128 for v in KVALUES]


def iq4_lookup(r, idx):
    """<n x i8> nibble indices (0..15) -> their IQ4 levels + 128 as <n x u8>: one byte
    shuffle per 16 bytes (vpshufb of the 16-entry table; AVX-512BW's for 64 bytes) on
    x86; elsewhere 16 compares and selects."""
    b = r.b
    n = idx.type.count
    if DOT in ("vnni", "avx2"):
        w = 64 if DOT == "vnni" and n == 64 else 32
        name = "llvm.x86.avx512.pshuf.b.512" if w == 64 else "llvm.x86.avx2.pshuf.b"
        f = r.fn(name, _v(I8, w), [_v(I8, w), _v(I8, w)])
        table = r.const(_v(I8, w), _IQ4_U8 * (w // 16))
        if n == 16:  # an odd last block's half
            idx32 = r.shuf(idx, idx, list(range(16)) * 2)
            out = b.call(f, [table, idx32])
            return r.shuf(out, out, range(16))
        parts = [
            b.call(f, [table, idx if n == w else r.shuf(idx, idx, range(k, k + w))])
            for k in range(0, n, w)
        ]
        while len(parts) > 1:
            parts = [r.concat(parts[i], parts[i + 1]) for i in range(0, len(parts), 2)]
        return parts[0]
    out = r.splat_i8(n, 0)
    for v, level in enumerate(_IQ4_U8):
        hit = b.icmp_unsigned("==", idx, r.splat_i8(n, v))
        out = b.select(hit, r.splat_i8(n, level), out)
    return out


def _unpack_iq4_nl(r, off):
    q = r.concat(r.load(2, off, V16I8, 2), r.load(2, off, V16I8, 20))
    return iq4_lookup(r, _nib_pair(r, q)), _dd2(r, off, 18), _SV_NIB2


iq4_nl_pair = _pair_intrinsic(_unpack_iq4_nl, "iq4_nl_pair", 36)


def _unpack1_iq4_nl(r, off):
    return iq4_lookup(r, _nib_single(r, r.load(2, off, V16I8, 2))), _dd(r, off, 0)


iq4_nl_single = _single_intrinsic(_unpack1_iq4_nl, "iq4_nl_single")


def _k4_block(scales, chunk, nbytes, name):
    """The block intrinsic of a super-block format with 8 sub-blocks of 32 that each have
    a scale and a bias (x = s_j u - b_j, u the unsigned weight bytes): scales(r, off) ->
    (s_j, b_j) <8 x float>, chunk(r, off, g) -> weights 64 g .. 64 g + 63 as <64 x u8>.
    a8 (an acc16 pointer, lanes 0..7 used) collects b_j sx_j, which the caller
    subtracts. IQ4_XS (b_j = 128 s_j; Q4_K and Q5_K decode on _k8_intrinsic's)."""

    def block(typingctx, a16, a8, row, off, xq, xo, xds, so):
        def codegen(context, builder, sig, args):
            r = _IR(context, builder, sig, args)
            b = builder
            off = args[3]
            _prefetch_ahead(r, off, nbytes)
            dsc, dmn = scales(r, off)
            xs16 = r.load(6, args[7], V16F)  # [dx_0, sx_0, ..., dx_7, sx_7]
            dx8 = r.shuf(xs16, xs16, range(0, 16, 2))
            sx8 = r.shuf(xs16, xs16, range(1, 16, 2))
            ds = b.fmul(dsc, dx8)  # s_j * dx_j
            mterm = b.fmul(dmn, sx8)
            _acc_add(r, 1, V8F, lambda a: b.fadd(a, mterm))
            for g in range(4):
                xo = b.add(args[5], ir.Constant(args[5].type, 128 * g))
                dot = r.dpx(chunk(r, off, g), 4, xo, 64)
                sv = r.shuf(ds, ds, [2 * g] * 8 + [2 * g + 1] * 8)
                df = b.sitofp(dot, V16F)
                _acc_add(r, 0, V16F, lambda a, df=df, sv=sv: r.fma(df, sv, a))
            return context.get_dummy_value()

        return _sig(a16, a8, row, off, xq, xo, xds, so), codegen

    block.__name__ = name
    fn = intrinsic(block)
    fn.scales, fn.chunk, fn.nbytes = scales, chunk, nbytes  # for the batched blocks
    return fn


def iq4xs_scale_ints(r, off):
    """An IQ4_XS super-block's (at byte off of the row, arg 2) 8 signed scales ls - 32,
    <8 x i16>: ls the 6-bit scale of each 32 elements, low 4 bits in scales_l at byte 4,
    high 2 in scales_h at byte 2."""
    b = r.b
    V8I16 = _v(I16, 8)
    sl = r.load(2, off, _v(I8, 4), 4)
    lo = b.lshr(r.shuf(sl, sl, [0, 0, 1, 1, 2, 2, 3, 3]), r.const(_v(I8, 8), [0, 4] * 4))
    lo = b.zext(b.and_(lo, r.splat_i8(8, 15)), V8I16)
    sh = r.splat(r.load(2, off, I16, 2), 8)
    hi = b.and_(b.lshr(sh, r.const(V8I16, list(range(0, 16, 2)))), r.const(V8I16, [3] * 8))
    return b.sub(b.or_(lo, b.shl(hi, r.const(V8I16, [4] * 8))), r.const(V8I16, [32] * 8))


def _iq4xs_scales(r, off):
    """An IQ4_XS super-block's 8 scales times d, and 128 times that (the bias of the
    +128 levels), <8 x float> each."""
    b = r.b
    sc = iq4xs_scale_ints(r, off)
    dsc = b.fmul(r.splat(r.f16(2, off), 8), b.sitofp(sc, V8F))
    return dsc, b.fmul(dsc, ir.Constant(V8F, [128.0] * 8))


def _iq4xs_chunk(r, off, g):
    """Weights 64 g .. 64 g + 63 of an IQ4_XS super-block (arg 2), levels + 128: sub-block
    j's 16 bytes at 8 + 16 j, low nibbles its elements 0..15, high nibbles 16..31."""
    b = r.b
    q = r.load(2, off, V32I8, 8 + 32 * g)
    lo = b.and_(q, r.splat_i8(32, 15))
    hi = b.lshr(q, r.splat_i8(32, 4))
    idx = r.shuf(lo, hi, [*range(16), *range(32, 48), *range(16, 32), *range(48, 64)])
    return iq4_lookup(r, idx)


def _k8_intrinsic(nibbles, nbytes, name):
    """The sb8 block intrinsic of a super-block format with Q4_K's scale bytes (d, dmin,
    12 bytes of 6-bit scales and mins at 0..15) and unsigned weights of at most 5 bits:
    nibbles(r, off, g) -> sub-blocks 2g and 2g + 1 as <32 x u8> each (q4_k_block8)."""

    def block(typingctx, a8, am, row, off, xb, xo, xsb, xp, s):
        def codegen(context, builder, sig, args):
            r = _IR(context, builder, sig, args)
            b = builder
            off, xo = args[3], args[5]
            _prefetch_ahead(r, off, nbytes)
            dm, sc8, mn8 = q4k_scale_bytes(r, 2, off)
            d = b.extract_element(dm, ir.Constant(I32, 0))
            dmin = b.extract_element(dm, ir.Constant(I32, 1))
            so = b.mul(args[8], ir.Constant(args[8].type, 9))
            sx = r.load(6, so, V8F)
            dx = r.load(6, so, F32, 8)
            mterm = b.fmul(b.fmul(r.splat(dmin, 8), b.uitofp(mn8, V8F)), sx)
            _acc_add(r, 1, V8F, lambda a: b.fadd(a, mterm))
            pw = r.load(7, b.mul(args[8], ir.Constant(args[8].type, 8)), _v(I16, 8))
            sc = b.mul(b.zext(sc8, _v(I16, 8)), pw)  # sc_j 2^(6 - e_j) <= 4032
            acc = None
            for g in range(4):
                for k, q in enumerate(nibbles(r, off, g)):  # sub-block 2g + k
                    xv = r.load(4, b.add(xo, ir.Constant(xo.type, 64 * g + 32 * k)), V32I8)
                    dot = r.madd16(r.maddubs(q, xv), r.shuf(sc, sc, [2 * g + k] * 16))
                    acc = dot if acc is None else b.add(acc, dot)
            df = b.sitofp(acc, V8F)
            sv = r.splat(b.fmul(d, dx), 8)
            _acc_add(r, 0, V8F, lambda a: r.fma(df, sv, a))
            return context.get_dummy_value()

        return types.void(a8, am, row, off, xb, xo, xsb, xp, s), codegen

    block.__name__ = name
    return intrinsic(block)


def q5k_nibbles(r, off, g):
    """Of the Q5_K super-block at byte off of the row (arg 2), sub-blocks 2g and 2g + 1
    as <32 x u8> each: Q4_K's nibbles of qs[32 g ..] (at 48) | bits 2g and 2g + 1 of
    qh (at 16) as bit 4."""
    b = r.b
    q = r.load(2, off, V32I8, 48 + 32 * g)
    qh = r.load(2, off, V32I8, 16)
    one, four = r.splat_i8(32, 1), r.splat_i8(32, 4)
    h = b.lshr(qh, r.splat_i8(32, 2 * g)) if g else qh
    lo = b.or_(b.and_(q, r.splat_i8(32, 15)), b.shl(b.and_(h, one), four))
    hi = b.or_(b.lshr(q, four), b.shl(b.and_(b.lshr(h, one), one), four))
    return lo, hi


# One 256-element Q4_K super-block on quantize_x_sb8's activations (the avx2 / int8
# decode path): per 32 weights one vpmaddubsw (nibbles x int8) and one vpmaddwd by the
# sub-block scale times 2^(6 - e) (<= 4032), summed in int32 lanes over the
# super-block; one convert and fma at its end. a8 lanes 0..7 collect the scaled dots,
# am lanes 0..7 the dmin m_j sx_j the caller subtracts. xsb[9 s .. 9 s + 8]: dx 2^-e
# sum(q) of each 32 elements, then dx / 64; xp[8 s .. 8 s + 8]: the 2^(6 - e).
#
# A super-block on the per-32 kernels' two-level int16 words is 16 vpmaddwd, the shifts and
# masks that make words of the nibbles, and per 64 weights two converts, two fmas and
# the scale broadcasts; here it is 8 vpmaddubsw on the nibble bytes, 8 vpmaddwd, one
# convert and one fma: 1.38-1.59x the two-level kernel on the 1.5B's shapes on avx2, one
# thread, 1.19-1.34x for batches of 2 / 4 vectors (`python benchmarks/kernel_ab.py --base
# <rev> --rows R --cols C --formats Q4_K -t 1`). The logits it costs,
# teacher-forced against float activations (`benchmarks/decode_quality.py`,
# `benchmarks/results/decode_quality_avx2.txt`): Qwen2.5-1.5B top-1 100%, KL 2.4e-4,
# NLL unchanged; Gemma 3 270M top-1 99.5%, KL 5.4e-4 (one scale per 256 without the
# powers of two, llama.cpp's q8_K: 97.8%, KL 2.1e-3).
q4_k_block8 = _k8_intrinsic(lambda r, off, g: q4k_nibbles(r, 2, off, g), 144, "q4_k_block8")
# Q5_K the same with the fifth bit: pair sums <= 2 * 31 * 127, int32 lanes <= 8 x 63.5M
q5_k_block8 = _k8_intrinsic(q5k_nibbles, 176, "q5_k_block8")


# Software prefetch distance of the matvec block intrinsics, in bytes of the weight row.
# With 8960-column rows (the 1.5B's down projection: 5 KB a row, 22 KB of activations
# filling L1) the hardware prefetchers keep too few weight lines in flight: those rows
# stream at ~17 GB/s against ~36 for the 1536-column gate without it, 38.6 (Q4_K) and 46
# (Q6_K) at 16 KB. 16 KB is the fastest whole decode on the 1.5B and 0.5B (57.0 ms per
# token against 68.2 at 8 KB and 59.2 at 32 KB on a ~20 GB/s DRAM host) and within noise
# on the small models. Re-derive: rebuild at each distance and alternate
# `python benchmarks/decode_matvecs.py -m qwen2.5-coder-1.5b` (or `kernel_ab.py --base`).
PREFETCH_BYTES = 16384
# the intrinsic's name carries its pointer type: opaque from LLVM 17, typed in older ones
_PREFETCH = "llvm.prefetch.p0" if llvm_version_info >= (17,) else "llvm.prefetch.p0i8"


def _prefetch_ahead(r, off, nbytes):
    """Prefetch (for reading, into all cache levels) the lines of the nbytes at row byte
    off + PREFETCH_BYTES. A prefetch never faults, so past the array's end is harmless."""
    b = r.b
    f = r.fn(_PREFETCH, ir.VoidType(), [I8.as_pointer(), I32, I32, I32])
    p = r.ptr(2, off, I8)
    for k in range(0, nbytes, 64):
        q = b.gep(p, [ir.Constant(I64, PREFETCH_BYTES + k)])
        b.call(f, [q, ir.Constant(I32, 0), ir.Constant(I32, 3), ir.Constant(I32, 1)])


def q4k_scale_bytes(r, i, off):
    """The Q4_K super-block at byte off of array arg i -> ([d, dmin] <2 x float>, its 8
    6-bit sub-block scales and its 8 mins as <8 x i8>)."""
    b = r.b
    dm = r.f16x(i, off, 2)  # [d, dmin]
    s = r.load(i, off, V16I8, 4)  # 12 scale bytes (+4 ignored)
    A = r.shuf(s, s, [0, 1, 2, 3])
    B = r.shuf(s, s, [4, 5, 6, 7])
    C = r.shuf(s, s, [8, 9, 10, 11])
    c63, c15 = ir.Constant(_v(I8, 4), [63] * 4), ir.Constant(_v(I8, 4), [15] * 4)
    c6, c4 = ir.Constant(_v(I8, 4), [6] * 4), ir.Constant(_v(I8, 4), [4] * 4)
    sc_lo = b.and_(A, c63)
    sc_hi = b.or_(b.and_(C, c15), b.shl(b.lshr(A, c6), c4))
    mn_lo = b.and_(B, c63)
    mn_hi = b.or_(b.lshr(C, c4), b.shl(b.lshr(B, c6), c4))
    return dm, r.concat(sc_lo, sc_hi), r.concat(mn_lo, mn_hi)


def q4k_nibbles(r, i, off, g):
    """Of the Q4_K super-block at byte off of array arg i, sub-blocks 2g and 2g + 1 as
    <32 x u8> each: the low and the high nibbles of its 32 quant bytes at 16 + 32 g."""
    q = r.load(i, off, V32I8, 16 + 32 * g)
    return r.b.and_(q, r.splat_i8(32, 15)), r.b.lshr(q, r.splat_i8(32, 4))


def _k16_block(unpack, nbytes, name):
    """The block intrinsic of a super-block format with 16 groups of 16 that each have a
    scale and a bias (x = s_k u - b_k): unpack(r, off, c) -> (weights 64 c .. 64 c + 63
    as <64 x u8>, their 4 groups' s_k and b_k as <4 x float>). xs16[so16 + k] = dx *
    sum(q_x) over the k-th 16 elements; a8 (an acc16 pointer, lanes 0..3 used) collects
    b_k xs16_k, which the caller subtracts. Q6_K's vnni layout, for Q3_K and Q2_K."""

    def block(typingctx, a16, a8, row, off, xq, xo, xds, so, xs16, so16):
        def codegen(context, builder, sig, args):
            r = _IR(context, builder, sig, args)
            b = builder
            off, xo, so = args[3], args[5], args[7]
            _prefetch_ahead(r, off, nbytes)
            for c in range(4):
                w, dsc, bias4 = unpack(r, off, c)
                dot = r.dpx(w, 4, b.add(xo, ir.Constant(xo.type, 128 * c)), 64)
                # dx of the two 32-blocks: xds[so + 4 c], xds[so + 4 c + 2]
                xd4 = r.load(6, b.add(so, ir.Constant(so.type, 4 * c)), V4F)
                sv4 = b.fmul(dsc, r.shuf(xd4, xd4, [0, 0, 2, 2]))
                sv = r.shuf(sv4, sv4, [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4)
                df = b.sitofp(dot, V16F)
                _acc_add(r, 0, V16F, lambda a, df=df, sv=sv: r.fma(df, sv, a))
                x16 = r.load(8, b.add(args[9], ir.Constant(args[9].type, 4 * c)), V4F)
                bias8 = r.shuf(b.fmul(bias4, x16), ir.Constant(V4F, [0.0] * 4), range(8))
                _acc_add(r, 1, V8F, lambda a, bias8=bias8: b.fadd(a, bias8))
            return context.get_dummy_value()

        return types.void(a16, a8, row, off, xq, xo, xds, so, xs16, so16), codegen

    block.__name__ = name
    return intrinsic(block)


def _crumb_pair(r, ql, c):
    """The 2-bit fields of chunk c (64 elements) of a K-quant super-block half: shifts
    2 s and 2 s + 2 (s = 2 (c & 1)) of its 32 qs bytes ql, as two <32 x u8>."""
    b = r.b
    s0 = 4 * (c & 1)
    three = r.splat_i8(32, 3)
    qa = b.and_(b.lshr(ql, r.splat_i8(32, s0)) if s0 else ql, three)
    qb = b.and_(b.lshr(ql, r.splat_i8(32, s0 + 2)), three)
    return qa, qb


def _unpack_q3k(r, off, c):
    """Chunk c of a Q3_K super-block: weights q2 + 4 hbit (0..7), scales d (sc - 32), bias
    4 d (sc - 32) (a clear hmask bit is -4)."""
    b = r.b
    h = c >> 1
    qa, qb = _crumb_pair(r, r.load(2, off, V32I8, 32 + 32 * h), c)
    hm = r.load(2, off, V32I8)
    one, two = r.splat_i8(32, 1), r.splat_i8(32, 2)
    ja = 4 * h + 2 * (c & 1)  # hmask bit of the chunk's first 32 elements
    ha = b.and_(b.lshr(hm, r.splat_i8(32, ja)) if ja else hm, one)
    hb = b.and_(b.lshr(hm, r.splat_i8(32, ja + 1)), one)
    w = r.concat(b.or_(qa, b.shl(ha, two)), b.or_(qb, b.shl(hb, two)))
    V4I8 = _v(I8, 4)
    lo = r.load(2, off, V4I8, 96 + 4 * (c & 1))
    if c >> 1:
        lo = b.lshr(lo, ir.Constant(V4I8, [4] * 4))
    lo = b.and_(lo, ir.Constant(V4I8, [15] * 4))
    hi = r.load(2, off, V4I8, 104)
    if c:
        hi = b.lshr(hi, ir.Constant(V4I8, [2 * c] * 4))
    hi = b.shl(b.and_(hi, ir.Constant(V4I8, [3] * 4)), ir.Constant(V4I8, [4] * 4))
    sc = b.sub(b.or_(lo, hi), ir.Constant(V4I8, [32] * 4))
    dsc = b.fmul(r.splat(r.f16(2, off, 108), 4), b.sitofp(sc, V4F))
    return w, dsc, b.fmul(dsc, ir.Constant(V4F, [4.0] * 4))


def _unpack_q2k(r, off, c):
    """Chunk c of a Q2_K super-block: weights 0..3, scales d (sc & 15), bias
    dmin (sc >> 4)."""
    b = r.b
    qa, qb = _crumb_pair(r, r.load(2, off, V32I8, 16 + 32 * (c >> 1)), c)
    V4I8 = _v(I8, 4)
    sc = r.load(2, off, V4I8, 4 * c)
    dm = r.f16x(2, off, 2, 80)  # [d, dmin]
    d4 = r.shuf(dm, dm, [0] * 4)
    m4 = r.shuf(dm, dm, [1] * 4)
    s4 = b.uitofp(b.and_(sc, ir.Constant(V4I8, [15] * 4)), V4F)
    mn4 = b.uitofp(b.lshr(sc, ir.Constant(V4I8, [4] * 4)), V4F)
    return r.concat(qa, qb), b.fmul(d4, s4), b.fmul(m4, mn4)


q3_k_block = _k16_block(_unpack_q3k, 110, "q3_k_block")
q2_k_block = _k16_block(_unpack_q2k, 84, "q2_k_block")

# One 256-element IQ4_XS super-block: d (sc_j - 32) per 32 weights, 128 times that sx_j
# into a8.
iq4_xs_block = _k4_block(_iq4xs_scales, _iq4xs_chunk, 136, "iq4_xs_block")


def _q6k_super_scale(r, off):
    """Prefetch ahead of the Q6_K super-block at byte off of the row (arg 2) and return
    its scale d (the f16 at byte 208) as a float."""
    _prefetch_ahead(r, off, 210)
    return r.f16(2, off, 208)


@intrinsic
def q6_k_block8(typingctx, a8, am, row, off, xb, xo, xsb, xp, s, bs):
    """One 256-element Q6_K super-block on quantize_x_sb8's activations (the avx2 / int8
    decode path), as q4_k_block8: per 32 weights one vpmaddubsw (6-bit weights
    0..63 x int8, pair sums <= 16002) and one vpmaddwd by the two 16-element sub-block
    scales times 2^(6 - e) (|sc 2^(6-e)| <= 8192), summed in int32 lanes over the
    super-block (<= 8 x 262M); one convert and FMA at its end. The -32 offset: am
    collects 32 d dx/64 sum_j sc_j 2^(6 - e) bs_j, one vpmaddwd of the scales with the
    per-16 sums of q (bs int16 [16 s ..], sums16_sb8), which the caller subtracts.
    xsb, xp as q4_k_block8's."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        off, xo, s_ = args[3], args[5], args[8]
        d = _q6k_super_scale(r, off)
        V16I16 = _v(I16, 16)
        sc16 = b.sext(r.load(2, off, V16I8, 192), V16I16)
        pw8 = r.load(7, b.mul(s_, ir.Constant(s_.type, 8)), _v(I16, 8))
        scp = b.mul(sc16, r.shuf(pw8, pw8, [i // 2 for i in range(16)]))
        acc = None
        for c, w in enumerate(q6k_chunks(r, off)):
            for k in range(2):
                j = 2 * c + k  # 32-element block of the super-block
                w32 = r.shuf(w, w, range(32 * k, 32 * k + 32))
                x32 = r.load(4, b.add(xo, ir.Constant(xo.type, 32 * j)), V32I8)
                sv = r.shuf(scp, scp, [2 * j] * 8 + [2 * j + 1] * 8)
                dot = r.madd16(r.maddubs(w32, x32), sv)
                acc = dot if acc is None else b.add(acc, dot)
        bsum = r.madd16(scp, r.load(9, b.mul(s_, ir.Constant(s_.type, 16)), V16I16))
        so = b.add(b.mul(s_, ir.Constant(s_.type, 9)), ir.Constant(s_.type, 8))
        sv = r.splat(b.fmul(d, r.load(6, so, F32)), 8)  # d dx / 64
        df = b.sitofp(acc, V8F)
        _acc_add(r, 0, V8F, lambda a: r.fma(df, sv, a))
        bf = b.fmul(b.sitofp(bsum, V8F), ir.Constant(V8F, [32.0] * 8))
        _acc_add(r, 1, V8F, lambda a: r.fma(bf, sv, a))
        return context.get_dummy_value()

    return types.void(a8, am, row, off, xb, xo, xsb, xp, s, bs), codegen


def q6k_chunks(r, off):
    """The super-block's 4 chunks of 64 weights (u8 0..63) in element order."""
    out = []
    for h in range(2):
        ql = r.load(2, off, V64I8, 64 * h)
        qh = r.load(2, off, V32I8, 128 + 32 * h)
        out += [_q6k_chunk(r, ql, qh, p) for p in range(2)]
    return out


def _q6k_chunk(r, ql, qh, p):
    """Of one half of a Q6_K super-block (ql: its 64 low-nibble bytes, qh: its 32
    high-bit bytes), the 6-bit weights of 32-element chunks 2p and 2p + 1 as u8 0..63."""
    b = r.b
    if p == 0:
        lo = b.and_(ql, r.splat_i8(64, 15))
        qhv = r.concat(qh, b.lshr(qh, r.splat_i8(32, 2)))
    else:
        lo = b.lshr(ql, r.splat_i8(64, 4))
        qhv = r.concat(b.lshr(qh, r.splat_i8(32, 4)), b.lshr(qh, r.splat_i8(32, 6)))
    qhv = b.shl(b.and_(qhv, r.splat_i8(64, 3)), r.splat_i8(64, 4))
    return b.or_(lo, qhv)


def _lowbit_bytes(r, off, bits):
    """edgerun's Q2_G64 / Q3_G64 block at byte off of arg 2 -> its 64 values as
    <64 x i8> in element order (element 16 s + l: bits 2s..2s+1 of ql[l], for 3 bits
    | bit 2s + (l >> 3) of qh[l & 7] as bit 2; edgerun.quant.lowbit)."""
    b = r.b
    ql = r.load(2, off, V16I8, 4)
    if bits == 3:
        qh = r.load(2, off, _v(I8, 8), 20)
        h16 = r.concat(qh, b.lshr(qh, r.splat_i8(8, 1)))  # lane l: qh[l & 7] >> (l >> 3)
    parts = []
    for s_ in range(4):
        p = b.and_(b.lshr(ql, r.splat_i8(16, 2 * s_)) if s_ else ql, r.splat_i8(16, 3))
        if bits == 3:  # bit 2s of h16 -> bit 2
            h = {0: b.shl(h16, r.splat_i8(16, 2)), 1: h16}.get(s_)
            if h is None:
                h = b.lshr(h16, r.splat_i8(16, 2 * s_ - 2))
            p = b.or_(p, b.and_(h, r.splat_i8(16, 4)))
        parts.append(p)
    return r.concat(r.concat(parts[0], parts[1]), r.concat(parts[2], parts[3]))


def _unpack_g64(bits):
    def unpack(r, off):
        """One 64-element block (x = d q + m): as a Q4_1 pair of two 32-element x blocks
        sharing d and m."""
        dm = r.f16x(2, off, 2)  # [d, m]
        lanes = _SV_SHARED  # one dx per 64 (quantize_x1)
        return _lowbit_bytes(r, off, bits), r.shuf(dm, dm, [0, 1, 0, 1]), lanes

    return unpack


def _lowbit_block(bits):
    nbytes = 20 if bits == 2 else 28
    return _pair_intrinsic(_unpack_g64(bits), f"q{bits}_g64_block", nbytes, x1=True)


q2_g64_block = _lowbit_block(2)
q3_g64_block = _lowbit_block(3)


# --------------------------------------------------------------- batched decode blocks
# A batch of G decode vectors runs each block intrinsic once per vector with that
# vector's activations, scales and accumulators: the same IR, so every vector gets the
# single kernel's float operations (bit-identical rows). The G copies load and unpack the
# same weight bytes, and LLVM merges them (the accumulators are registers, nothing
# stores in between): each block is unpacked once for all vectors. Block pairs (and
# the G64 blocks) go further (_pair_batch): one unpack, and the scale products and bias
# sums of all the vectors in one vector operation each.
KIND_Q8_0, KIND_Q4_0, KIND_Q4_1, KIND_Q5_0, KIND_Q4_K, KIND_Q6_K = 3, 4, 5, 6, 7, 8


KIND_Q3_G64, KIND_Q2_G64 = 9, 10  # edgerun's own formats (edgerun.quant.lowbit)
KIND_Q5_1, KIND_Q2_K, KIND_Q3_K, KIND_Q5_K, KIND_IQ4_NL, KIND_IQ4_XS = 11, 12, 13, 14, 15, 16


# the super-block formats of _k4_block (scale and bias per 32): Q4_K's decode layout
_K4_KINDS = (KIND_Q4_K, KIND_Q5_K, KIND_IQ4_XS)


@njit(inline="always")
def k4_kind(kind):
    """Whether a format decodes as _k4_block's super-blocks (_K4_KINDS)."""
    return kind == KIND_Q4_K or kind == KIND_Q5_K or kind == KIND_IQ4_XS


_X1_KINDS = (KIND_Q5_0, KIND_Q3_G64, KIND_Q2_G64)  # X1's formats


@njit(inline="always")
def x1_span(kind):
    """Elements per activation scale of X1's formats (_X1_KINDS; quantize_x1's span), 0
    for the others."""
    if kind == KIND_Q5_0:
        return 32
    return 64 if kind == KIND_Q3_G64 or kind == KIND_Q2_G64 else 0


@njit(inline="always")
def x1_kind(kind):
    """Whether a format is one of X1's: its x is quantize_xn's single level."""
    return x1_span(kind) != 0


@njit(inline="always")
def x_bytes(kind):
    """Bytes of one vector's activations per element for a format's kernels."""
    return 1 if x1_kind(kind) else 2


@njit(inline="always")
def row_layout(kind):
    """(elements per block, nib2 x layout) of a block format's rows."""
    if k4_kind(kind) or kind == KIND_Q6_K or kind == KIND_Q3_K or kind == KIND_Q2_K:
        return 256, False
    if kind == KIND_Q3_G64 or kind == KIND_Q2_G64:
        return 64, False
    return 32, kind != KIND_Q8_0


@njit(inline="always")
def _unit_bytes(kind):
    if kind == KIND_Q4_K:
        return 144
    if kind == KIND_Q5_K:
        return 176
    if kind == KIND_IQ4_XS:
        return 136
    if kind == KIND_Q6_K:
        return 210
    if kind == KIND_Q5_1:
        return 24
    if kind == KIND_Q3_K:
        return 110
    if kind == KIND_Q2_K:
        return 84
    if kind == KIND_Q8_0:
        return 34
    if kind == KIND_Q5_0:
        return 22
    if kind == KIND_Q4_1 or kind == KIND_Q2_G64:
        return 20
    if kind == KIND_Q3_G64:
        return 28
    return 18
