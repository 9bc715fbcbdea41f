"""Portable Numba kernels for edgerun's low-bit formats Q3_G64 and Q2_G64.

Layouts: see edgerun.quant.lowbit (64-element blocks, x = d * q + m; one byte per lane
holds elements l, 16+l, 32+l, 48+l). The kernels follow portable.kernels's recipe: 16
lane accumulators, the block min factored out as m * sum(x_block) with the block sums
computed once per call, float32 throughout.

Entry points take raw uint8 [rows, row_bytes] blocks:
- mv_q3_g64 / mv_q2_g64(data, x, out)         y = W @ x
- mm_lowbit(bits, data, X, out, rb)            Y = X @ W.T (rows dequantized once per chunk)
- embedding_rows_lowbit(bits, data, ids, out)  rows dequantized (bit-exact with the reference)
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from edgerun.ops._simd import dot16, hsum16, stack16  # noqa: E402
from edgerun.ops.portable.kernels import _f16at, block_sums  # noqa: E402

F0 = np.float32(0.0)


@njit(parallel=True, cache=True, nogil=True)
def mv_q2_g64(data, x, out):
    rows = data.shape[0]
    nb = x.shape[0] // 64
    xs = block_sums(x, 64)
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(stack16(), 16)
        for l in range(16):
            acc[l] = F0
        msum = F0
        for b in range(nb):
            blk = row[b * 20 : b * 20 + 20]
            xb = x[b * 64 : b * 64 + 64]
            d = _f16at(blk, 0)
            m = _f16at(blk, 2)
            q = blk[4:20]
            # two runs of 8 lanes: one loop of 16 here is not vectorized by LLVM's SLP
            # (3x slower), two of 8 are
            for l in range(8):
                v = np.int32(q[l])
                acc[l] += d * (
                    np.float32(v & 3) * xb[l]
                    + np.float32((v >> 2) & 3) * xb[16 + l]
                    + np.float32((v >> 4) & 3) * xb[32 + l]
                    + np.float32((v >> 6) & 3) * xb[48 + l]
                )
            for l in range(8):
                v = np.int32(q[8 + l])
                acc[8 + l] += d * (
                    np.float32(v & 3) * xb[8 + l]
                    + np.float32((v >> 2) & 3) * xb[24 + l]
                    + np.float32((v >> 4) & 3) * xb[40 + l]
                    + np.float32((v >> 6) & 3) * xb[56 + l]
                )
            msum += m * xs[b]
        out[r] = hsum16(acc) + msum


@njit(parallel=True, cache=True, nogil=True)
def mv_q3_g64(data, x, out):
    rows = data.shape[0]
    nb = x.shape[0] // 64
    xs = block_sums(x, 64)
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(stack16(), 16)
        for l in range(16):
            acc[l] = F0
        msum = F0
        for b in range(nb):
            blk = row[b * 28 : b * 28 + 28]
            xb = x[b * 64 : b * 64 + 64]
            d = _f16at(blk, 0)
            m = _f16at(blk, 2)
            ql = blk[4:20]
            qh = blk[20:28]
            for l in range(8):
                v = np.int32(ql[l])
                h = np.int32(qh[l])
                acc[l] += d * (
                    np.float32((v & 3) | ((h & 1) << 2)) * xb[l]
                    + np.float32(((v >> 2) & 3) | (h & 4)) * xb[16 + l]
                    + np.float32(((v >> 4) & 3) | ((h >> 2) & 4)) * xb[32 + l]
                    + np.float32((v >> 6) | ((h >> 4) & 4)) * xb[48 + l]
                )
            for l in range(8):
                v = np.int32(ql[8 + l])
                h = np.int32(qh[l]) >> 1
                acc[8 + l] += d * (
                    np.float32((v & 3) | ((h & 1) << 2)) * xb[8 + l]
                    + np.float32(((v >> 2) & 3) | (h & 4)) * xb[24 + l]
                    + np.float32(((v >> 4) & 3) | ((h >> 2) & 4)) * xb[40 + l]
                    + np.float32((v >> 6) | ((h >> 4) & 4)) * xb[56 + l]
                )
            msum += m * xs[b]
        out[r] = hsum16(acc) + msum


@njit(cache=True, nogil=True)
def deq_row_lowbit(bits, row, dst):
    """One row of raw blocks -> float32 dst [cols]; same float ops as the numpy reference."""
    nbytes = 28 if bits == 3 else 20
    for b in range(dst.shape[0] // 64):
        blk = row[b * nbytes : b * nbytes + nbytes]
        o = dst[b * 64 : b * 64 + 64]
        d = _f16at(blk, 0)
        m = _f16at(blk, 2)
        for s in range(4):
            for l in range(16):
                q = (np.int32(blk[4 + l]) >> (2 * s)) & 3
                if bits == 3:
                    h = (np.int32(blk[20 + (l & 7)]) >> (2 * s + (l >> 3))) & 1
                    q |= h << 2
                o[16 * s + l] = d * np.float32(q) + m


@njit(parallel=True, cache=True, nogil=True)
def embedding_rows_lowbit(bits, data, ids, out):
    for i in prange(ids.shape[0]):
        deq_row_lowbit(bits, data[ids[i]], out[i])


@njit(parallel=True, cache=True, nogil=True)
def mm_lowbit(bits, data, X, out, rb):
    """out[t, r] = sum_j W[r, j] X[t, j]; rows in chunks of rb, each dequantized once."""
    rows = data.shape[0]
    n, cols = X.shape
    nchunks = (rows + rb - 1) // rb
    for c in prange(nchunks):
        r0 = c * rb
        r1 = min(rows, r0 + rb)
        buf = np.empty((rb, cols), np.float32)
        for r in range(r0, r1):
            deq_row_lowbit(bits, data[r], buf[r - r0])
        for t in range(n):
            xt = X[t]
            for r in range(r0, r1):
                out[t, r] = dot16(buf[r - r0], xt)


_MM_ROW_BLOCK = 16


def mm_q3_g64(data, X, out):
    mm_lowbit(3, data, X, out, _MM_ROW_BLOCK)


def mm_q2_g64(data, X, out):
    mm_lowbit(2, data, X, out, _MM_ROW_BLOCK)


def emb_q3_g64(data, ids, out):
    embedding_rows_lowbit(3, data, ids, out)


def emb_q2_g64(data, ids, out):
    embedding_rows_lowbit(2, data, ids, out)
