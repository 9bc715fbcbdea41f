"""Batched decode: Y[v] = W @ X[v] for a few vectors, each weight block unpacked once.

Concurrent sessions decode one token each per step. Running them through `matvec` one by
one streams every matrix once per session; the prefill GEMM (`matmul`) dequantizes a row
block to a float buffer first, which costs 3-5x a matvec at 1-4 rows on SmolLM2's and
Qwen2.5-0.5B's shapes (`python benchmarks/kernels.py --paths portable --n 4`). These
kernels read a block, unpack it into registers, and apply it to up to `GROUP` vectors.

Per vector, the float operations are the ones the portable `mv_*` kernel does, in the
same order (the same lane layout, the same expression per lane, the same horizontal sum),
so a batched row equals the single-vector result bit for bit: a session decodes the same
tokens alone or beside others. tests/unit/test_qmatvec_batch.py holds them to that.
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

from edgerun.ops._simd import dot16  # noqa: E402
from edgerun.ops.portable.kernels import _f16at, _q4k_sm, block_sums, deq_row, q6_value  # noqa: E402

GROUP = 4  # vectors per pass over a row: 4 x 16 lane accumulators stay in registers
F0 = np.float32(0.0)


@intrinsic
def _stack64(typingctx):
    """Pointer to 64 uninitialised float32 on the stack (GROUP x 16 lane accumulators)."""

    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=ir.Constant(ir.IntType(64), 64))

    return types.CPointer(types.float32)(), codegen


@intrinsic
def _stack256(typingctx):
    """Pointer to 256 uninitialised float32 on the stack (one unpacked Q6_K super-block)."""

    def codegen(context, builder, sig, args):
        return cgutils.alloca_once(builder, ir.FloatType(), size=ir.Constant(ir.IntType(64), 256))

    return types.CPointer(types.float32)(), codegen


@njit(inline="always")
def _hsum_at(acc, off):
    """hsum16 of acc[off : off + 16], in hsum16's order."""
    t = np.float32(0.0)
    for l in range(16):
        t += acc[off + l]
    return t


@njit(cache=True, nogil=True)
def _block_sums_all(X, size):
    nv = X.shape[0]
    nb = X.shape[1] // size
    out = np.empty((nv, nb), np.float32)
    for v in range(nv):
        out[v] = block_sums(X[v], size)
    return out


@njit(parallel=True, cache=True, nogil=True)
def mvb_q8_0(data, X, out):
    rows = data.shape[0]
    nv, cols = X.shape
    nb = cols // 32
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(_stack64(), 64)
        wq = numba.carray(_stack64(), 64)
        for v0 in range(0, nv, GROUP):
            g = min(GROUP, nv - v0)
            for j in range(g * 16):
                acc[j] = F0
            for b in range(nb):
                blk = row[b * 34 : b * 34 + 34]
                d = _f16at(blk, 0)
                for l in range(32):
                    wq[l] = np.float32(np.int8(blk[2 + l]))
                for v in range(g):
                    xb = X[v0 + v, b * 32 : b * 32 + 32]
                    o = v * 16
                    for l in range(16):
                        acc[o + l] += d * (wq[l] * xb[l] + wq[16 + l] * xb[16 + l])
            for v in range(g):
                out[v0 + v, r] = _hsum_at(acc, v * 16)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q4_0(data, X, out):
    rows = data.shape[0]
    nv, cols = X.shape
    nb = cols // 32
    xs = _block_sums_all(X, 32)
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(_stack64(), 64)
        wq = numba.carray(_stack64(), 64)
        dsum = numba.carray(_stack64(), 64)
        for v0 in range(0, nv, GROUP):
            g = min(GROUP, nv - v0)
            for j in range(g * 16):
                acc[j] = F0
            for v in range(g):
                dsum[v] = F0
            for b in range(nb):
                blk = row[b * 18 : b * 18 + 18]
                d = _f16at(blk, 0)
                for l in range(16):
                    wq[l] = np.float32(blk[2 + l] & 15)
                    wq[16 + l] = np.float32(blk[2 + l] >> 4)
                for v in range(g):
                    xb = X[v0 + v, b * 32 : b * 32 + 32]
                    o = v * 16
                    for l in range(16):
                        acc[o + l] += d * (wq[l] * xb[l] + wq[16 + l] * xb[16 + l])
                    dsum[v] += d * xs[v0 + v, b]
            for v in range(g):
                out[v0 + v, r] = _hsum_at(acc, v * 16) - np.float32(8.0) * dsum[v]


@njit(parallel=True, cache=True, nogil=True)
def mvb_q4_1(data, X, out):
    rows = data.shape[0]
    nv, cols = X.shape
    nb = cols // 32
    xs = _block_sums_all(X, 32)
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(_stack64(), 64)
        wq = numba.carray(_stack64(), 64)
        msum = numba.carray(_stack64(), 64)
        for v0 in range(0, nv, GROUP):
            g = min(GROUP, nv - v0)
            for j in range(g * 16):
                acc[j] = F0
            for v in range(g):
                msum[v] = F0
            for b in range(nb):
                blk = row[b * 20 : b * 20 + 20]
                d = _f16at(blk, 0)
                m = _f16at(blk, 2)
                for l in range(16):
                    wq[l] = np.float32(blk[4 + l] & 15)
                    wq[16 + l] = np.float32(blk[4 + l] >> 4)
                for v in range(g):
                    xb = X[v0 + v, b * 32 : b * 32 + 32]
                    o = v * 16
                    for l in range(16):
                        acc[o + l] += d * (wq[l] * xb[l] + wq[16 + l] * xb[16 + l])
                    msum[v] += m * xs[v0 + v, b]
            for v in range(g):
                out[v0 + v, r] = _hsum_at(acc, v * 16) + msum[v]


@njit(parallel=True, cache=True, nogil=True)
def mvb_q5_0(data, X, out, hb):
    """hb: portable.kernels.Q5_HBITS (mv_q5_0's high-bit table, so the sums match)."""
    rows = data.shape[0]
    nv, cols = X.shape
    nb = cols // 32
    xs = _block_sums_all(X, 32)
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(_stack64(), 64)
        wq = numba.carray(_stack64(), 64)
        dsum = numba.carray(_stack64(), 64)
        for v0 in range(0, nv, GROUP):
            g = min(GROUP, nv - v0)
            for j in range(g * 16):
                acc[j] = F0
            for v in range(g):
                dsum[v] = F0
            for b in range(nb):
                blk = row[b * 22 : b * 22 + 22]
                d = _f16at(blk, 0)
                h0 = hb[blk[2]]
                h1 = hb[blk[3]]
                h2 = hb[blk[4]]
                h3 = hb[blk[5]]
                q = blk[6:22]
                # wq[l] is element l of the block (0..31), built as mv_q5_0 builds it
                for l in range(8):
                    wq[l] = np.float32(q[l] & 15) + h0[l]
                    wq[16 + l] = np.float32(q[l] >> 4) + h2[l]
                    wq[8 + l] = np.float32(q[8 + l] & 15) + h1[l]
                    wq[24 + l] = np.float32(q[8 + l] >> 4) + h3[l]
                for v in range(g):
                    xb = X[v0 + v, b * 32 : b * 32 + 32]
                    o = v * 16
                    for l in range(16):
                        acc[o + l] += d * (wq[l] * xb[l] + wq[16 + l] * xb[16 + l])
                    dsum[v] += d * xs[v0 + v, b]
            for v in range(g):
                out[v0 + v, r] = _hsum_at(acc, v * 16) - np.float32(16.0) * dsum[v]


@njit(parallel=True, cache=True, nogil=True)
def mvb_q4_k(data, X, out):
    """A super-block is unpacked whole (256 weights, 4 x (d1, d2, m1, m2)), then each
    vector takes it in mv_q4_k's (group, half) order."""
    rows = data.shape[0]
    nv, cols = X.shape
    nb = cols // 256
    xs = _block_sums_all(X, 32)
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(_stack64(), 64)
        wq = numba.carray(_stack256(), 256)
        sc = numba.carray(_stack64(), 64)  # per group g: d1, d2, m1, m2 at 4g .. 4g + 3
        msum = numba.carray(_stack64(), 64)
        for v0 in range(0, nv, GROUP):
            g = min(GROUP, nv - v0)
            for j in range(g * 16):
                acc[j] = F0
            for v in range(g):
                msum[v] = F0
            for b in range(nb):
                blk = row[b * 144 : b * 144 + 144]
                d = _f16at(blk, 0)
                dmin = _f16at(blk, 2)
                s = blk[4:16]
                for gi in range(4):
                    sc1, m1 = _q4k_sm(s, 2 * gi)
                    sc2, m2 = _q4k_sm(s, 2 * gi + 1)
                    sc[4 * gi] = d * np.float32(sc1)
                    sc[4 * gi + 1] = d * np.float32(sc2)
                    sc[4 * gi + 2] = np.float32(m1)
                    sc[4 * gi + 3] = np.float32(m2)
                    for k in range(2):
                        q = blk[16 + 32 * gi + 16 * k : 32 + 32 * gi + 16 * k]
                        o = 64 * gi + 32 * k
                        for l in range(16):
                            wq[o + l] = np.float32(q[l] & 15)
                            wq[o + 16 + l] = np.float32(q[l] >> 4)
                for v in range(g):
                    xv = X[v0 + v]
                    xsv = xs[v0 + v]
                    o = v * 16
                    for gi in range(4):
                        d1 = sc[4 * gi]
                        d2 = sc[4 * gi + 1]
                        msum[v] += dmin * (
                            sc[4 * gi + 2] * xsv[8 * b + 2 * gi]
                            + sc[4 * gi + 3] * xsv[8 * b + 2 * gi + 1]
                        )
                        for k in range(2):
                            xo = b * 256 + 64 * gi + 16 * k
                            xa = xv[xo : xo + 16]
                            xb = xv[xo + 32 : xo + 48]
                            wo = 64 * gi + 32 * k
                            for l in range(16):
                                acc[o + l] += d1 * (wq[wo + l] * xa[l]) + d2 * (
                                    wq[wo + 16 + l] * xb[l]
                                )
            for v in range(g):
                out[v0 + v, r] = _hsum_at(acc, v * 16) - msum[v]


@njit(inline="always")
def _q6_unpack(wq, ql, qh, s):
    """mv_q6_k's 16 values of chunk s (0..3)."""
    for l in range(16):
        wq[l] = q6_value(ql, qh, l, s)


@njit(parallel=True, cache=True, nogil=True)
def mvb_q6_k(data, X, out):
    """A super-block is unpacked into 16 groups of 16 in mv_q6_k's (h, k, s) order, then
    each vector takes the groups in that order."""
    rows = data.shape[0]
    nv, cols = X.shape
    nb = cols // 256
    for r in prange(rows):
        row = data[r]
        acc = numba.carray(_stack64(), 64)
        wq = numba.carray(_stack256(), 256)
        ds = numba.carray(_stack64(), 64)
        xoff = np.empty(16, np.int64)
        for v0 in range(0, nv, GROUP):
            g = min(GROUP, nv - v0)
            for j in range(g * 16):
                acc[j] = F0
            for b in range(nb):
                blk = row[b * 210 : b * 210 + 210]
                d = _f16at(blk, 208)
                j = 0
                for h in range(2):
                    for k in range(2):
                        qh = blk[128 + h * 32 + 16 * k : 144 + h * 32 + 16 * k]
                        for s in range(4):
                            qo = h * 64 + (s & 1) * 32 + 16 * k
                            ql = blk[qo : qo + 16]
                            ds[j] = d * np.float32(np.int8(blk[192 + 8 * h + 2 * s + k]))
                            w = wq[j * 16 : j * 16 + 16]
                            if s == 0:
                                _q6_unpack(w, ql, qh, 0)
                            elif s == 1:
                                _q6_unpack(w, ql, qh, 1)
                            elif s == 2:
                                _q6_unpack(w, ql, qh, 2)
                            else:
                                _q6_unpack(w, ql, qh, 3)
                            xoff[j] = b * 256 + h * 128 + 32 * s + 16 * k
                            j += 1
                for v in range(g):
                    xv = X[v0 + v]
                    o = v * 16
                    for j in range(16):
                        xb = xv[xoff[j] : xoff[j] + 16]
                        dj = ds[j]
                        wo = j * 16
                        for l in range(16):
                            acc[o + l] += dj * (wq[wo + l] * xb[l])
            for v in range(g):
                out[v0 + v, r] = _hsum_at(acc, v * 16)


@njit(parallel=True, cache=True, nogil=True)
def mvb_deq(kind, data, X, out):
    """Batched decode of kernels.DEQ_KINDS: each row dequantized once, then dot16 with
    every vector (the float operations of kernels.mv_deq: rows equal it bit for bit)."""
    rows = data.shape[0]
    n, cols = X.shape
    for r in prange(rows):
        buf = np.empty(cols, np.float32)
        deq_row(kind, data[r], buf)
        for v in range(n):
            out[v, r] = dot16(buf, X[v])
