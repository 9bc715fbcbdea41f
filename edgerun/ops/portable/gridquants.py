"""Portable Numba kernels for GGML's grid formats IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S
and IQ1_S (layouts: edgerun.quant.gridquants).

- `deq_grid(kind, row, dst)`: one row dequantized with the reference's float32
  operations (bit-exact), which portable.kernels.deq_row calls for these kinds; the
  GEMM, the batched decode and the embedding rows go through it.
- `mv_grid(kind, data, x, out)`: decode matvec, fused: per group of 8 (IQ2, IQ1) or 4
  (IQ3) weights one grid row times its signs times x into 8 lane accumulators (a
  sub-block's sum, scaled once: d * s * sum, into 8 more), with no dequantized row in
  memory. It equals dequantize-then-dot to float32 rounding, not bit for bit. Sums into
  lanes, not one scalar: a scalar's chain of dependent adds ran ~40x slower.

The grids live as float32 tables (the level vectors) and the signs as +1/-1 float32
tables (KSIGNS's 128 patterns; all 256 bytes for IQ2_S and IQ3_S, which store the sign
bits directly), so that a group is three 8-float loads and two multiplies.
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from edgerun.ops._simd import h2f, stack16  # noqa: E402
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
def f16_at(a, i):
    return h2f(np.uint16(a[i]) | (np.uint16(a[i + 1]) << np.uint16(8)))


@njit(inline="always")
def u32_at(a, i):
    return (
        np.uint32(a[i])
        | (np.uint32(a[i + 1]) << np.uint32(8))
        | (np.uint32(a[i + 2]) << np.uint32(16))
        | (np.uint32(a[i + 3]) << np.uint32(24))
    )


@njit(inline="always")
def _u16(a, i):
    return np.int32(a[i]) | (np.int32(a[i + 1]) << 8)


# the same on row r of a 2-D array (a view per row costs an NRT reference count)
@njit(inline="always")
def _f162(a, r, i):
    return h2f(np.uint16(a[r, i]) | (np.uint16(a[r, i + 1]) << np.uint16(8)))


@njit(inline="always")
def _u322(a, r, i):
    return (
        np.uint32(a[r, i])
        | (np.uint32(a[r, i + 1]) << np.uint32(8))
        | (np.uint32(a[r, i + 2]) << np.uint32(16))
        | (np.uint32(a[r, i + 3]) << np.uint32(24))
    )


@njit(inline="always")
def _u162(a, r, i):
    return np.int32(a[r, i]) | (np.int32(a[r, i + 1]) << 8)


@njit(inline="always")
def _put(dst, o, db, g, gi, s, si, n):
    """dst[o:o+n] = db * g[gi, :n] * s[si, :n] with s = +-1 (the reference's
    (db * grid) * signs)."""
    for j in range(n):
        dst[o + j] = db * g[gi, j] * s[si, j]


@njit(inline="always")
def _put_shift(dst, o, db, g, gi, s, si, s0):
    """As _put for a 4-level grid row whose signs are s[si, s0:s0+4]."""
    for j in range(4):
        dst[o + j] = db * g[gi, j] * s[si, s0 + j]


@njit(cache=True, nogil=True)
def deq_grid(kind, row, dst):
    """One row of raw super-blocks -> float32 dst [cols], bit-exact with the reference.
    Flat offsets throughout: a slice per group costs an NRT reference count."""
    for b in range(dst.shape[0] // 256):
        o = b * 256
        if kind == KIND_IQ2_XXS:
            p = b * 66
            d = f16_at(row, p)
            for ib in range(8):
                aux = u32_at(row, p + 2 + 8 * ib + 4)
                db = d * (HALF + np.float32(aux >> np.uint32(28))) * QUARTER
                for l in range(4):
                    si = (aux >> np.uint32(7 * l)) & np.uint32(127)
                    gi = row[p + 2 + 8 * ib + l]
                    _put(dst, o + 32 * ib + 8 * l, db, G2XXS, gi, KSIGN8, si, 8)
        elif kind == KIND_IQ2_XS:
            p = b * 74
            d = f16_at(row, p)
            for k in range(16):
                sc = (row[p + 66 + (k >> 1)] >> (4 * (k & 1))) & 15
                db = d * (HALF + np.float32(sc)) * QUARTER
                for l in range(2):
                    q = _u16(row, p + 2 + 4 * k + 2 * l)
                    _put(dst, o + 16 * k + 8 * l, db, G2XS, q & 511, KSIGN8, q >> 9, 8)
        elif kind == KIND_IQ2_S:
            p = b * 82
            d = f16_at(row, p)
            for k in range(16):
                sc = (row[p + 74 + (k >> 1)] >> (4 * (k & 1))) & 15
                db = d * (HALF + np.float32(sc)) * QUARTER
                for l in range(2):
                    i = 2 * k + l
                    qh = (np.int32(row[p + 66 + (i >> 2)]) >> (2 * (i & 3))) & 3
                    q = np.int32(row[p + 2 + i]) | (qh << 8)
                    _put(dst, o + 8 * i, db, G2S, q, SIGN8, row[p + 34 + i], 8)
        elif kind == KIND_IQ3_XXS:
            p = b * 98
            d = f16_at(row, p)
            for ib in range(8):
                aux = u32_at(row, p + 66 + 4 * ib)
                db = d * (HALF + np.float32(aux >> np.uint32(28))) * HALF
                for l in range(4):
                    si = (aux >> np.uint32(7 * l)) & np.uint32(127)
                    oo = o + 32 * ib + 8 * l
                    g0 = row[p + 2 + 8 * ib + 2 * l]
                    g1 = row[p + 2 + 8 * ib + 2 * l + 1]
                    _put_shift(dst, oo, db, G3XXS, g0, KSIGN8, si, 0)
                    _put_shift(dst, oo + 4, db, G3XXS, g1, KSIGN8, si, 4)
        elif kind == KIND_IQ3_S:
            p = b * 110
            d = f16_at(row, p)
            for ib in range(8):
                sc = (row[p + 106 + (ib >> 1)] >> (4 * (ib & 1))) & 15
                db = d * np.float32(1 + 2 * sc)
                for l in range(4):
                    sb = row[p + 74 + 4 * ib + l]
                    for h in range(2):
                        i = 8 * ib + 2 * l + h
                        qh = (np.int32(row[p + 66 + (i >> 3)]) >> (i & 7)) & 1
                        q = np.int32(row[p + 2 + i]) | (qh << 8)
                        _put_shift(dst, o + 32 * ib + 8 * l + 4 * h, db, G3S, q, SIGN8, sb, 4 * h)
        elif kind == KIND_IQ1_S:
            p = b * 50
            d = f16_at(row, p)
            for ib in range(8):
                qh = _u16(row, p + 34 + 2 * ib)
                dl = d * np.float32(2 * ((qh >> 12) & 7) + 1)
                delta = -IQ1_DELTA if qh & 0x8000 else IQ1_DELTA
                for l in range(4):
                    gi = np.int32(row[p + 2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)
                    oo = o + 32 * ib + 8 * l
                    for j in range(8):
                        dst[oo + j] = dl * (G1S[gi, j] + delta)


@njit(inline="always")
def _lanes(lane, o, g, gi, s, si, s0, x, xo, n):
    """lane[o + j] += g[gi, j] s[si, s0 + j] x[xo + j] over j < n."""
    for j in range(n):
        lane[o + j] += g[gi, j] * s[si, s0 + j] * x[xo + j]


@njit(inline="always")
def _flush(lane, db):
    """Lanes 8..15 += db * lanes 0..7 (one sub-block's sum, scaled), which restart at 0."""
    for j in range(8):
        lane[8 + j] += db * lane[j]
        lane[j] = F0


@njit(inline="always")
def _row_dot(kind, data, r, x, lane):
    """sum_j W[r, j] x[j] for row r of raw super-blocks (the fused decode form): 8 lanes
    sum a sub-block's grid x signs x x, 8 more the scaled sub-block sums."""
    for j in range(16):
        lane[j] = F0
    for b in range(x.shape[0] // 256):
        xo = b * 256
        if kind == KIND_IQ2_XXS:
            p = b * 66
            d = _f162(data, r, p)
            for ib in range(8):
                aux = _u322(data, r, p + 2 + 8 * ib + 4)
                for l in range(4):
                    si = (aux >> np.uint32(7 * l)) & np.uint32(127)
                    gi = data[r, p + 2 + 8 * ib + l]
                    _lanes(lane, 0, G2XXS, gi, KSIGN8, si, 0, x, xo + 32 * ib + 8 * l, 8)
                _flush(lane, d * (HALF + np.float32(aux >> np.uint32(28))) * QUARTER)
        elif kind == KIND_IQ2_XS:
            p = b * 74
            d = _f162(data, r, p)
            for k in range(16):
                sc = (data[r, p + 66 + (k >> 1)] >> (4 * (k & 1))) & 15
                for l in range(2):
                    q = _u162(data, r, p + 2 + 4 * k + 2 * l)
                    _lanes(lane, 0, G2XS, q & 511, KSIGN8, q >> 9, 0, x, xo + 16 * k + 8 * l, 8)
                _flush(lane, d * (HALF + np.float32(sc)) * QUARTER)
        elif kind == KIND_IQ2_S:
            p = b * 82
            d = _f162(data, r, p)
            for k in range(16):
                sc = (data[r, p + 74 + (k >> 1)] >> (4 * (k & 1))) & 15
                for l in range(2):
                    i = 2 * k + l
                    qh = (np.int32(data[r, p + 66 + (i >> 2)]) >> (2 * (i & 3))) & 3
                    q = np.int32(data[r, p + 2 + i]) | (qh << 8)
                    _lanes(lane, 0, G2S, q, SIGN8, data[r, p + 34 + i], 0, x, xo + 8 * i, 8)
                _flush(lane, d * (HALF + np.float32(sc)) * QUARTER)
        elif kind == KIND_IQ3_XXS:
            p = b * 98
            d = _f162(data, r, p)
            for ib in range(8):
                aux = _u322(data, r, p + 66 + 4 * ib)
                for l in range(4):
                    si = (aux >> np.uint32(7 * l)) & np.uint32(127)
                    xx = xo + 32 * ib + 8 * l
                    g0 = data[r, p + 2 + 8 * ib + 2 * l]
                    g1 = data[r, p + 2 + 8 * ib + 2 * l + 1]
                    _lanes(lane, 0, G3XXS, g0, KSIGN8, si, 0, x, xx, 4)
                    _lanes(lane, 4, G3XXS, g1, KSIGN8, si, 4, x, xx + 4, 4)
                _flush(lane, d * (HALF + np.float32(aux >> np.uint32(28))) * HALF)
        elif kind == KIND_IQ3_S:
            p = b * 110
            d = _f162(data, r, p)
            for ib in range(8):
                sc = (data[r, p + 106 + (ib >> 1)] >> (4 * (ib & 1))) & 15
                for l in range(4):
                    sb = data[r, p + 74 + 4 * ib + l]
                    xx = xo + 32 * ib + 8 * l
                    i = 8 * ib + 2 * l
                    qh = np.int32(data[r, p + 66 + (i >> 3)]) >> (i & 7)
                    q0 = np.int32(data[r, p + 2 + i]) | ((qh & 1) << 8)
                    q1 = np.int32(data[r, p + 3 + i]) | ((qh & 2) << 7)
                    _lanes(lane, 0, G3S, q0, SIGN8, sb, 0, x, xx, 4)
                    _lanes(lane, 4, G3S, q1, SIGN8, sb, 4, x, xx + 4, 4)
                _flush(lane, d * np.float32(1 + 2 * sc))
        elif kind == KIND_IQ1_S:
            p = b * 50
            d = _f162(data, r, p)
            for ib in range(8):
                qh = _u162(data, r, p + 34 + 2 * ib)
                delta = -IQ1_DELTA if qh & 0x8000 else IQ1_DELTA
                for l in range(4):
                    gi = np.int32(data[r, p + 2 + 4 * ib + l]) | (((qh >> (3 * l)) & 7) << 8)
                    xx = xo + 32 * ib + 8 * l
                    for j in range(8):
                        lane[j] += (G1S[gi, j] + delta) * x[xx + j]
                _flush(lane, d * np.float32(2 * ((qh >> 12) & 7) + 1))
    acc = F0
    for j in range(8):
        acc += lane[8 + j]
    return acc


@njit(parallel=True, cache=True, nogil=True)
def mv_grid(kind, data, x, out):
    """Decode matvec y = W @ x of a grid format, fused (row_dot per row)."""
    for r in prange(data.shape[0]):
        lane = numba.carray(stack16(), 16)
        out[r] = _row_dot(kind, data, r, x, lane)


@njit(parallel=True, cache=True, nogil=True)
def mvb_grid(kind, data, X, out):
    """Batched decode out[v] = W @ X[v]: mv_grid's row sums for each vector (the row read
    from cache after the first), so every row equals mv_grid's bit for bit."""
    n = X.shape[0]
    for r in prange(data.shape[0]):
        lane = numba.carray(stack16(), 16)
        for v in range(n):
            out[v, r] = _row_dot(kind, data, r, X[v], lane)
