"""Prefill GEMM of Q5_K, IQ4_XS, Q3_K and Q2_K on AVX-512 VNNI's vpdpbusd: unsigned
weight bytes times single-level int8 activations, one int32 lane per 32 elements.

int8.superblock folds the sub-block scales into int16 weight words and multiplies them
with two-level int16 activations (vpdpwssd, 32 multiply-adds an instruction). Here the
weights stay bytes (vpdpbusd, 64 an instruction) and each 32-element block keeps its
own int32 lane, so any scale per 32 elements, of the weights or of the activations,
applies to that lane after the integer dot:
- a tile is two super-blocks (512 elements, 16 blocks of 32) as 8 vectors of 64 bytes,
  vector k lane j holding bytes 4k .. 4k + 3 of block j (to_lanes): 8 vpdpbusd leave
  block j's whole dot in lane j;
- per tile, weight row r and token t: a_rt += cvt(dot - o_t) * (s_r * dx_t) [+ b_r * sx_t],
  s_r the 16 block scales of the row, dx_t the 16 activation scales, o_t an integer
  offset of the weights' bytes times the block sums of q, b_r sx_t a float bias (the
  K-quant mins) times dx sum(q) per 32 or per 16 elements.
The weight bytes per format (prep_bytes): Q5_K q (0..31), s = d sc, b = -dmin m;
IQ4_XS level + 128, s = d (ls - 32), o = 128 sum(q); Q3_K (q - 4)(sc - 32) + 124
(0..252: the 16-element scale folded in), s = d, o = 124 sum(q); Q2_K q (sc & 15)
(0..45), s = d, b = -dmin (sc >> 4) per 16. Lane sums stay exact in int32 (32 x 255 x
127) and below 2^24, so their conversion is exact.
The activations: per 32 elements dx = max|x| / 127, q = rint(x / dx) (llama.cpp's
q8_0; qmatvec.quantize_x_reference(x, 32, 1)), one scale per block where llama.cpp's
q8_K has one per 256.
A step takes 4 weight rows and 4 tokens (16 zmm dot accumulators; the float sums live
in a small stack block, loaded and stored once a tile). Per 2 super-blocks and (row,
token): 8 vpdpbusd and 3-4 vector float operations, where int8.superblock spends 16
vpdpwssd and 2. On the "vnni" path only (qmatvec routes these kinds here there).
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, prange, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops.int8.activations import amax32, q8_16  # noqa: E402
from edgerun.ops.int8.blocks import (  # noqa: E402
    KIND_IQ4_XS,
    KIND_Q2_K,
    KIND_Q3_K,
    KIND_Q5_K,
    iq4_xs_block,
    iq4xs_scale_ints,
    q4k_scale_bytes,
    q5k_nibbles,
)
from edgerun.ops.int8.ir import (  # noqa: E402
    _IR,
    F0,
    I32,
    V4F,
    V8F,
    V16F,
    V16I32,
    V64I8,
    _store,
    _v,
)
from edgerun.ops.int8.superblock import _q2k_words, _q3k_words  # noqa: E402

TILE = 512  # elements per tile: two super-blocks, 16 blocks of 32, one int32 lane each
_RB = 16  # weight rows unpacked per parallel task
_TSPAN = 3  # tiles per column span: 16 rows and 4 tokens of bytes stay in L1
BYTE_KINDS = (KIND_Q5_K, KIND_IQ4_XS, KIND_Q3_K, KIND_Q2_K)
V128I32, V64I32 = _v(I32, 128), _v(I32, 64)
V64I16 = _v(ir.IntType(16), 64)
# the tile's dwords in lane order: out[16 k + j] = in[8 j + k] (block j, dword k)
_LANES = [8 * j + k for k in range(8) for j in range(16)]


# ------------------------------------------------------------------ activations
@intrinsic
def _misalign(typingctx, a):
    """The address of a's first element modulo 64."""

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        addr = builder.ptrtoint(arr.data, ir.IntType(64))
        return builder.and_(addr, ir.Constant(ir.IntType(64), 63))

    return types.int64(a), codegen


@njit(inline="always")
def _aligned_bytes(n, dtype):
    """A zeroed 1-d array of n bytes starting on a 64-byte line: each zmm load of the GEMM
    within one cache line (a load across two, from numpy's 16-byte alignment, costs
    IQ4_XS and Q3_K up to half their speed)."""
    a = np.zeros(n + 64, dtype)
    o = (64 - _misalign(a)) & 63
    return a[o : o + n]


@intrinsic
def to_lanes(typingctx, xb, o):
    """The 512 bytes xb[o:o+512] (16 blocks of 32, in element order) -> tile order in
    place: bytes 4k .. 4k + 3 of block j at 64 k + 4 j."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        v = r.load(0, args[1], V128I32)
        _store(r, 0, args[1], r.shuf(v, v, _LANES))
        return context.get_dummy_value()

    return types.void(xb, o), codegen


@njit(parallel=True, cache=True, nogil=True)
def quantize_tokens_bytes(X, n4, ntile, off, per16):
    """Rows of X [n, cols] (cols % 256 == 0) -> (xb int8 [n4, ntile 512] in tile order,
    xd [n4, ntile 16] dx of each 32, xi int32 [same] off * sum(q) of each 32, xf dx *
    sum(q) of each 32, or of each 16 where per16 ([n4, ntile 32])); tokens and
    columns past X are zero."""
    n, cols = X.shape
    cp = ntile * TILE
    nw = ntile * 16
    xb = _aligned_bytes(n4 * cp, np.int8).reshape((n4, cp))
    xd = np.zeros((n4, nw), np.float32)
    xi = np.zeros((n4, nw), np.int32)
    xf = np.zeros((n4, 2 * nw if per16 else nw), np.float32)
    for t in prange(n):
        x = X[t]
        row = xb[t]
        for j in range(cols // 32):
            o = 32 * j
            d = amax32(x, o) / np.float32(127.0)
            inv = np.float32(1.0) / d if d != F0 else F0
            s0 = q8_16(x, o, row, o, inv)
            s1 = q8_16(x, o + 16, row, o + 16, inv)
            xd[t, j] = d
            xi[t, j] = np.int32(off * (s0 + s1))
            if per16:
                xf[t, 2 * j] = d * np.float32(s0)
                xf[t, 2 * j + 1] = d * np.float32(s1)
            else:
                xf[t, j] = d * np.float32(s0 + s1)
        for k in range(ntile):
            to_lanes(row, k * TILE)
    return xb, xd, xi, xf


# ------------------------------------------------------------------ weight rows
# Per format: (the 8 block scales <8 x float>, the bias <8 x float> per 32, <16 x float>
# per 16 or None, the 256 weight bytes as 4 <64 x i8> in element order) of the
# super-block at byte off of array arg 2.
def _q5k_bytes(r, off):
    b = r.b
    dm, sc8, mn8 = q4k_scale_bytes(r, 2, off)
    d = r.splat(b.extract_element(dm, ir.Constant(I32, 0)), 8)
    dmin = r.splat(b.extract_element(dm, ir.Constant(I32, 1)), 8)
    neg = b.fsub(ir.Constant(V8F, [-0.0] * 8), b.fmul(dmin, b.uitofp(mn8, V8F)))
    return b.fmul(d, b.uitofp(sc8, V8F)), neg, [r.concat(*q5k_nibbles(r, off, g)) for g in range(4)]


def _iq4xs_bytes(r, off):
    b = r.b
    s = b.fmul(r.splat(r.f16(2, off), 8), b.sitofp(iq4xs_scale_ints(r, off), V8F))
    return s, None, [iq4_xs_block.chunk(r, off, g) for g in range(4)]


def _q3k_bytes(r, off):
    b = r.b
    d, _, words = _q3k_words(r, off)  # (q - 4)(sc - 32) in -124 .. 128
    c124 = ir.Constant(V64I16, [124] * 64)
    return r.splat(d, 8), None, [b.trunc(b.add(w, c124), V64I8) for w in words]


def _q2k_bytes(r, off):
    b = r.b
    d, neg, words = _q2k_words(r, off)  # q (sc & 15) in 0 .. 45
    return r.splat(d, 8), neg, [b.trunc(w, V64I8) for w in words]


_BYTES = {
    KIND_Q5_K: _q5k_bytes,
    KIND_IQ4_XS: _iq4xs_bytes,
    KIND_Q3_K: _q3k_bytes,
    KIND_Q2_K: _q2k_bytes,
}


@intrinsic
def prep_bytes(typingctx, U, uo, flat, o, ws, wo, bw, bo, kind):
    """One super-block of a row (kind a literal of BYTE_KINDS) at flat[o] -> its bytes
    in tile order at U[uo + 64 k:][:32] (k = 0..7; uo = the tile's start + 32 for the
    second super-block of a tile), its 8 block scales at ws[wo:wo+8] and its bias
    (Q5_K: 8 at bw[bo:], Q2_K: 16 at bw[bo:])."""
    if not isinstance(kind, types.IntegerLiteral):
        return None
    bytes_of = _BYTES[kind.literal_value]

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        s, bias, chunks = bytes_of(r, args[3])
        _store(r, 4, args[5], s)
        if bias is not None:
            _store(r, 6, args[7], bias)
        v = b.bitcast(
            r.concat(r.concat(chunks[0], chunks[1]), r.concat(chunks[2], chunks[3])), V64I32
        )
        uo = args[1]
        for k in range(8):  # dword k of the 8 blocks
            part = r.shuf(v, v, [8 * j + k for j in range(8)])
            _store(r, 0, b.add(uo, ir.Constant(uo.type, 64 * k)), part)
        return context.get_dummy_value()

    return types.void(U, uo, flat, o, ws, wo, bw, bo, kind), codegen


@njit(cache=True, nogil=True)
def _block_bytes(kind):
    """Bytes of one super-block of the kind."""
    if kind == KIND_Q5_K:
        return 176
    if kind == KIND_IQ4_XS:
        return 136
    if kind == KIND_Q3_K:
        return 110
    return 84


@njit(cache=True, nogil=True)
def prep_row_bytes(kind, flat, base, nsb, U, uo, ws, wo, bw, bo):
    """Unpack one weight row: bytes in tile order at U[uo:], block scales at ws[wo:],
    the bias at bw[bo:] (Q5_K per 32, Q2_K per 16; the others have none)."""
    sbb = _block_bytes(kind)
    for s in range(nsb):
        h = s & 1
        t = s >> 1
        u = uo + t * TILE + 32 * h
        w = wo + 16 * t + 8 * h
        o = base + s * sbb
        if kind == KIND_Q5_K:
            prep_bytes(U, u, flat, o, ws, w, bw, bo + 16 * t + 8 * h, KIND_Q5_K)
        elif kind == KIND_IQ4_XS:
            prep_bytes(U, u, flat, o, ws, w, bw, bo, KIND_IQ4_XS)
        elif kind == KIND_Q3_K:
            prep_bytes(U, u, flat, o, ws, w, bw, bo, KIND_Q3_K)
        else:
            prep_bytes(U, u, flat, o, ws, w, bw, bo + 16 * s, KIND_Q2_K)


@njit(cache=True, nogil=True)
def _offset(kind):
    """The unsigned offset of the kind's weight bytes (o: IQ4_XS, Q3_K)."""
    if kind == KIND_IQ4_XS:
        return 128
    if kind == KIND_Q3_K:
        return 124
    return 0


# ------------------------------------------------------------------------ GEMM
@intrinsic
def gemm_bytes(
    typingctx, acc, U, uo, us, ws, wo, wst, xb, xo, xs, xd, xdo, xds, xi, xf, xfo, xfs,
    bw, bo, bs, mode,
):  # fmt: skip
    """One tile of 4 weight rows and 4 tokens: with a_rt = acc[16 (4 r + t):][:16],
        d_rt = 8 vpdpbusd of U[uo + r us:][:512] with xb[xo + t xs:][:512]
        a_rt += cvt(d_rt - o_t) * ws[wo + r wst:][:16] * xd[xdo + t xds:][:16] + bias
    mode (a literal): 0: o_t = xi[xdo + t xds:][:16], no bias; 1: o_t = 0, bias
    bw[bo + r bs:][:16] * xf[xfo + t xfs:][:16]; 2: as 1 over 32 floats (per 16)."""
    if not isinstance(mode, types.IntegerLiteral):
        return None
    md = mode.literal_value

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        uo, us, wo, wst, xo, xs, xdo, xds = (args[k] for k in (2, 3, 5, 6, 8, 9, 11, 12))
        xfo, xfs, bo, bs = (args[k] for k in (15, 16, 18, 19))

        def at(base, stride, k, extra=0):
            v = b.add(base, b.mul(stride, ir.Constant(stride.type, k))) if k else base
            return b.add(v, ir.Constant(v.type, extra)) if extra else v

        f = r.fn("llvm.x86.avx512.vpdpbusd.512", V16I32, [V16I32, V16I32, V16I32])
        dots = [[ir.Constant(V16I32, [0] * 16)] * 4 for _ in range(4)]
        for k in range(8):
            wv = [b.bitcast(r.load(1, at(uo, us, i, 64 * k), V64I8), V16I32) for i in range(4)]
            for t in range(4):
                xv = b.bitcast(r.load(7, at(xo, xs, t, 64 * k), V64I8), V16I32)
                for i in range(4):
                    dots[i][t] = b.call(f, [dots[i][t], wv[i], xv])
        nb = (0, 1, 2)[md]
        xdv = [r.load(10, at(xdo, xds, t), V16F) for t in range(4)]
        xiv = [r.load(13, at(xdo, xds, t), V16I32) for t in range(4)] if md == 0 else []
        xfv = [[r.load(14, at(xfo, xfs, t, 16 * v), V16F) for v in range(nb)] for t in range(4)]
        for i in range(4):
            wsv = r.load(4, at(wo, wst, i), V16F)
            bwv = [r.load(17, at(bo, bs, i, 16 * v), V16F) for v in range(nb)]
            for t in range(4):
                p = r.ptr(0, ir.Constant(I32, 16 * (4 * i + t)), V16F)
                a = b.load(p, align=4)
                d = b.sub(dots[i][t], xiv[t]) if md == 0 else dots[i][t]
                a = r.fma(b.sitofp(d, V16F), b.fmul(wsv, xdv[t]), a)
                for v in range(nb):
                    a = r.fma(bwv[v], xfv[t][v], a)
                b.store(a, p, align=4)
        return context.get_dummy_value()

    sig = types.void(
        acc, U, uo, us, ws, wo, wst, xb, xo, xs, xd, xdo, xds, xi, xf, xfo, xfs, bw, bo, bs,
        mode,
    )  # fmt: skip
    return sig, codegen


def _halves(r, a, c, w):
    """Lanes of a and c (<16 x float>, each w-lane group a sum of one output) folded to
    w / 2-lane groups: the first halves of a's and c's groups plus their second halves."""
    lo = [g * w + k for g in range(32 // w) for k in range(w // 2)]
    return r.b.fadd(r.shuf(a, c, lo), r.shuf(a, c, [i + w // 2 for i in lo]))


@intrinsic
def sums_tile(typingctx, acc, part, po, ps):
    """part[po + t ps + r] += sum(acc[16 (4 r + t):][:16]) for 4 rows and 4 tokens: the
    16 sums in one transposing tree (15 vector adds), not 16 trees of their own."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        v = [b.load(r.ptr(0, ir.Constant(I32, 16 * m), V16F), align=4) for m in range(16)]
        for w in (16, 8, 4, 2):  # lane m of the last: the sum of acc block m
            v = [_halves(r, v[2 * p], v[2 * p + 1], w) for p in range(len(v) // 2)]
        s = v[0]
        po, ps = args[2], args[3]
        for t in range(4):
            o = b.add(po, b.mul(ps, ir.Constant(ps.type, t))) if t else po
            p = r.ptr(1, o, V4F)
            b.store(b.fadd(b.load(p, align=4), r.shuf(s, s, [t, t + 4, t + 8, t + 12])), p, align=4)
        return context.get_dummy_value()

    return types.void(acc, part, po, ps), codegen


@njit(parallel=True, cache=True, nogil=True)
def mm_superblock_bytes(kind, data, X, out):
    """out [n, rows] = X [n, cols] @ W.T for a matrix of one of BYTE_KINDS, data uint8
    [rows, row bytes], cols a multiple of 256; AVX-512 VNNI only."""
    n, cols = X.shape
    n4 = (n + 3) // 4 * 4
    nsb = cols // 256
    ntile = (nsb + 1) // 2
    cp = ntile * TILE
    nw = ntile * 16
    per16 = kind == KIND_Q2_K
    nbw = 2 * nw if per16 else nw
    xb2, xd2, xi2, xf2 = quantize_tokens_bytes(X, n4, ntile, _offset(kind), per16)
    xb, xd, xi, xf = xb2.reshape(-1), xd2.reshape(-1), xi2.reshape(-1), xf2.reshape(-1)
    rows = data.shape[0]
    flat = data.reshape(-1)
    rb = data.shape[1]
    for c in prange((rows + _RB - 1) // _RB):
        r0 = c * _RB
        nr = min(_RB, rows - r0)
        U = _aligned_bytes(_RB * cp, np.uint8)
        ws = np.zeros(_RB * nw, np.float32)  # rows past nr: scale 0
        bw = np.zeros(_RB * nbw, np.float32)
        for i in range(nr):
            prep_row_bytes(kind, flat, (r0 + i) * rb, nsb, U, i * cp, ws, i * nw, bw, i * nbw)
        part = np.zeros((n4, _RB), np.float32)
        partf = part.reshape(-1)
        blk = np.zeros(16 * 16, np.float32)
        for c0 in range(0, ntile, _TSPAN):
            c1 = min(ntile, c0 + _TSPAN)
            for tt in range(n4 // 4):
                t0 = tt * 4
                for i0 in range(0, nr, 4):
                    blk[:] = F0
                    for k in range(c0, c1):
                        uo = i0 * cp + k * TILE
                        xo = t0 * cp + k * TILE
                        wo = i0 * nw + 16 * k
                        xdo = t0 * nw + 16 * k
                        if kind == KIND_Q5_K:
                            gemm_bytes(
                                blk, U, uo, cp, ws, wo, nw, xb, xo, cp, xd, xdo, nw, xi, xf,
                                xdo, nw, bw, wo, nw, 1,
                            )  # fmt: skip
                        elif per16:
                            gemm_bytes(
                                blk, U, uo, cp, ws, wo, nw, xb, xo, cp, xd, xdo, nw, xi, xf,
                                t0 * nbw + 32 * k, nbw, bw, i0 * nbw + 32 * k, nbw, 2,
                            )  # fmt: skip
                        else:
                            gemm_bytes(
                                blk, U, uo, cp, ws, wo, nw, xb, xo, cp, xd, xdo, nw, xi, xf,
                                0, 0, bw, 0, 0, 0,
                            )  # fmt: skip
                    sums_tile(blk, partf, t0 * _RB + i0, _RB)
        for t in range(n):
            for i in range(nr):
                out[t, r0 + i] = part[t, i]
