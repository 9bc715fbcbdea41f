"""Activation quantization: float32 x to the int8 blocks the kernels multiply (two levels
per 32, quantize_x; single level per 32 or 64, quantize_x1; per 256 refined by powers of
two, quantize_x_sb8), in the nib2 / natural / AVX2 word layouts, and their scratch.
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from llvmlite import ir  # noqa: E402
from numba import njit, types  # noqa: E402
from numba.extending import intrinsic  # noqa: E402

from edgerun.ops.int8.blocks import (  # noqa: E402
    KIND_Q6_K,
)
from edgerun.ops.int8.ir import (  # noqa: E402
    _IR,
    DOT,
    F0,
    F32,
    I8,
    I32,
    I64,
    V16F,
    V16I32,
    _store,
    _v,
    hsum16,
)


# ------------------------------------------------------------------ x quantization
@intrinsic
def amax32(typingctx, x, xo):
    """max |x[xo:xo+32]| (float32 array x)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        fabs = r.fn("llvm.fabs.v16f32", V16F, [V16F])
        a = b.call(fabs, [r.load(0, args[1], V16F)])
        c = b.call(fabs, [r.load(0, args[1], V16F, 16)])
        v = b.select(b.fcmp_ordered(">", a, c), a, c)
        n = 16
        while n > 1:
            h = n // 2
            lo = r.shuf(v, v, range(h))
            hi = r.shuf(v, v, range(h, n))
            v = b.select(b.fcmp_ordered(">", lo, hi), lo, hi)
            n = h
        return b.extract_element(v, ir.Constant(I32, 0))

    return types.float32(x, xo), codegen


@intrinsic
def qhalf(typingctx, x, xo, xq, o1, o2, d, inv, inv2):
    """16 elements x[xo:xo+16] -> q1 = rint(x * inv) at xq[o1:], q2 = rint((x - q1 * d)
    * inv2) at xq[o2:] (int8); returns sum(128 * q1 + q2) (int32)."""

    def codegen(context, builder, sig, args):
        r = _IR(context, builder, sig, args)
        b = builder
        rint = r.fn("llvm.rint.v16f32", V16F, [V16F])
        v = r.load(0, args[1], V16F)
        dv, iv, i2 = (r.splat(args[k], 16) for k in (5, 6, 7))
        a = b.call(rint, [b.fmul(v, iv)])
        c = b.call(rint, [b.fmul(b.fsub(v, b.fmul(a, dv)), i2)])
        qa = b.fptosi(a, V16I32)
        qc = b.fptosi(c, V16I32)
        _store(r, 2, args[3], b.trunc(qa, _v(I8, 16)))
        _store(r, 2, args[4], b.trunc(qc, _v(I8, 16)))
        t = b.add(b.shl(qa, ir.Constant(V16I32, [7] * 16)), qc)
        red = r.fn("llvm.vector.reduce.add.v16i32", I32, [V16I32])
        return b.sext(b.call(red, [t]), I64)

    return types.int64(x, xo, xq, o1, o2, d, inv, inv2), codegen


@njit(cache=True, nogil=True)
def quantize_x(x, nib2, xq, xds, xs16):
    """Two-level int8 activations: x ~= (128 * q1 + q2) * dx / 128 per block of 32, with
    q1 = rint(x / dx), dx = max|x| / 127, and q2 = rint((x - q1 dx) * 128 / dx) the
    rounded residual (|q2| <= 64). Kernels compute 128 * dot(w, q1) + dot(w, q2) exactly
    in int32, so the only approximation left is ~2^-15 of max|x| per block: the result
    matches float32 kernels to ~1e-5 instead of the ~1e-2 of plain int8.

    x float32 [cols] -> xq int8 [2 * cols], in chunks of 64 elements: [q1 (64 B) | q2
    (64 B)] (an odd last block of 32: [q1 (32 B) | q2 (32 B)]); inside a chunk natural
    order, or with nib2 the pair order [a0:16, b0:16, a16:32, b16:32].
    xds float32 [2 * nb]: [dx', dx' * sum(128 q1 + q2)] per block (dx' = dx / 128);
    xs16 float32 [cols // 16]: dx' * sum(128 q1 + q2) per 16 elements.
    """
    nb = x.shape[0] // 32
    for b in range(nb):
        amax = amax32(x, b * 32)
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != F0 else F0
        inv2 = inv * np.float32(128.0)
        full = (b // 2) * 2 + 1 < nb  # block b is in a full 64-element chunk
        if full:
            q1o = (b // 2) * 128
            q2o = q1o + 64
        else:
            q1o = b * 64
            q2o = q1o + 32
        if full and nib2:
            o0 = (b & 1) * 16
            o1 = o0 + 32
        elif full:
            o0 = (b & 1) * 32
            o1 = o0 + 16
        else:
            o0 = 0
            o1 = 16
        s0 = qhalf(x, b * 32, xq, q1o + o0, q2o + o0, d, inv, inv2)
        s1 = qhalf(x, b * 32 + 16, xq, q1o + o1, q2o + o1, d, inv, inv2)
        d2 = d / np.float32(128.0)
        xds[2 * b] = d2
        xds[2 * b + 1] = d2 * np.float32(s0 + s1)
        xs16[2 * b] = d2 * np.float32(s0)
        xs16[2 * b + 1] = d2 * np.float32(s1)
    if DOT != "vnni":
        _to_words(xq, nb)


def _q8_codegen(r, n, xo, bo, inv):
    """rint(x[xo:xo+n] * inv) as int8 at xb[bo:bo+n] (args 0 and 2); their sum (int64)."""
    b = r.b
    VF, VI = _v(F32, n), _v(I32, n)
    rint = r.fn(f"llvm.rint.v{n}f32", VF, [VF])
    q = b.fptosi(b.call(rint, [b.fmul(r.load(0, xo, VF), r.splat(inv, n))]), VI)
    _store(r, 2, bo, b.trunc(q, _v(I8, n)))
    red = r.fn(f"llvm.vector.reduce.add.v{n}i32", I32, [VI])
    return b.sext(b.call(red, [q]), I64)


@intrinsic
def q8_32(typingctx, x, xo, xb, inv):
    """32 elements x[xo:xo+32] -> rint(x * inv) as int8 at xb[xo:xo+32]; returns their
    sum (int64)."""

    def codegen(context, builder, sig, args):
        return _q8_codegen(_IR(context, builder, sig, args), 32, args[1], args[1], args[3])

    return types.int64(x, xo, xb, inv), codegen


@intrinsic
def q8_16(typingctx, x, xo, xb, bo, inv):
    """16 elements x[xo:xo+16] -> rint(x * inv) as int8 at xb[bo:bo+16]; their sum."""

    def codegen(context, builder, sig, args):
        return _q8_codegen(_IR(context, builder, sig, args), 16, args[1], args[3], args[4])

    return types.int64(x, xo, xb, bo, inv), codegen


@njit(cache=True, nogil=True)
def quantize_x1(x, nib2, xq, xds, span):
    """Single-level int8 activations of X1's formats (Q5_0, Q3_G64, Q2_G64):
    per span of 32 or 64 elements, q = rint(x / dx) with dx = max|x| / 127 (span 32:
    llama.cpp's q8_0, for Q5_0; 64: the G64 formats, whose 64 weights share d and m, so
    the kernel adds the block's two halves in int16 before one vpmaddwd, conversion and
    FMA), one byte per element in quantize_x's block order: chunks of 64 elements,
    natural or with nib2 [x_a[0:16], x_b[0:16], x_a[16:32], x_b[16:32]], an odd last
    block natural. xds float32 [2 nb]: [dx, dx sum(q)] per block of 32 (quantize_x's
    meaning; the two blocks of a 64-span carry the same dx)."""
    nb = x.shape[0] // 32
    per = span // 32  # blocks of 32 sharing a scale
    for b0 in range(0, nb, per):
        b1 = min(b0 + per, nb)
        amax = amax32(x, b0 * 32)
        for b in range(b0 + 1, b1):
            amax = max(amax, amax32(x, b * 32))
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != F0 else F0
        for b in range(b0, b1):
            o0 = b * 32
            o1 = o0 + 16
            if nib2 and (b // 2) * 2 + 1 < nb:  # block b is in a full 64-element chunk
                o0 = (b // 2) * 64 + (b & 1) * 16
                o1 = o0 + 32
            s = q8_16(x, b * 32, xq, o0, inv) + q8_16(x, b * 32 + 16, xq, o1, inv)
            xds[2 * b] = d
            xds[2 * b + 1] = d * np.float32(s)


@njit(inline="always")
def quantize_xn(x, x1, nib2, xq, xds, xs16):
    """The activations of a format's kernels: quantize_x1 with scales per x1 elements
    for the formats of X1 (x1: 32 for Q5_0, 64 for the G64 formats, x1_span), else
    (x1 = 0) quantize_x."""
    if x1:
        quantize_x1(x, nib2, xq, xds, x1)
    else:
        quantize_x(x, nib2, xq, xds, xs16)


SB8_EMAX = 6  # most halvings of a 32-element block's scale (quantize_x_sb8)


@njit(cache=True, nogil=True)
def quantize_x_sb8(x, xb, xsb, xp):
    """Single-level int8 activations for q4_k_block8, in element order in xb int8 [cols]:
    one scale dx = max|x| / 127 per 256-element super-block, refined per 32 elements by
    a power of two, q = rint(x 2^e / dx) with e (0..SB8_EMAX) the largest that keeps
    |q| <= 127. The kernel folds 2^(6 - e) into the sub-block scales it multiplies with
    (vpmaddwd), so the refinement costs one int16 multiply a super-block, and a block of
    small values beside an outlier keeps up to 6 more bits than one scale per 256
    (llama.cpp's q8_K) leaves it. xp int16 [8 * cols // 256]: 2^(6 - e) of each 32;
    xsb float32 [9 * cols // 256]: per super-block dx 2^-e sum(q) of each 32 elements,
    then dx / 64."""
    a32 = np.empty(8, np.float32)  # one allocation a call, not one a super-block
    for s in range(x.shape[0] // 256):
        amax = F0
        for j in range(8):
            a32[j] = amax32(x, s * 256 + 32 * j)
            amax = max(amax, a32[j])
        d = amax / np.float32(127.0)
        inv = np.float32(1.0) / d if d != F0 else F0
        for j in range(8):
            e = 0
            while e < SB8_EMAX and a32[j] * np.float32(2 ** (e + 1)) <= amax:
                e += 1
            f = np.float32(2**e)
            xp[8 * s + j] = np.int16(2 ** (SB8_EMAX - e))
            xsb[9 * s + j] = d / f * np.float32(q8_32(x, s * 256 + 32 * j, xb, inv * f))
        xsb[9 * s + 8] = d / np.float32(2**SB8_EMAX)


@njit(inline="always")
def _region_to_words(xq, base, n):
    """One [q1 (n B) | q2 (n B)] region of xq -> n int16 words 128 q1 + q2, per 32
    positions the 16 even ones then the 16 odd ones (dpx's AVX2 order)."""
    v = np.empty(64, np.int16)
    for k in range(n):
        v[k] = np.int16(128) * np.int16(xq[base + k]) + np.int16(xq[base + n + k])
    for h in range(n // 32):
        for j in range(16):
            for par in range(2):
                w = v[32 * h + 2 * j + par]
                o = base + 64 * h + 32 * par + 2 * j
                xq[o] = np.int8(w & 0xFF)  # little endian: low byte first
                xq[o + 1] = np.int8(w >> 8)


@njit(inline="always")
def _to_words(xq, nb):
    """quantize_x's byte layout -> its word layout, region by region (full chunks of 64
    elements, and an odd last block of 32)."""
    for c in range(nb // 2):
        _region_to_words(xq, c * 128, 64)
    if nb & 1:
        _region_to_words(xq, (nb - 1) * 64, 32)


@njit(inline="always")
def _hsum(p, n):
    """Sum of the first n (16, 8 or 4) floats of an acc16/acc4 vector."""
    if n == 16:
        return hsum16(p)
    a = numba.carray(p, n)
    t = F0
    for i in range(n):
        t += a[i]
    return t


@njit(inline="always")
def _scratch(cols):
    nb = cols // 32
    return (
        np.empty(2 * cols, np.int8),
        np.empty(2 * nb, np.float32),
        np.empty(2 * nb, np.float32),
    )


@njit(inline="always")
def scratch_sb8(cols):
    """quantize_x_sb8's outputs for x of `cols` elements: (xb, xsb, xp), and sums16_sb8's
    (bs)."""
    n = cols // 256
    return (
        np.empty(cols, np.int8),
        np.empty(9 * n, np.float32),
        np.empty(8 * n, np.int16),
        np.empty(16 * n, np.int16),
    )


@njit(inline="always")
def quantize_k8(kind, x, xb, xsb, xp, bs):
    """x -> quantize_x_sb8's activations for a Q4_K / Q6_K kernel, and for Q6_K the
    sums per 16 its -32 offset takes (sums16_sb8 into bs)."""
    quantize_x_sb8(x, xb, xsb, xp)
    if kind == KIND_Q6_K:
        sums16_sb8(xb, bs)


@njit(inline="always")
def x_k8(kind, x):
    """x on quantize_x_sb8's activations for one Q4_K / Q6_K matvec: (xb, xsb, xp, bs),
    bs (sums16_sb8) filled for Q6_K only."""
    xb, xsb, xp, bs = scratch_sb8(x.shape[0])
    quantize_k8(kind, x, xb, xsb, xp, bs)
    return xb, xsb, xp, bs


@njit(cache=True, nogil=True)
def sums16_sb8(xb, bs):
    """The sums of each 16 of quantize_x_sb8's bytes (|sum| <= 2032) into bs int16, for
    q6_k_block8's -32 offset."""
    for i in range(bs.shape[0]):
        t = np.int32(0)
        for k in range(16):
            t += np.int32(xb[16 * i + k])
        bs[i] = np.int16(t)
