"""Portable Numba kernels for GGML's grid formats IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S
and IQ1_S (layouts: edgerun.quant.gridquants).

- `deq_grid(kind, row, dst)`: one row dequantized with the reference's float32
  operations (bit-exact), which portable.kernels.deq_row calls for these kinds; the
  GEMM, the batched decode and the embedding rows go through it.
- `mv_grid(kind, data, x, out)`: decode matvec, fused: per group of 8 (IQ2, IQ1) or 4
  (IQ3) weights one grid row times its signs times x, summed per sub-block and scaled
  once per sub-block (d * s * sum), with no dequantized row in memory. It equals
  dequantize-then-dot to float32 rounding, not bit for bit.

The grids live as float32 tables (the level vectors) and the signs as +1/-1 float32
tables (KSIGNS's 128 patterns; all 256 bytes for IQ2_S and IQ3_S, which store the sign
bits directly), so that a group is three 8-float loads and two multiplies.
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from edgerun.ops._simd import h2f  # noqa: E402
from edgerun.quant.gridquants import IQ1_DELTA  # noqa: E402
from edgerun.quant.iq_grids import (  # noqa: E402
    IQ1S_GRID,
    IQ2S_GRID,
    IQ2XS_GRID,
    IQ2XXS_GRID,
    IQ3S_GRID,
    IQ3XXS_GRID,
    KSIGNS,
)

# kinds continue portable.kernels' numbering (kernels.deq_row dispatches on them)
KIND_IQ2_XXS = 15
KIND_IQ2_XS = 16
KIND_IQ2_S = 17
KIND_IQ3_XXS = 18
KIND_IQ3_S = 19
KIND_IQ1_S = 20
GRID_KINDS = (KIND_IQ2_XXS, KIND_IQ2_XS, KIND_IQ2_S, KIND_IQ3_XXS, KIND_IQ3_S, KIND_IQ1_S)

G2XXS = IQ2XXS_GRID.astype(np.float32)
G2XS = IQ2XS_GRID.astype(np.float32)
G2S = IQ2S_GRID.astype(np.float32)
G3XXS = IQ3XXS_GRID.astype(np.float32)
G3S = IQ3S_GRID.astype(np.float32)
G1S = IQ1S_GRID.astype(np.float32)
# SIGN8[b, j] = -1 where bit j of byte b is set; KSIGN8 the same for KSIGNS's 128 bytes
SIGN8 = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, -1.0, 1.0).astype(np.float32)
KSIGN8 = SIGN8[KSIGNS]

F0 = np.float32(0.0)
HALF = np.float32(0.5)
QUARTER = np.float32(0.25)


@njit(inline="always")
def _f16(a, i):
    return h2f(np.uint16(a[i]) | (np.uint16(a[i + 1]) << np.uint16(8)))


@njit(inline="always")
def _u32(a, i):
    return (
        np.uint32(a[i])
        | (np.uint32(a[i + 1]) << np.uint32(8))
        | (np.uint32(a[i + 2]) << np.uint32(16))
        | (np.uint32(a[i + 3]) << np.uint32(24))
    )


@njit(inline="always")
def _u16(a, i):
    return np.int32(a[i]) | (np.int32(a[i + 1]) << 8)


@njit(inline="always")
def _put8(o, db, g, s):
    """o[0:8] = db * g * s with s = +-1 (the reference's (db * grid) * signs)."""
    for j in range(8):
        o[j] = db * g[j] * s[j]


@njit(inline="always")
def _put4(o, db, g, s):
    for j in range(4):
        o[j] = db * g[j] * s[j]


@njit(cache=True, nogil=True)
def deq_grid(kind, row, dst):
    """One row of raw super-blocks -> float32 dst [cols], bit-exact with the reference."""
    for b in range(dst.shape[0] // 256):
        o = dst[b * 256 : b * 256 + 256]
        if kind == KIND_IQ2_XXS:
            blk = row[b * 66 : b * 66 + 66]
            d = _f16(blk, 0)
            for ib in range(8):
                aux = _u32(blk, 2 + 8 * ib + 4)
                db = d * (HALF + np.float32(aux >> np.uint32(28))) * QUARTER
                for l in range(4):
                    si = (aux >> np.uint32(7 * l)) & np.uint32(127)
                    g = G2XXS[blk[2 + 8 * ib + l]]
                    _put8(o[32 * ib + 8 * l :], db, g, KSIGN8[si])
        elif kind == KIND_IQ2_XS:
            blk = row[b * 74 : b * 74 + 74]
            d = _f16(blk, 0)
            for k in range(16):
                sc = (blk[66 + (k >> 1)] >> (4 * (k & 1))) & 15
                db = d * (HALF + np.float32(sc)) * QUARTER
                for l in range(2):
                    q = _u16(blk, 2 + 4 * k + 2 * l)
                    _put8(o[16 * k + 8 * l :], db, G2XS[q & 511], KSIGN8[q >> 9])
        elif kind == KIND_IQ2_S:
            blk = row[b * 82 : b * 82 + 82]
            d = _f16(blk, 0)
            for k in range(16):
                sc = (blk[74 + (k >> 1)] >> (4 * (k & 1))) & 15
                db = d * (HALF + np.float32(sc)) * QUARTER
                for l in range(2):
                    i = 2 * k + l
                    q = np.int32(blk[2 + i]) | (
                        ((np.int32(blk[66 + (i >> 2)]) >> (2 * (i & 3))) & 3) << 8
                    )
                    _put8(o[8 * i :], db, G2S[q], SIGN8[blk[34 + i]])
        elif kind == KIND_IQ3_XXS:
            blk = row[b * 98 : b * 98 + 98]
            d = _f16(blk, 0)
            for ib in range(8):
                aux = _u32(blk, 66 + 4 * ib)
                db = d * (HALF + np.float32(aux >> np.uint32(28))) * HALF
                for l in range(4):
                    s8 = KSIGN8[(aux >> np.uint32(7 * l)) & np.uint32(127)]
                    oo = o[32 * ib + 8 * l :]
                    _put4(oo, db, G3XXS[blk[2 + 8 * ib + 2 * l]], s8)
                    _put4(oo[4:], db, G3XXS[blk[2 + 8 * ib + 2 * l + 1]], s8[4:])
        elif kind == KIND_IQ3_S:
            blk = row[b * 110 : b * 110 + 110]
            d = _f16(blk, 0)
            for ib in range(8):
                sc = (blk[106 + (ib >> 1)] >> (4 * (ib & 1))) & 15
                db = d * np.float32(1 + 2 * sc)
                for l in range(4):
                    s8 = SIGN8[blk[74 + 4 * ib + l]]
                    oo = o[32 * ib + 8 * l :]
                    for h in range(2):
                        i = 8 * ib + 2 * l + h
                        q = np.int32(blk[2 + i]) | (
                            ((np.int32(blk[66 + (i >> 3)]) >> (i & 7)) & 1) << 8
                        )
                        _put4(oo[4 * h :], db, G3S[q], s8[4 * h :])
        elif kind == KIND_IQ1_S:
            blk = row[b * 50 : b * 50 + 50]
            d = _f16(blk, 0)
            for ib in range(8):
                qh = _u16(blk, 34 + 2 * ib)
                dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
                delta = -IQ1_DELTA if qh & 0x8000 else IQ1_DELTA
                for l in range(4):
                    g = G1S[np.int32(blk[2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)]
                    oo = o[32 * ib + 8 * l :]
                    for j in range(8):
                        oo[j] = dl * (g[j] + delta)


@njit(inline="always")
def _dot8(g, s, x):
    a = F0
    for j in range(8):
        a += g[j] * s[j] * x[j]
    return a


@njit(inline="always")
def _dot4(g, s, x):
    a = F0
    for j in range(4):
        a += g[j] * s[j] * x[j]
    return a


@njit(cache=True, nogil=True)
def row_dot(kind, row, x):
    """sum_j W[row, j] x[j] for one row of raw super-blocks (the fused decode form)."""
    acc = F0
    for b in range(x.shape[0] // 256):
        xb = x[b * 256 : b * 256 + 256]
        if kind == KIND_IQ2_XXS:
            blk = row[b * 66 : b * 66 + 66]
            d = _f16(blk, 0)
            for ib in range(8):
                aux = _u32(blk, 2 + 8 * ib + 4)
                sub = F0
                for l in range(4):
                    si = (aux >> np.uint32(7 * l)) & np.uint32(127)
                    sub += _dot8(G2XXS[blk[2 + 8 * ib + l]], KSIGN8[si], xb[32 * ib + 8 * l :])
                acc += d * (HALF + np.float32(aux >> np.uint32(28))) * QUARTER * sub
        elif kind == KIND_IQ2_XS:
            blk = row[b * 74 : b * 74 + 74]
            d = _f16(blk, 0)
            for k in range(16):
                sc = (blk[66 + (k >> 1)] >> (4 * (k & 1))) & 15
                sub = F0
                for l in range(2):
                    q = _u16(blk, 2 + 4 * k + 2 * l)
                    sub += _dot8(G2XS[q & 511], KSIGN8[q >> 9], xb[16 * k + 8 * l :])
                acc += d * (HALF + np.float32(sc)) * QUARTER * sub
        elif kind == KIND_IQ2_S:
            blk = row[b * 82 : b * 82 + 82]
            d = _f16(blk, 0)
            for k in range(16):
                sc = (blk[74 + (k >> 1)] >> (4 * (k & 1))) & 15
                sub = F0
                for l in range(2):
                    i = 2 * k + l
                    q = np.int32(blk[2 + i]) | (
                        ((np.int32(blk[66 + (i >> 2)]) >> (2 * (i & 3))) & 3) << 8
                    )
                    sub += _dot8(G2S[q], SIGN8[blk[34 + i]], xb[8 * i :])
                acc += d * (HALF + np.float32(sc)) * QUARTER * sub
        elif kind == KIND_IQ3_XXS:
            blk = row[b * 98 : b * 98 + 98]
            d = _f16(blk, 0)
            for ib in range(8):
                aux = _u32(blk, 66 + 4 * ib)
                sub = F0
                for l in range(4):
                    s8 = KSIGN8[(aux >> np.uint32(7 * l)) & np.uint32(127)]
                    xx = xb[32 * ib + 8 * l :]
                    sub += _dot4(G3XXS[blk[2 + 8 * ib + 2 * l]], s8, xx)
                    sub += _dot4(G3XXS[blk[2 + 8 * ib + 2 * l + 1]], s8[4:], xx[4:])
                acc += d * (HALF + np.float32(aux >> np.uint32(28))) * HALF * sub
        elif kind == KIND_IQ3_S:
            blk = row[b * 110 : b * 110 + 110]
            d = _f16(blk, 0)
            for ib in range(8):
                sc = (blk[106 + (ib >> 1)] >> (4 * (ib & 1))) & 15
                sub = F0
                for l in range(4):
                    s8 = SIGN8[blk[74 + 4 * ib + l]]
                    xx = xb[32 * ib + 8 * l :]
                    for h in range(2):
                        i = 8 * ib + 2 * l + h
                        q = np.int32(blk[2 + i]) | (
                            ((np.int32(blk[66 + (i >> 3)]) >> (i & 7)) & 1) << 8
                        )
                        sub += _dot4(G3S[q], s8[4 * h :], xx[4 * h :])
                acc += d * np.float32(1 + 2 * sc) * sub
        elif kind == KIND_IQ1_S:
            blk = row[b * 50 : b * 50 + 50]
            d = _f16(blk, 0)
            for ib in range(8):
                qh = _u16(blk, 34 + 2 * ib)
                delta = -IQ1_DELTA if qh & 0x8000 else IQ1_DELTA
                sub = F0
                xs = F0
                for l in range(4):
                    g = G1S[np.int32(blk[2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)]
                    xx = xb[32 * ib + 8 * l :]
                    for j in range(8):
                        sub += g[j] * xx[j]
                        xs += xx[j]
                acc += d * np.float32(2 * ((qh >> 12) & 7) + 1) * (sub + delta * xs)
    return acc


@njit(parallel=True, cache=True, nogil=True)
def mv_grid(kind, data, x, out):
    """Decode matvec y = W @ x of a grid format, fused (row_dot per row)."""
    for r in prange(data.shape[0]):
        out[r] = row_dot(kind, data[r], x)
