"""Prefill GEMM for the K-quants (Q4_K, Q5_K, Q6_K, Q3_K, Q2_K) and IQ4_XS on int16 words:
integer accumulation over super-blocks.

`int8.mm_int8` scales every int32 lane in float (a convert, a multiply of the
weight and activation scales, an fma per 8 lanes and token), because its activations
have one scale per 32 elements. Here each token has one activation scale per 256-element
super-block, and the K-quant sub-block scales are folded into the weights when a row is
unpacked (once per matmul, shared by all tokens): int16 w = q * sc (Q4_K, <= 945) or
(q - 32) * sc (Q6_K, |w| <= 4096). A super-block is then 16 `vpmaddwd` + 16 `vpaddd` per
token on int32 lanes, and one convert + fma at its end:
    y[t, r] = sum_s d_rs dx'_ts dot_s(w, xw_t) - sum_j dmin m_j sx_tj (Q4_K mins)
The activations are quantize_x's two levels as int16 words 128 q1 + q2 (|v| <= 16320)
in element order, with dx = max|x| / 127 over the super-block
(`qmatvec.quantize_x_reference(x, 256)`). Lane sums stay exact in
int32: 32 products per lane of at most 4096 * 16320 (Q6_K) is < 2^31.

At 128 tokens on Qwen2.5-1.5B's shapes it runs 1.4-2.4x the per-32 GEMM on avx2 and
1.3-2.1x the per-32 vpdpbusd GEMM on vnni (`python benchmarks/superblock_gemm.py -t 2`,
`benchmarks/results/superblock_gemm.txt`).
Its int16 dot is `vpdpwssd` zmm on the "vnni" path and int8's `_IR.madd16`
elsewhere (vpmaddwd on "avx2", generic IR on "int8"); qmatvec routes every int8 path's
K-quant prefill here, except Q5_K, IQ4_XS, Q3_K and Q2_K on "vnni", which take the byte
GEMM (int8.superblock_bytes: vpdpbusd, 1.3-1.8x this one). The other formats fold their
scales the same way (prep_sb: Q5_K q * sc with Q4_K's mins, IQ4_XS level * sc, Q3_K
(q - 4) * sc, Q2_K q * sc with a bias per 16 elements); at 128 tokens on Qwen2.5-1.5B's
shapes they run 1.4-2.6x the per-32 GEMM (one thread, CPU time, Zen 4).
On "vnni" a step takes 4 weight rows for 4 tokens (gemm_rows_sb: each token's words
loaded once for the 4 rows, 16 zmm accumulators of the 32): 1.05-1.2x one row a step
on Zen 4, one thread; 2 or 3 rows a step gain less.
Tried: two weight rows per step, each token's words loaded once for both (0.81-0.85x on
avx2, 64 tokens, one thread: more live registers than loads saved).
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops._simd import tree_sum16  # noqa: E402
from edgerun.ops.int8.activations import (  # noqa: E402
    amax32,
)
from edgerun.ops.int8.blocks import (  # noqa: E402
    KIND_IQ4_XS,
    KIND_Q2_K,
    KIND_Q3_K,
    KIND_Q4_K,
    KIND_Q5_K,
    KIND_Q6_K,
    iq4_xs_block,
    iq4xs_scale_ints,
    q4k_nibbles,
    q4k_scale_bytes,
    q5k_nibbles,
)
from edgerun.ops.int8.gemm import (  # noqa: E402
    fma16,
    hsum4x16,
    q6_half_bytes,
)
from edgerun.ops.int8.ir import (  # noqa: E402
    _IR,
    F0,
    I16,
    I32,
    V8F,
    V8I32,
    V16F,
    V16I8,
    V16I32,
    V32I8,
    _acc_add,
    _store,
    _v,
    acc4,
    acc16,
)
from edgerun.ops.int8.ir import DOT as _DOT  # noqa: E402
from edgerun.ops.portable.kernels import _f16at  # noqa: E402

SUPER = 256  # elements per K-quant super-block (one activation scale each)
_RB = 16  # weight rows unpacked per parallel task
_SPAN = 6  # super-blocks per column span (1536 columns)
_ROWS = 4  # weight rows per step of the vnni GEMM (gemm_rows_sb)
V16I16, V32I16, V128I16 = _v(I16, 16), _v(I16, 32), _v(I16, 128)
V8I16, V64I16 = _v(I16, 8), _v(I16, 64)


# ------------------------------------------------------------------ activations
@intrinsic
def qwords16(typingctx, x, xo, xw, wo, d, inv, inv2):
    """16 elements x[xo:xo+16] -> int16 words 128 q1 + q2 at xw[wo:wo+16] (element
    order), q1 = rint(x * inv), q2 = rint((x - q1 * d) * inv2); returns their sum."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        rint = r.fn("llvm.rint.v16f32", V16F, [V16F])
        v = r.load(0, args[1], V16F)
        dv, iv, i2 = (r.splat(args[k], 16) for k in (4, 5, 6))
        a = b.call(rint, [b.fmul(v, iv)])
        c = b.call(rint, [b.fmul(b.fsub(v, b.fmul(a, dv)), i2)])
        t = b.add(b.shl(b.fptosi(a, V16I32), ir.Constant(V16I32, [7] * 16)), b.fptosi(c, V16I32))
        _store(r, 2, args[3], b.trunc(t, V16I16))
        red = r.fn("llvm.vector.reduce.add.v16i32", I32, [V16I32])
        return b.call(red, [t])

    return types.int32(x, xo, xw, wo, d, inv, inv2), codegen


@njit(parallel=True, cache=True, nogil=True)
def quantize_tokens_sb(X, n4):
    """Rows of X [n, cols] (cols % 256 == 0) -> words xw int16 [n4, cols], the scale
    dx' = dx / 128 of every super-block xsb [n4, cols // 256] and the 16-element sums
    dx' * sum(words) xs16 [n4, cols // 16 rounded up to 16]; padding tokens are zero."""
    n, cols = X.shape
    nsb = cols // SUPER
    xw = np.zeros((n4, cols), np.int16)
    xsb = np.zeros((n4, nsb), np.float32)
    xs16 = np.zeros((n4, (cols // 16 + 15) // 16 * 16), np.float32)
    for t in prange(n):
        x = X[t]
        w = xw[t]
        for s in range(nsb):
            amax = F0
            for j in range(8):
                amax = max(amax, amax32(x, s * SUPER + 32 * j))
            d = amax / np.float32(127.0)
            inv = np.float32(1.0) / d if d != F0 else F0
            inv2 = inv * np.float32(128.0)
            d2 = d / np.float32(128.0)
            for k in range(16):
                o = s * SUPER + 16 * k
                xs16[t, s * 16 + k] = d2 * np.float32(qwords16(x, o, w, o, d, inv, inv2))
            xsb[t, s] = d2
    return xw, xsb, xs16


# ------------------------------------------------------------------ weight rows
def q4k_sb_words(r, flat_i, off, wd_i, so, b16_i, bo, put):
    """IR of one Q4_K super-block at array arg flat_i, byte off: stores d at wd[so] and
    -dmin * m of each 16 elements at b16[bo:bo+16], and hands each 32 weights' int16
    q * sc (element order) to put(element offset, <32 x i16>)."""
    b = r.b
    dm, sc8, mn8 = q4k_scale_bytes(r, flat_i, off)
    d = b.extract_element(dm, ir.Constant(I32, 0))
    dmin = b.extract_element(dm, ir.Constant(I32, 1))
    b.store(d, r.ptr(wd_i, so, ir.FloatType()))
    mins = b.fmul(r.splat(dmin, 8), b.uitofp(mn8, V8F))
    neg = b.fsub(ir.Constant(V8F, [-0.0] * 8), mins)  # -(dmin m): an exact negation
    _store(r, b16_i, bo, r.shuf(neg, neg, [k // 2 for k in range(16)]))
    sc = b.zext(sc8, _v(I16, 8))
    for g in range(4):  # sub-blocks 2g (low nibbles) and 2g + 1 (high nibbles)
        for k, v in enumerate(q4k_nibbles(r, flat_i, off, g)):
            sv = r.shuf(sc, sc, [2 * g + k] * 32)
            put(64 * g + 32 * k, b.mul(b.zext(v, V32I16), sv))


@intrinsic
def prep_q4k_sb(typingctx, W, wo, wd, so, b16, bo, flat, o):
    """One Q4_K super-block at flat[o] -> W[wo:wo+256] (int16 q * sc, element order),
    wd[so] = d and b16[bo:bo+16] = -dmin * m of each 16 elements, in vector operations
    (a scalar unpack of the 8 scales and 16 bias stores is ~14% of a 128-token
    matmul)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        wo = args[1]

        def put(k, v):
            _store(r, 0, builder.add(wo, ir.Constant(wo.type, k)), v)

        q4k_sb_words(r, 6, args[7], 2, args[3], 4, args[5], put)
        return context.get_dummy_value()

    return types.void(W, wo, wd, so, b16, bo, flat, o), codegen


def q6k_half_words(r, flat_i, off, hv):
    """IR of half hv (0 or 1) of the Q6_K super-block at array arg flat_i, byte off:
    <128 x i16> (q - 32) * sc in element order, sc the int8 scale of each 16."""
    b = r.b
    q = b.zext(q6_half_bytes(r, flat_i, off, 64 * hv, off, 128 + 32 * hv), V128I16)
    sc8 = b.sext(r.load(flat_i, off, _v(ir.IntType(8), 8), 192 + 8 * hv), _v(I16, 8))
    sc = r.shuf(sc8, sc8, [k // 16 for k in range(128)])
    return b.mul(b.sub(q, ir.Constant(V128I16, [32] * 128)), sc)


@intrinsic
def st_q6k128(typingctx, W, wo, flat, o, h):
    """Q6_K half h (a literal 0 or 1) of the super-block at flat[o]: W[wo:wo+128] =
    (q - 32) * sc (int16, element order), sc the int8 scale of each 16 elements."""
    if not isinstance(h, types.IntegerLiteral):
        return None
    hv = h.literal_value

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        _store(r, 0, args[1], q6k_half_words(r, 2, args[3], hv))
        return context.get_dummy_value()

    return types.void(W, wo, flat, o, h), codegen


# The other K-quant formats, on the same words: (d, the -bias of each 16 elements or
# None, the int16 words of each 64 elements) of the super-block at byte off of array
# arg 2 (the layout the blocks' chunk helpers read). Lane sums stay exact in int32 as
# for Q6_K: |w| <= 1953 (Q5_K: q * sc, 31 * 63), 4064 (IQ4_XS: level * (ls - 32)), 128
# (Q3_K: (q - 4) * (sc - 32)), 45 (Q2_K: q * (sc & 15)).
def _scale64(r, sc16, k0, k1):
    """<64 x i16> of scale k0 for the first 32 elements and k1 for the last 32 (sc16 a
    vector of i16 scales)."""
    return r.shuf(sc16, sc16, [k0] * 32 + [k1] * 32)


def _q5k_words(r, off):
    """Q5_K: w = q * sc (q 0..31), bias -dmin m per 32 elements (Q4_K's scale bytes)."""
    b = r.b
    dm, sc8, mn8 = q4k_scale_bytes(r, 2, off)
    d = b.extract_element(dm, ir.Constant(I32, 0))
    dmin = b.extract_element(dm, ir.Constant(I32, 1))
    neg = b.fsub(ir.Constant(V8F, [-0.0] * 8), b.fmul(r.splat(dmin, 8), b.uitofp(mn8, V8F)))
    sc = b.zext(sc8, V8I16)
    words = [
        b.mul(b.zext(r.concat(*q5k_nibbles(r, off, g)), V64I16), _scale64(r, sc, 2 * g, 2 * g + 1))
        for g in range(4)
    ]
    return d, r.shuf(neg, neg, [k // 2 for k in range(16)]), words


def _iq4xs_words(r, off):
    """IQ4_XS: w = level * (ls - 32), ls the 6-bit scale of each 32 elements (low 4 bits
    in scales_l at byte 4, high 2 in scales_h at byte 2); no bias."""
    b = r.b
    sc = iq4xs_scale_ints(r, off)
    c128 = ir.Constant(V64I16, [128] * 64)
    words = []
    for g in range(4):  # the chunk holds level + 128 as u8
        lv = b.sub(b.zext(iq4_xs_block.chunk(r, off, g), V64I16), c128)
        words.append(b.mul(lv, _scale64(r, sc, 2 * g, 2 * g + 1)))
    return r.f16(2, off), None, words


def _crumbs64(r, q32, j):
    """The 2-bit fields at shifts j and j + 2 of the 32 bytes q32, one after the other:
    <64 x i8>, each 0..3 (elements 64 k .. 64 k + 63 of a half for j = 4 k)."""
    b = r.b
    three = r.splat_i8(32, 3)
    a = b.and_(b.lshr(q32, r.splat_i8(32, j)) if j else q32, three)
    c = b.and_(b.lshr(q32, r.splat_i8(32, j + 2)), three)
    return r.concat(a, c)


def _q3k_words(r, off):
    """Q3_K (hmask[32] at 0, qs[64] at 32, 12 scale bytes at 96, d at 108): w = (q2 + 4
    hbit - 4) * (sc - 32), sc the 6-bit scale of each 16 elements; no bias."""
    b = r.b
    s = r.load(2, off, V16I8, 96)  # 12 scale bytes (+4 ignored)
    lo = r.shuf(s, s, [*range(8), *range(8)])
    lo = b.and_(b.lshr(lo, r.const(V16I8, [0] * 8 + [4] * 8)), r.splat_i8(16, 15))
    hi = r.shuf(s, s, [8, 9, 10, 11] * 4)
    hi = b.lshr(hi, r.const(V16I8, [0] * 4 + [2] * 4 + [4] * 4 + [6] * 4))
    hi = b.and_(hi, r.splat_i8(16, 3))
    sc8 = b.sub(b.or_(lo, b.shl(hi, r.splat_i8(16, 4))), r.splat_i8(16, 32))
    sc = b.sext(sc8, V16I16)
    hm = r.load(2, off, V32I8)
    one = r.splat_i8(32, 1)
    words = []
    for h in range(2):
        q32 = r.load(2, off, V32I8, 32 + 32 * h)
        for k in range(2):  # elements 128 h + 64 k ..: bit fields 4k, 4k + 2
            u = _crumbs64(r, q32, 4 * k)
            j = 4 * h + 2 * k  # hmask bit of the first 32
            ha = b.and_(b.lshr(hm, r.splat_i8(32, j)) if j else hm, one)
            hb = b.and_(b.lshr(hm, r.splat_i8(32, j + 1)), one)
            u = b.or_(u, b.shl(r.concat(ha, hb), r.splat_i8(64, 2)))
            v = b.sub(b.zext(u, V64I16), ir.Constant(V64I16, [4] * 64))
            g = 8 * h + 4 * k  # scale of the first 16
            words.append(
                b.mul(v, r.shuf(sc, sc, [g] * 16 + [g + 1] * 16 + [g + 2] * 16 + [g + 3] * 16))
            )
    return r.f16(2, off, 108), None, words


def _q2k_words(r, off):
    """Q2_K (scales[16] at 0, qs[64] at 16, d, dmin at 80): w = q * (sc & 15), bias
    -dmin (sc >> 4) per 16 elements."""
    b = r.b
    s = r.load(2, off, V16I8)
    dm = r.f16x(2, off, 2, 80)
    d = b.extract_element(dm, ir.Constant(I32, 0))
    dmin = b.extract_element(dm, ir.Constant(I32, 1))
    mn = b.uitofp(b.lshr(s, r.splat_i8(16, 4)), V16F)
    neg = b.fsub(ir.Constant(V16F, [-0.0] * 16), b.fmul(r.splat(dmin, 16), mn))
    sc = b.zext(b.and_(s, r.splat_i8(16, 15)), V16I16)
    words = []
    for h in range(2):
        q32 = r.load(2, off, V32I8, 16 + 32 * h)
        for k in range(2):
            u = b.zext(_crumbs64(r, q32, 4 * k), V64I16)
            g = 8 * h + 4 * k
            words.append(
                b.mul(u, r.shuf(sc, sc, [g] * 16 + [g + 1] * 16 + [g + 2] * 16 + [g + 3] * 16))
            )
    return d, neg, words


_WORDS = {
    KIND_Q5_K: _q5k_words,
    KIND_IQ4_XS: _iq4xs_words,
    KIND_Q3_K: _q3k_words,
    KIND_Q2_K: _q2k_words,
}


@intrinsic
def prep_sb(typingctx, W, wo, flat, o, wd, so, b16, bo, kind):
    """One super-block of a Q5_K, IQ4_XS, Q3_K or Q2_K row (kind a literal) at flat[o] ->
    W[wo:wo+256] (int16 words, scales folded in, element order), wd[so] = d and, for the
    kinds with a bias, b16[bo:bo+16] = the bias of each 16 elements."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    words_of = _WORDS[kind.literal_value]

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        d, bias, words = words_of(r, args[3])
        builder.store(d, r.ptr(4, args[5], ir.FloatType()))
        if bias is not None:
            _store(r, 6, args[7], bias)
        for g, v in enumerate(words):
            _store(r, 0, builder.add(args[1], ir.Constant(args[1].type, 64 * g)), v)
        return context.get_dummy_value()

    return types.void(W, wo, flat, o, wd, so, b16, bo, kind), codegen


@njit(cache=True, nogil=True)
def has_bias(kind):
    """Whether the kind's rows carry a bias per 16 elements (b16): Q4_K, Q5_K, Q2_K."""
    return kind == KIND_Q4_K or kind == KIND_Q5_K or kind == KIND_Q2_K


@njit(cache=True, nogil=True)
def prep_row_sb(kind, flat, base, cols, W, wd, b16):
    """Unpack one weight row: W int16 [cols] weights with the sub-block scales folded in,
    wd [cols // 256] the super-block scales d, b16 [cols // 16] the bias of each 16
    elements (Q4_K, Q5_K: -dmin * m; Q2_K: -dmin * (sc >> 4); the others: none, their
    offsets folded into W)."""
    nsb = cols // SUPER
    if kind == KIND_Q4_K:
        for s in range(nsb):
            prep_q4k_sb(W, s * SUPER, wd, s, b16, s * 16, flat, base + s * 144)
    elif kind == KIND_Q5_K:
        for s in range(nsb):
            prep_sb(W, s * SUPER, flat, base + s * 176, wd, s, b16, s * 16, KIND_Q5_K)
    elif kind == KIND_IQ4_XS:
        for s in range(nsb):
            prep_sb(W, s * SUPER, flat, base + s * 136, wd, s, b16, s * 16, KIND_IQ4_XS)
    elif kind == KIND_Q3_K:
        for s in range(nsb):
            prep_sb(W, s * SUPER, flat, base + s * 110, wd, s, b16, s * 16, KIND_Q3_K)
    elif kind == KIND_Q2_K:
        for s in range(nsb):
            prep_sb(W, s * SUPER, flat, base + s * 84, wd, s, b16, s * 16, KIND_Q2_K)
    else:
        for s in range(nsb):
            o = base + s * 210
            wd[s] = _f16at(flat, o + 208)
            st_q6k128(W, s * SUPER, flat, o, 0)
            st_q6k128(W, s * SUPER + 128, flat, o, 1)


# ------------------------------------------------------------------------ GEMM
def _dot_vpdpwssd(r, wo, xts):
    """AVX512-VNNI: the 4 tokens' super-block dots as <8 x i32>, from 8 vpdpwssd on 32
    words each. Lane j of the 16 holds elements 32g + 2j, 32g + 2j + 1; adding the two
    halves gives the lanes of the 16 vpmaddwd on 16 words (elements 16g + 2j, + 1), and
    int32 sums are exact, so the result is the other branch's bit for bit."""
    b = r.b
    f = r.fn("llvm.x86.avx512.vpdpwssd.512", V16I32, [V16I32, V16I32, V16I32])
    acc = [ir.Constant(V16I32, [0] * 16)] * 4
    for g in range(8):
        wv = b.bitcast(r.load(4, b.add(wo, ir.Constant(wo.type, 32 * g)), V32I16), V16I32)
        for t in range(4):
            xv = r.load(7, b.add(xts[t], ir.Constant(xts[t].type, 32 * g)), V32I16)
            acc[t] = b.call(f, [acc[t], wv, b.bitcast(xv, V16I32)])
    return [b.add(r.shuf(a, a, range(8)), r.shuf(a, a, range(8, 16))) for a in acc]


@intrinsic
def gemm4_sb(typingctx, a0, a1, a2, a3, W, wo, wd, xw, xo, xstride, xsb, so, sstride):
    """One super-block of one row for 4 tokens: a_t[0:8] += cvt(sum of vpmaddwd of
    W[wo:wo+256] with xw[xo + t*xstride:][:256]) * (wd * xsb[so + t*sstride])."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        wo, xo, xs, so, ss = args[5], args[8], args[9], args[11], args[12]
        xts = [b.add(xo, b.mul(xs, ir.Constant(xs.type, t))) for t in range(4)]
        if _DOT == "vnni":  # 8 vpdpwssd zmm per token: multiply, pair-add and accumulate
            acc = _dot_vpdpwssd(r, wo, xts)
        else:
            acc = [ir.Constant(V8I32, [0] * 8)] * 4
            for g in range(16):
                wv = r.load(4, b.add(wo, ir.Constant(wo.type, 16 * g)), V16I16)
                for t in range(4):
                    xv = r.load(7, b.add(xts[t], ir.Constant(xs.type, 16 * g)), V16I16)
                    acc[t] = b.add(acc[t], r.madd16(wv, xv))
        for t in range(4):
            sx = r.load(10, b.add(so, b.mul(ss, ir.Constant(ss.type, t))), ir.FloatType())
            sv = r.splat(b.fmul(args[6], sx), 8)
            df = b.sitofp(acc[t], V8F)
            _acc_add(r, t, V8F, lambda a, df=df, sv=sv: r.fma(df, sv, a))
        return context.get_dummy_value()

    return types.void(a0, a1, a2, a3, W, wo, wd, xw, xo, xstride, xsb, so, sstride), codegen


@intrinsic
def gemm_rows_sb(
    typingctx, acc, W, wo, ws, wd, do, ds, xw, xo, xs, xsb, so, ss,
    b16, bo, bs, x16, x16o, x16s, nrows, bias,
):  # fmt: skip
    """AVX512-VNNI: one super-block of nrows (a literal) weight rows for 4 tokens: with
    a_rt = acc[16 (4 r + t):][:16], w_r = W[wo + r ws:][:256], x_t = xw[xo + t xs:][:256],
        a_rt += cvt(dot16(w_r, x_t)) * wd[do + r ds] * xsb[so + t ss]
    (dot16: the 16 int32 lanes of 8 vpdpwssd) and, where bias (a literal bool), the
    16-element groups' biases a_rt += b16[bo + r bs:][:16] * x16[x16o + t x16s:][:16].
    Each token's words are loaded once for all the rows (gemm4_sb loads them once per
    row): nrows * 4 int32 accumulators, nrows + 1 loads per nrows * 4 vpdpwssd."""
    if not isinstance(nrows, types.IntegerLiteral) or not isinstance(bias, types.BooleanLiteral):
        return None
    nr, with_bias = nrows.literal_value, bias.literal_value

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        wo, ws, do, ds, xo, xs, so, ss = (args[k] for k in (2, 3, 5, 6, 8, 9, 11, 12))
        bo, bs, x16o, x16s = (args[k] for k in (14, 15, 17, 18))

        def at(base, stride, k):
            return b.add(base, b.mul(stride, ir.Constant(stride.type, k))) if k else base

        f = r.fn("llvm.x86.avx512.vpdpwssd.512", V16I32, [V16I32, V16I32, V16I32])
        dots = [[ir.Constant(V16I32, [0] * 16)] * 4 for _ in range(nr)]
        wrow = [at(wo, ws, i) for i in range(nr)]
        xtok = [at(xo, xs, t) for t in range(4)]
        for g in range(8):
            wv = [
                b.bitcast(r.load(1, b.add(wrow[i], ir.Constant(wo.type, 32 * g)), V32I16), V16I32)
                for i in range(nr)
            ]
            for t in range(4):
                xv = r.load(7, b.add(xtok[t], ir.Constant(xo.type, 32 * g)), V32I16)
                xv = b.bitcast(xv, V16I32)
                for i in range(nr):
                    dots[i][t] = b.call(f, [dots[i][t], wv[i], xv])
        sx = [r.load(10, at(so, ss, t), ir.FloatType()) for t in range(4)]
        xb = [r.load(16, at(x16o, x16s, t), V16F) for t in range(4)] if with_bias else []
        for i in range(nr):
            dr = r.load(4, at(do, ds, i), ir.FloatType())
            bv = r.load(13, at(bo, bs, i), V16F) if with_bias else None
            for t in range(4):
                p = r.ptr(0, ir.Constant(I32, 16 * (4 * i + t)), V16F)
                a = b.load(p, align=4)
                a = r.fma(b.sitofp(dots[i][t], V16F), r.splat(b.fmul(dr, sx[t]), 16), a)
                if with_bias:
                    a = r.fma(bv, xb[t], a)
                b.store(a, p, align=4)
        return context.get_dummy_value()

    sig = types.void(
        acc, W, wo, ws, wd, do, ds, xw, xo, xs, xsb, so, ss, b16, bo, bs, x16, x16o, x16s,
        nrows, bias,
    )  # fmt: skip
    return sig, codegen


@intrinsic
def sums_rows(typingctx, acc, part, po, ps, nrows):
    """part[po + t ps + r] += sum(acc[16 (4 r + t):][:16]) for nrows (a literal) rows and
    4 tokens, each sum a tree of vector adds."""
    if not isinstance(nrows, types.IntegerLiteral):
        return None
    nr = nrows.literal_value

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        po, ps = args[2], args[3]
        for i in range(nr):
            for t in range(4):
                v = tree_sum16(b, r.ptr(0, ir.Constant(I32, 16 * (4 * i + t)), ir.FloatType()))
                o = b.add(po, b.add(b.mul(ps, ir.Constant(ps.type, t)), ir.Constant(po.type, i)))
                p = r.ptr(1, o, ir.FloatType())
                b.store(b.fadd(b.load(p), v), p)
        return context.get_dummy_value()

    return types.void(acc, part, po, ps, nrows), codegen


@njit(parallel=True, cache=True, nogil=True)
def mm_superblock(kind, data, X, out):
    """out [n, rows] = X [n, cols] @ W.T for a matrix of one of KINDS (Q4_K, Q6_K, Q5_K,
    IQ4_XS, Q3_K, Q2_K) data uint8 [rows, row bytes], cols a multiple of 256."""
    n, cols = X.shape
    n4 = (n + 3) // 4 * 4
    xw2, xsb2, xs16 = quantize_tokens_sb(X, n4)
    xw = xw2.reshape(-1)
    xsb = xsb2.reshape(-1)
    rows = data.shape[0]
    flat = data.reshape(-1)
    rb = data.shape[1]
    nsb = cols // SUPER
    x16w = xs16.shape[1]
    xs16f = xs16.reshape(-1)
    bias = has_bias(kind)
    for c in prange((rows + _RB - 1) // _RB):
        res = acc4()
        rv = numba.carray(res, 4)
        r0 = c * _RB
        nr = min(_RB, rows - r0)
        W = np.empty((_RB, cols), np.int16)
        wd = np.zeros((_RB, nsb), np.float32)
        b16 = np.zeros((_RB, x16w), np.float32)
        for i in range(nr):
            prep_row_sb(kind, flat, (r0 + i) * rb, cols, W[i], wd[i], b16[i])
        Wf = W.reshape(-1)
        bf = b16.reshape(-1)
        part = np.zeros((n4, _RB), np.float32)
        partf = part.reshape(-1)
        wdf = wd.reshape(-1)
        blk = np.zeros(16 * 4 * _ROWS, np.float32)
        # columns in spans of _SPAN super-blocks, so that a token tile's words (4 x 512 B
        # per super-block) stay in L1 while the tile's rows stream from L2
        for c0 in range(0, nsb, _SPAN):
            c1 = min(nsb, c0 + _SPAN)
            for tt in range(n4 // 4):
                t0 = tt * 4
                i0 = 0
                if _DOT == "vnni":  # _ROWS rows a step, then the rest one by one
                    while i0 + _ROWS <= nr:
                        blk[:] = F0
                        for s in range(c0, c1):
                            if bias:
                                gemm_rows_sb(
                                    blk, Wf, i0 * cols + s * SUPER, cols, wdf, i0 * nsb + s,
                                    nsb, xw, t0 * cols + s * SUPER, cols, xsb, t0 * nsb + s,
                                    nsb, bf, i0 * x16w + s * 16, x16w, xs16f,
                                    t0 * x16w + s * 16, x16w, _ROWS, True,
                                )  # fmt: skip
                            else:
                                gemm_rows_sb(
                                    blk, Wf, i0 * cols + s * SUPER, cols, wdf, i0 * nsb + s,
                                    nsb, xw, t0 * cols + s * SUPER, cols, xsb, t0 * nsb + s,
                                    nsb, bf, 0, 0, xs16f, 0, 0, _ROWS, False,
                                )  # fmt: skip
                        sums_rows(blk, partf, t0 * _RB + i0, _RB, _ROWS)
                        i0 += _ROWS
                for i in range(i0, nr):
                    a0 = acc16()
                    a1 = acc16()
                    a2 = acc16()
                    a3 = acc16()
                    for s in range(c0, c1):
                        gemm4_sb(
                            a0,
                            a1,
                            a2,
                            a3,
                            Wf,
                            i * cols + s * SUPER,
                            wd[i, s],
                            xw,
                            t0 * cols + s * SUPER,
                            cols,
                            xsb,
                            t0 * nsb + s,
                            nsb,
                        )
                    if bias:  # the mins (Q2_K: per 16): one 16-group per super-block
                        for s in range(c0, c1):
                            bo = i * x16w + s * 16
                            fma16(a0, bf, bo, xs16f, t0 * x16w + s * 16)
                            fma16(a1, bf, bo, xs16f, (t0 + 1) * x16w + s * 16)
                            fma16(a2, bf, bo, xs16f, (t0 + 2) * x16w + s * 16)
                            fma16(a3, bf, bo, xs16f, (t0 + 3) * x16w + s * 16)
                    hsum4x16(a0, a1, a2, a3, res)
                    for t in range(4):
                        part[t0 + t, i] += rv[t]
        for t in range(n):
            for i in range(nr):
                out[t, r0 + i] = part[t, i]


KINDS = (KIND_Q4_K, KIND_Q6_K, KIND_Q5_K, KIND_IQ4_XS, KIND_Q3_K, KIND_Q2_K)
