"""Portable block kernels: plain Numba float32 code that runs on any CPU (x86, ARM).

Every kernel works on the raw GGUF block bytes, one output row per `prange`
iteration, and follows one recipe (docs/kernels.md; `python benchmarks/kernels.py
--paths portable` times it):

- the block scale is factored out of the inner loop (d * sum(q * x) + m * sum(x)), with
  the per-block sums of x computed once per call;
- 16 lane accumulators on the stack (`stack16`), one horizontal sum per row, which the
  SLP vectorizer turns into 512/256/128-bit vector code;
- all arithmetic in float32 (a float32 op with a Python int would go to float64).

Kernel kinds (`KIND_*`) are small ints so that one compiled matmul / row-dequantizer
serves every format (one branch per row, outside the hot loop).
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from edgerun.ops._simd import bf2f, dot16, h2f, hsum16, stack16, u2f  # noqa: E402
from edgerun.ops.portable.gridquants import GRID_KINDS, KIND_IQ2_XXS, deq_grid  # noqa: E402
from edgerun.quant.iquants import KVALUES  # noqa: E402

F0 = np.float32(0.0)


@njit(inline="always")
def _f16at(a, i):
    return h2f(np.uint16(a[i]) | (np.uint16(a[i + 1]) << np.uint16(8)))


@njit(cache=True, nogil=True)
def block_sums(x, size):
    """float32 sums of x over consecutive blocks of `size` elements."""
    nb = x.shape[0] // size
    xs = np.empty(nb, np.float32)
    for b in range(nb):
        s = F0
        for j in range(size):
            s += x[b * size + j]
        xs[b] = s
    return xs


# --------------------------------------------------------------------------- matvec
@njit(parallel=True, cache=True, nogil=True)
def mv_f32(w, x, out):
    for r in prange(w.shape[0]):
        out[r] = dot16(w[r], x)


@njit(parallel=True, cache=True, nogil=True)
def mv_f16(w, x, out, bf):
    """w: uint16 [rows, cols] of fp16 (bf=False) or bfloat16 (bf=True) bits."""
    rows, cols = w.shape
    n16 = cols // 16
    for r in prange(rows):
        row = w[r]
        acc = numba.carray(stack16(), 16)
        for l in range(16):
            acc[l] = F0
        if bf:
            for b in range(n16):
                wb = row[b * 16 : b * 16 + 16]
                xb = x[b * 16 : b * 16 + 16]
                for l in range(16):
                    acc[l] += bf2f(wb[l]) * xb[l]
        else:
            for b in range(n16):
                wb = row[b * 16 : b * 16 + 16]
                xb = x[b * 16 : b * 16 + 16]
                for l in range(16):
                    acc[l] += h2f(wb[l]) * xb[l]
        t = hsum16(acc)
        for j in range(n16 * 16, cols):
            t += (bf2f(row[j]) if bf else h2f(row[j])) * x[j]
        out[r] = t


@njit(parallel=True, cache=True, nogil=True)
def mv_q8_0(data, x, out):
    rows = data.shape[0]
    nb = x.shape[0] // 32
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(stack16(), 16)
        for l in range(16):
            acc[l] = F0
        for b in range(nb):
            blk = row[b * 34 : b * 34 + 34]
            xb = x[b * 32 : b * 32 + 32]
            d = _f16at(blk, 0)
            q = blk[2:34]
            for l in range(16):
                acc[l] += d * (
                    np.float32(np.int8(q[l])) * xb[l] + np.float32(np.int8(q[16 + l])) * xb[16 + l]
                )
        out[r] = hsum16(acc)


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_0(data, x, out):
    rows = data.shape[0]
    nb = x.shape[0] // 32
    xs = block_sums(x, 32)
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(stack16(), 16)
        for l in range(16):
            acc[l] = F0
        dsum = F0
        for b in range(nb):
            blk = row[b * 18 : b * 18 + 18]
            xb = x[b * 32 : b * 32 + 32]
            d = _f16at(blk, 0)
            q = blk[2:18]
            for l in range(16):
                acc[l] += d * (np.float32(q[l] & 15) * xb[l] + np.float32(q[l] >> 4) * xb[16 + l])
            dsum += d * xs[b]
        out[r] = hsum16(acc) - np.float32(8.0) * dsum


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_1(data, x, out):
    rows = data.shape[0]
    nb = x.shape[0] // 32
    xs = block_sums(x, 32)
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(stack16(), 16)
        for l in range(16):
            acc[l] = F0
        msum = F0
        for b in range(nb):
            blk = row[b * 20 : b * 20 + 20]
            xb = x[b * 32 : b * 32 + 32]
            d = _f16at(blk, 0)
            m = _f16at(blk, 2)
            q = blk[4:20]
            for l in range(16):
                acc[l] += d * (np.float32(q[l] & 15) * xb[l] + np.float32(q[l] >> 4) * xb[16 + l])
            msum += m * xs[b]
        out[r] = hsum16(acc) + msum


# Q5_0 high bits as floats: Q5_HBITS[byte, k] = 16.0 * bit k of byte (8 KiB, L1-resident);
# a table lookup per 8 lanes instead of a variable shift per lane, which SLP won't vectorize.
Q5_HBITS = ((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1).astype(np.float32) * 16


@njit(parallel=True, cache=True, nogil=True)
def mv_q5_0(data, x, out, hb):
    """hb: Q5_HBITS."""
    rows = data.shape[0]
    nb = x.shape[0] // 32
    xs = block_sums(x, 32)
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(stack16(), 16)
        for l in range(16):
            acc[l] = F0
        dsum = F0
        for b in range(nb):
            blk = row[b * 22 : b * 22 + 22]
            xb = x[b * 32 : b * 32 + 32]
            d = _f16at(blk, 0)
            h0 = hb[blk[2]]  # elements 0..7
            h1 = hb[blk[3]]  # 8..15
            h2 = hb[blk[4]]  # 16..23
            h3 = hb[blk[5]]  # 24..31
            q = blk[6:22]
            for l in range(8):
                acc[l] += d * (
                    (np.float32(q[l] & 15) + h0[l]) * xb[l]
                    + (np.float32(q[l] >> 4) + h2[l]) * xb[16 + l]
                )
            for l in range(8):
                acc[8 + l] += d * (
                    (np.float32(q[8 + l] & 15) + h1[l]) * xb[8 + l]
                    + (np.float32(q[8 + l] >> 4) + h3[l]) * xb[24 + l]
                )
            dsum += d * xs[b]
        out[r] = hsum16(acc) - np.float32(16.0) * dsum


@njit(inline="always")
def _q4k_sm(s, j):
    """6-bit (scale, min) j of a Q4_K super-block; s = its 12 scale bytes."""
    if j < 4:
        return s[j] & 63, s[j + 4] & 63
    return (s[j + 4] & 15) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4)


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_k(data, x, out):
    # lanes over 16 bytes of a 32-byte group: low nibble -> sub-block 2g, high -> 2g+1
    # (one byte load per lane: two loads per lane stop LLVM's SLP vectorizer)
    rows = data.shape[0]
    nb = x.shape[0] // 256
    xs = block_sums(x, 32)
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(stack16(), 16)
        for l in range(16):
            acc[l] = F0
        msum = F0
        for b in range(nb):
            blk = row[b * 144 : b * 144 + 144]
            d = _f16at(blk, 0)
            dmin = _f16at(blk, 2)
            s = blk[4:16]
            for g in range(4):
                sc1, m1 = _q4k_sm(s, 2 * g)
                sc2, m2 = _q4k_sm(s, 2 * g + 1)
                d1 = d * np.float32(sc1)
                d2 = d * np.float32(sc2)
                msum += dmin * (
                    np.float32(m1) * xs[8 * b + 2 * g] + np.float32(m2) * xs[8 * b + 2 * g + 1]
                )
                for k in range(2):
                    q = blk[16 + 32 * g + 16 * k : 32 + 32 * g + 16 * k]
                    xo = b * 256 + 64 * g + 16 * k
                    xa = x[xo : xo + 16]
                    xb = x[xo + 32 : xo + 48]
                    for l in range(16):
                        acc[l] += d1 * (np.float32(q[l] & 15) * xa[l]) + d2 * (
                            np.float32(q[l] >> 4) * xb[l]
                        )
        out[r] = hsum16(acc) - msum


@njit(inline="always")
def q6_value(ql, qh, l, s):
    """Element l (0..15) of chunk s (0..3, a constant at each call site) of a Q6_K half,
    as float32 (v - 32): constant shifts per s."""
    if s == 0:
        v = (ql[l] & 15) | ((qh[l] & 3) << 4)
    elif s == 1:
        v = (ql[l] & 15) | ((qh[l] & 12) << 2)
    elif s == 2:
        v = (ql[l] >> 4) | (qh[l] & 48)
    else:
        v = (ql[l] >> 4) | ((qh[l] >> 6) << 4)
    return np.float32(np.int32(v) - 32)


@njit(inline="always")
def _q6_group(acc, ql, qh, xb, ds, s):
    """16 elements of chunk s (0..3) of a Q6_K half."""
    for l in range(16):
        acc[l] += ds * (q6_value(ql, qh, l, s) * xb[l])


@njit(parallel=True, cache=True, nogil=True)
def mv_q6_k(data, x, out):
    rows = data.shape[0]
    nb = x.shape[0] // 256
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(stack16(), 16)
        for l in range(16):
            acc[l] = F0
        for b in range(nb):
            blk = row[b * 210 : b * 210 + 210]
            d = _f16at(blk, 208)
            for h in range(2):
                for k in range(2):
                    qh = blk[128 + h * 32 + 16 * k : 144 + h * 32 + 16 * k]
                    for s in range(4):
                        qo = h * 64 + (s & 1) * 32 + 16 * k
                        ql = blk[qo : qo + 16]
                        ds = d * np.float32(np.int8(blk[192 + 8 * h + 2 * s + k]))
                        xo = b * 256 + h * 128 + 32 * s + 16 * k
                        xb = x[xo : xo + 16]
                        if s == 0:
                            _q6_group(acc, ql, qh, xb, ds, 0)
                        elif s == 1:
                            _q6_group(acc, ql, qh, xb, ds, 1)
                        elif s == 2:
                            _q6_group(acc, ql, qh, xb, ds, 2)
                        else:
                            _q6_group(acc, ql, qh, xb, ds, 3)
        out[r] = hsum16(acc)


# ------------------------------------------------ row dequantizer (bit-exact with reference)
KIND_F32 = 0
KIND_F16 = 1
KIND_BF16 = 2
KIND_Q8_0 = 3
KIND_Q4_0 = 4
KIND_Q4_1 = 5
KIND_Q5_0 = 6
KIND_Q4_K = 7
KIND_Q6_K = 8
KIND_Q5_1 = 9
KIND_Q2_K = 10
KIND_Q3_K = 11
KIND_Q5_K = 12
KIND_IQ4_NL = 13
KIND_IQ4_XS = 14
# the formats whose decode dequantizes a row and dots it (mv_deq, batch.mvb_deq)
DEQ_KINDS = (KIND_Q5_1, KIND_Q2_K, KIND_Q3_K, KIND_Q5_K, KIND_IQ4_NL, KIND_IQ4_XS, *GRID_KINDS)
# the grid formats (IQ2_XXS .. IQ1_S) take kinds KIND_IQ2_XXS and up: portable.gridquants

# IQ4's 16 levels as float32 (the reference's KVALUES[q].astype(float32))
IQ4_LEVELS = KVALUES.astype(np.float32)


@njit(inline="always")
def q3k_scale(s, k):
    """Signed 6-bit scale k (0..15) of a Q3_K super-block; s = its 12 scale bytes."""
    lo = (s[k & 7] >> (4 * (k >> 3))) & 15
    hi = (s[8 + (k & 3)] >> (2 * (k >> 2))) & 3
    return np.int32(lo | (hi << 4)) - 32


@njit(inline="always")
def iq4xs_scale(blk, j):
    """Signed 6-bit scale of sub-block j (0..7) of an IQ4_XS super-block at blk."""
    sh = np.int32(blk[2]) | (np.int32(blk[3]) << 8)
    lo = (np.int32(blk[4 + (j >> 1)]) >> (4 * (j & 1))) & 15
    return (lo | (((sh >> (2 * j)) & 3) << 4)) - 32


@njit(cache=True, nogil=True)
def _deq_new(kind, row, dst):
    """deq_row for DEQ_KINDS (the formats read through a dequantized row). Not inlined:
    Numba copies an inlined function's IR at each call site, which a kernel for one of
    deq_row's other formats would pay for before pruning this branch."""
    cols = dst.shape[0]
    if kind == KIND_Q5_1:
        for b in range(cols // 32):
            blk = row[b * 24 : b * 24 + 24]
            o = dst[b * 32 : b * 32 + 32]
            d = _f16at(blk, 0)
            m = _f16at(blk, 2)
            qh = (
                np.uint32(blk[4])
                | (np.uint32(blk[5]) << np.uint32(8))
                | (np.uint32(blk[6]) << np.uint32(16))
                | (np.uint32(blk[7]) << np.uint32(24))
            )
            for j in range(16):
                lo = np.int32(blk[8 + j] & 15) | np.int32(((qh >> np.uint32(j)) & 1) << 4)
                hi = np.int32(blk[8 + j] >> 4) | np.int32(((qh >> np.uint32(j + 16)) & 1) << 4)
                o[j] = d * np.float32(lo) + m
                o[16 + j] = d * np.float32(hi) + m
    elif kind == KIND_Q2_K:
        for b in range(cols // 256):
            blk = row[b * 84 : b * 84 + 84]
            d = _f16at(blk, 80)
            dmin = _f16at(blk, 82)
            for k in range(16):
                dl = d * np.float32(blk[k] & 15)
                ml = dmin * np.float32(blk[k] >> 4)
                h, s_, l0 = k >> 3, (k >> 1) & 3, 16 * (k & 1)
                o = dst[b * 256 + 16 * k : b * 256 + 16 * k + 16]
                for j in range(16):
                    q = (blk[16 + 32 * h + l0 + j] >> (2 * s_)) & 3
                    o[j] = dl * np.float32(q) - ml
    elif kind == KIND_Q3_K:
        for b in range(cols // 256):
            blk = row[b * 110 : b * 110 + 110]
            d = _f16at(blk, 108)
            s = blk[96:108]
            for k in range(16):
                dl = d * np.float32(q3k_scale(s, k))
                h, s_, l0 = k >> 3, (k >> 1) & 3, 16 * (k & 1)
                jb = k >> 1  # hmask bit of elements 32 jb .. 32 jb + 31
                o = dst[b * 256 + 16 * k : b * 256 + 16 * k + 16]
                for j in range(16):
                    q = np.int32((blk[32 + 32 * h + l0 + j] >> (2 * s_)) & 3)
                    hb = np.int32((blk[l0 + j] >> jb) & 1)
                    o[j] = dl * np.float32(q - 4 * (1 - hb))
    elif kind == KIND_Q5_K:
        for b in range(cols // 256):
            blk = row[b * 176 : b * 176 + 176]
            d = _f16at(blk, 0)
            dmin = _f16at(blk, 2)
            s = blk[4:16]
            for g in range(4):
                sc1, m1 = _q4k_sm(s, 2 * g)
                sc2, m2 = _q4k_sm(s, 2 * g + 1)
                d1 = d * np.float32(sc1)
                d2 = d * np.float32(sc2)
                dm1 = dmin * np.float32(m1)
                dm2 = dmin * np.float32(m2)
                o = dst[b * 256 + 64 * g : b * 256 + 64 * g + 64]
                for j in range(32):
                    q = blk[48 + 32 * g + j]
                    h = blk[16 + j] >> (2 * g)
                    o[j] = d1 * np.float32((q & 15) | ((h & 1) << 4)) - dm1
                    o[32 + j] = d2 * np.float32((q >> 4) | ((h & 2) << 3)) - dm2
    elif kind == KIND_IQ4_NL:
        for b in range(cols // 32):
            blk = row[b * 18 : b * 18 + 18]
            o = dst[b * 32 : b * 32 + 32]
            d = _f16at(blk, 0)
            for j in range(16):
                o[j] = d * IQ4_LEVELS[blk[2 + j] & 15]
                o[16 + j] = d * IQ4_LEVELS[blk[2 + j] >> 4]
    elif kind == KIND_IQ4_XS:
        for b in range(cols // 256):
            blk = row[b * 136 : b * 136 + 136]
            d = _f16at(blk, 0)
            for sb in range(8):
                dl = d * np.float32(iq4xs_scale(blk, sb))
                o = dst[b * 256 + 32 * sb : b * 256 + 32 * sb + 32]
                for j in range(16):
                    q = blk[8 + 16 * sb + j]
                    o[j] = dl * IQ4_LEVELS[q & 15]
                    o[16 + j] = dl * IQ4_LEVELS[q >> 4]


@njit(parallel=True, cache=True, nogil=True)
def mv_deq(kind, data, x, out):
    """Decode matvec of DEQ_KINDS: each row dequantized (deq_row, bit-exact with the
    reference) into a buffer, then dot16 with x. Two passes over a row held in L1/L2,
    where the other formats' kernels unpack blocks in registers."""
    rows, cols = data.shape[0], x.shape[0]
    for r in prange(rows):
        buf = np.empty(cols, np.float32)
        deq_row(kind, data[r], buf)
        out[r] = dot16(buf, x)


@njit(cache=True, nogil=True)
def deq_row(kind, row, dst):
    """Dequantize one row of raw bytes into dst (float32 [cols]), same float ops as reference."""
    _deq_row(kind, row, dst)


@njit(inline="always")
def _deq_row(kind, row, dst):
    """deq_row's body, inlined where kind is a constant: the other formats' branches are
    pruned before typing, so only that format's dequantiser compiles."""
    cols = dst.shape[0]
    # kind as a plain int64 (not the literal a constant kind is typed as): deq_grid and
    # _deq_new compile once for all of their formats, not once per format
    if kind >= KIND_IQ2_XXS:
        deq_grid(np.int64(kind), row, dst)
    elif kind >= KIND_Q5_1:
        _deq_new(np.int64(kind), row, dst)
    elif kind == KIND_F32:
        for j in range(cols):
            dst[j] = _bitsf32(row, 4 * j)
    elif kind == KIND_F16:
        for j in range(cols):
            dst[j] = _f16at(row, 2 * j)
    elif kind == KIND_BF16:
        for j in range(cols):
            dst[j] = bf2f(np.uint16(row[2 * j]) | (np.uint16(row[2 * j + 1]) << np.uint16(8)))
    elif kind == KIND_Q8_0:
        for b in range(cols // 32):
            blk = row[b * 34 : b * 34 + 34]
            o = dst[b * 32 : b * 32 + 32]
            d = _f16at(blk, 0)
            for j in range(32):
                o[j] = np.float32(np.int8(blk[2 + j])) * d
    elif kind == KIND_Q4_0:
        for b in range(cols // 32):
            blk = row[b * 18 : b * 18 + 18]
            o = dst[b * 32 : b * 32 + 32]
            d = _f16at(blk, 0)
            for j in range(16):
                o[j] = d * np.float32(np.int32(blk[2 + j] & 15) - 8)
                o[16 + j] = d * np.float32(np.int32(blk[2 + j] >> 4) - 8)
    elif kind == KIND_Q4_1:
        for b in range(cols // 32):
            blk = row[b * 20 : b * 20 + 20]
            o = dst[b * 32 : b * 32 + 32]
            d = _f16at(blk, 0)
            m = _f16at(blk, 2)
            for j in range(16):
                o[j] = d * np.float32(blk[4 + j] & 15) + m
                o[16 + j] = d * np.float32(blk[4 + j] >> 4) + m
    elif kind == KIND_Q5_0:
        for b in range(cols // 32):
            blk = row[b * 22 : b * 22 + 22]
            o = dst[b * 32 : b * 32 + 32]
            d = _f16at(blk, 0)
            qh = (
                np.uint32(blk[2])
                | (np.uint32(blk[3]) << np.uint32(8))
                | (np.uint32(blk[4]) << np.uint32(16))
                | (np.uint32(blk[5]) << np.uint32(24))
            )
            for j in range(16):
                lo = np.int32(blk[6 + j] & 15) | np.int32(((qh >> np.uint32(j)) & 1) << 4)
                hi = np.int32(blk[6 + j] >> 4) | np.int32(((qh >> np.uint32(j + 16)) & 1) << 4)
                o[j] = d * np.float32(lo - 16)
                o[16 + j] = d * np.float32(hi - 16)
    elif kind == KIND_Q4_K:
        for b in range(cols // 256):
            blk = row[b * 144 : b * 144 + 144]
            d = _f16at(blk, 0)
            dmin = _f16at(blk, 2)
            s = blk[4:16]
            for g in range(4):
                sc1, m1 = _q4k_sm(s, 2 * g)
                sc2, m2 = _q4k_sm(s, 2 * g + 1)
                d1 = d * np.float32(sc1)
                d2 = d * np.float32(sc2)
                dm1 = dmin * np.float32(m1)
                dm2 = dmin * np.float32(m2)
                q = blk[16 + 32 * g : 48 + 32 * g]
                o = dst[b * 256 + 64 * g : b * 256 + 64 * g + 64]
                for j in range(32):
                    o[j] = d1 * np.float32(q[j] & 15) - dm1
                    o[32 + j] = d2 * np.float32(q[j] >> 4) - dm2
    elif kind == KIND_Q6_K:
        for b in range(cols // 256):
            blk = row[b * 210 : b * 210 + 210]
            d = _f16at(blk, 208)
            for h in range(2):
                for s in range(4):
                    sh = 4 * (s >> 1)
                    o = dst[b * 256 + h * 128 + s * 32 : b * 256 + h * 128 + s * 32 + 32]
                    for j in range(32):
                        qlv = np.int32((blk[h * 64 + (s & 1) * 32 + j] >> sh) & 15)
                        qhv = np.int32((blk[128 + h * 32 + j] >> (2 * s)) & 3)
                        ds = d * np.float32(np.int8(blk[192 + h * 8 + 2 * s + j // 16]))
                        o[j] = ds * np.float32((qlv | (qhv << 4)) - 32)


@njit(inline="always")
def _bitsf32(row, i):
    u = (
        np.uint32(row[i])
        | (np.uint32(row[i + 1]) << np.uint32(8))
        | (np.uint32(row[i + 2]) << np.uint32(16))
        | (np.uint32(row[i + 3]) << np.uint32(24))
    )
    return u2f(u)


def embedding_rows_kernel(kind: int):
    """The kernel embedding_rows(data, ids, out) of one format: out[i] = row ids[i] of
    data dequantized. One compiled kernel per format: kind is a constant of each, so the
    inlined dequantiser keeps that format's branch alone, where a kernel taking kind as an
    argument compiled every format's (a first run's decode step waits for it: SmolLM2's
    Q8_0 embedding took 21.5 s of compile CPU that way). Numba's cache keys each by its
    kind (a closure's cell)."""

    @njit(cache=True, nogil=True)
    def embedding_rows(data, ids, out):
        for i in range(ids.shape[0]):
            _deq_row(kind, data[ids[i]], out[i])

    return embedding_rows


# --------------------------------------------------------------------------- matmul
@njit(parallel=True, cache=True, nogil=True)
def mm_kernel(kind, data, X, out, rb):
    """out[t, r] = sum_j W[r, j] X[t, j]; rows in chunks of rb, each dequantized once."""
    rows = data.shape[0]
    n, cols = X.shape
    nchunks = (rows + rb - 1) // rb
    for c in prange(nchunks):
        r0 = c * rb
        r1 = min(rows, r0 + rb)
        buf = np.empty((rb, cols), np.float32)
        for r in range(r0, r1):
            deq_row(kind, data[r], buf[r - r0])
        for t in range(n):
            xt = X[t]
            for r in range(r0, r1):
                out[t, r] = dot16(buf[r - r0], xt)
