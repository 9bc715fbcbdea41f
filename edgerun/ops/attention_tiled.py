"""Prefill attention in register tiles: the query rows that share a KV head, 4 at a time.

The one-row kernel (attention.py) takes each (query, head) alone: every key it scores
costs a 16-lane load, a widen and a horizontal sum per head_dim/16 multiply-adds, and the
exponentials are libm calls, one per score. On a 1536-token prefill that leaves attention
at about a third of Qwen2.5-1.5B's time (`edgerun bench -m qwen2.5-coder-1.5b -p 1536`).
Here, per KV head:

- the keys are transposed once per call into K^T [head_dim, positions] (float32), so
  the scores of 4 query rows against 32 keys are 8 vector accumulators filled by one
  broadcast-multiply-add per (row, head_dim element, 16 keys): no horizontal sums, and
  each 16-key load serves 4 rows;
- softmax runs 16 lanes at a time (max16, exp_shift16: a vector exp);
- P V runs 64 output columns at a time: per position, 4 loads of V serve the 4 rows'
  16 accumulators.

A block's 4 rows are consecutive in (token, head-in-group) order, so they may belong to
two tokens: the block scores the keys its last row needs, and each row's softmax and
weights cover only its own causal (and sliding-window) range; the other weights are 0.
The sums run in another order than the one-row kernel's (float32 throughout), so results
agree with it to rounding, not bit for bit. Decode keeps the one-row kernel, which
batched decoding matches bit for bit.

A q8_0 / q4_0 cache (ops/kv_blocks.py) is read in place: its key blocks are dequantised
into K^T as f16 keys are widened there, and each job dequantises the two value blocks
of a position's 64 columns into an L1 buffer as its P V tile reaches them. Those rows
are stored rotated (kv_blocks: R k, R v): attention.attention rotates the queries before
this kernel and turns its output back after it.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from edgerun.ops._simd import (
    axpy16,
    exp_shift16,
    max16,
    stack16,
    store16,
    vsum16,
    widen,
    zero16,
)
from edgerun.ops.attention_decode import capped_score, span
from edgerun.ops.kv_blocks import scratch, values

ROWS = 4  # query rows per tile
KEYS = 64  # keys per score tile
COLS = 64  # output columns per P V tile


def supports(n: int, head_dim: int) -> bool:
    """Whether the tiled kernel takes this call: several queries (one query is decode,
    which keeps the one-row kernel) and a head_dim in whole 64-column tiles (every
    registry model's: 64, 128, 256)."""
    return n >= 2 and head_dim % COLS == 0


@njit(cache=True, parallel=True, nogil=True)
def _transpose_keys(k, length, kt):
    """kt[h, d, t] = key value d of k[h, t] as float32 for t < length, 0 after (the score
    tiles read up to KEYS - 1 positions past the last key; they must be finite)."""
    hkv, hd, lp = kt.shape
    rows = k.shape[1]
    kf = k.reshape(-1)
    nblk = (lp + 15) // 16
    for job in prange(hkv * nblk):
        h = job // nblk
        t0 = (job - h * nblk) * 16
        t1 = min(t0 + 16, lp)
        nk = max(0, min(t1, length) - t0)
        ka, ko = values(kf, (h * rows + t0) * hd, nk * hd, scratch(kf, 16 * hd))
        for d in range(hd):
            for t in range(t0, t1):
                kt[h, d, t] = widen(ka[ko + (t - t0) * hd + d]) if t < length else np.float32(0.0)


@njit(inline="always")
def _store64(o, c, a0, a1, a2, a3, scale):
    """o[c:c + 64] = scale * (a0..a3)."""
    store16(o, c, a0, scale)
    store16(o, c + 16, a1, scale)
    store16(o, c + 32, a2, scale)
    store16(o, c + 48, a3, scale)


@njit(inline="always")
def _axpy64(a0, a1, a2, a3, x, src, base):
    """One row of a register tile: a0..a3 (64 lanes) += x * src[base:base + 64]."""
    axpy16(a0, x, src, base)
    axpy16(a1, x, src, base + 16)
    axpy16(a2, x, src, base + 32)
    axpy16(a3, x, src, base + 48)


@njit(inline="always")
def _scores(qa, qb, qc, qd, ktk, lp, lo, hi, scale, s0, s1, s2, s3):
    """s_r[t] = scale * q_r . k_t for t in [lo, hi) rounded up to whole KEYS tiles."""
    hd = qa.shape[0]
    a00, a01, a02, a03 = stack16(), stack16(), stack16(), stack16()
    a10, a11, a12, a13 = stack16(), stack16(), stack16(), stack16()
    a20, a21, a22, a23 = stack16(), stack16(), stack16(), stack16()
    a30, a31, a32, a33 = stack16(), stack16(), stack16(), stack16()
    for t in range(lo, hi, KEYS):
        for a in (a00, a01, a02, a03, a10, a11, a12, a13):
            zero16(a)
        for a in (a20, a21, a22, a23, a30, a31, a32, a33):
            zero16(a)
        for d in range(hd):
            base = d * lp + t
            x0, x1, x2, x3 = qa[d], qb[d], qc[d], qd[d]
            _axpy64(a00, a01, a02, a03, x0, ktk, base)
            _axpy64(a10, a11, a12, a13, x1, ktk, base)
            _axpy64(a20, a21, a22, a23, x2, ktk, base)
            _axpy64(a30, a31, a32, a33, x3, ktk, base)
        for j, (a, b) in enumerate(((a00, a10), (a01, a11), (a02, a12), (a03, a13))):
            store16(s0, t + 16 * j, a, scale)
            store16(s1, t + 16 * j, b, scale)
        for j, (a, b) in enumerate(((a20, a30), (a21, a31), (a22, a32), (a23, a33))):
            store16(s2, t + 16 * j, a, scale)
            store16(s3, t + 16 * j, b, scale)


@njit(inline="always")
def _softmax_weights(s, lo, hi, rlo, rhi):
    """s[rlo:rhi] = e^(s - max) (unnormalised), 0 on the rest of [lo, hi); returns
    1 / sum."""
    acc = stack16()
    accv = numba.carray(acc, 16)
    m = np.float32(-np.inf)
    t = rlo
    if rhi - rlo >= 16:
        for j in range(16):
            accv[j] = s[rlo + j]
        t = rlo + 16
        while t + 16 <= rhi:
            max16(acc, s, t)
            t += 16
        for j in range(16):
            m = max(m, accv[j])
    for u in range(t, rhi):
        m = max(m, s[u])
    zero16(acc)
    t = rlo
    while t + 16 <= rhi:
        exp_shift16(acc, s, t, m)
        t += 16
    total = vsum16(acc)
    for u in range(t, rhi):
        e = np.exp(s[u] - m)
        s[u] = e
        total += e
    for u in range(lo, rlo):
        s[u] = np.float32(0.0)
    for u in range(rhi, hi):
        s[u] = np.float32(0.0)
    return np.float32(1.0) / total


@njit(inline="always")
def _weighted_values(vk, hd, buf, lo, hi, s0, s1, s2, s3, c, o0, o1, o2, o3, i0, i1, i2, i3):
    """o_r[c:c+64] = i_r * sum_t s_r[t] v_t[c:c+64] over t in [lo, hi); vk: one KV head's
    value rows, flat (buf: scratch for 64 values of them)."""
    b00, b01, b02, b03 = stack16(), stack16(), stack16(), stack16()
    b10, b11, b12, b13 = stack16(), stack16(), stack16(), stack16()
    b20, b21, b22, b23 = stack16(), stack16(), stack16(), stack16()
    b30, b31, b32, b33 = stack16(), stack16(), stack16(), stack16()
    for a in (b00, b01, b02, b03, b10, b11, b12, b13):
        zero16(a)
    for a in (b20, b21, b22, b23, b30, b31, b32, b33):
        zero16(a)
    for t in range(lo, hi):
        va, vb = values(vk, t * hd + c, COLS, buf)
        p0, p1, p2, p3 = s0[t], s1[t], s2[t], s3[t]
        _axpy64(b00, b01, b02, b03, p0, va, vb)
        _axpy64(b10, b11, b12, b13, p1, va, vb)
        _axpy64(b20, b21, b22, b23, p2, va, vb)
        _axpy64(b30, b31, b32, b33, p3, va, vb)
    _store64(o0, c, b00, b01, b02, b03, i0)
    _store64(o1, c, b10, b11, b12, b13, i1)
    _store64(o2, c, b20, b21, b22, b23, i2)
    _store64(o3, c, b30, b31, b32, b33, i3)


@njit(cache=True, parallel=True, nogil=True)
def _attention_tiled(q, kt, v, start, window, scale, softcap, scores, out, spare):
    """out[i, h] for all queries: jobs are (KV head, tile of ROWS query rows); the rows of
    a KV head run token-major, head-in-group minor. scores: [jobs, ROWS, lp] scratch;
    spare: [jobs, hd] output rows for the padding rows of the last tile. softcap > 0:
    the scaled scores are capped (capped_score) before the softmax."""
    n, hq, hd = q.shape
    hkv, _, lp = kt.shape
    group = hq // hkv
    rows = n * group
    ntile = (rows + ROWS - 1) // ROWS
    for job in prange(hkv * ntile):
        kh = job // ntile
        r0 = (job - kh * ntile) * ROWS
        last = min(r0 + ROWS, rows) - 1
        hi = start + last // group + 1  # the keys of the tile's last (latest) row
        lo, _ = span(start + r0 // group, window)  # the keys of its first (earliest) row on
        ra, rb = min(r0, last), min(r0 + 1, last)
        rc, rd = min(r0 + 2, last), min(r0 + 3, last)
        ia, ib, ic, id_ = ra // group, rb // group, rc // group, rd // group
        ha, hb = kh * group + ra % group, kh * group + rb % group
        hc, hd_ = kh * group + rc % group, kh * group + rd % group
        s0, s1, s2, s3 = scores[job, 0], scores[job, 1], scores[job, 2], scores[job, 3]
        _scores(q[ia, ha], q[ib, hb], q[ic, hc], q[id_, hd_], kt[kh], lp, lo, hi, scale,
                s0, s1, s2, s3)  # fmt: skip
        if softcap > 0:
            for r in range(ROWS):
                for t in range(lo, hi):
                    scores[job, r, t] = capped_score(scores[job, r, t], softcap)
        inv = np.empty(ROWS, np.float32)
        for r in range(ROWS):
            pos = start + min(r0 + r, last) // group
            rlo, rhi = span(pos, window)
            inv[r] = _softmax_weights(scores[job, r], lo, hi, rlo, rhi)
        # padding rows (past the last) recompute the last row into a spare output
        o0 = out[ia, ha]
        o1 = out[ib, hb] if r0 + 1 <= last else spare[job]
        o2 = out[ic, hc] if r0 + 2 <= last else spare[job]
        o3 = out[id_, hd_] if r0 + 3 <= last else spare[job]
        vh = v[kh].reshape(-1)
        buf = scratch(vh, COLS)
        for c in range(0, hd, COLS):
            _weighted_values(vh, hd, buf, lo, hi, s0, s1, s2, s3, c, o0, o1, o2, o3,
                             inv[0], inv[1], inv[2], inv[3])  # fmt: skip


def attention_tiled(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    window: int,
    out: np.ndarray,
    softcap: float = 0.0,
) -> np.ndarray:
    """q [n, Hq, hd] (C-contiguous float32) against k, v [Hkv, >= start + n, row]
    (C-contiguous float32, f16 bits or q8_0 / q4_0 blocks); fills out [n, Hq, hd].
    `supports(n, hd)` must hold. softcap > 0: the scores' tanh cap (Gemma 2)."""
    n, hq, hd = q.shape
    hkv = k.shape[0]
    length = start + n
    lp = -(-(length + KEYS) // 16) * 16  # score tiles read up to KEYS - 1 past the end
    kt = np.empty((hkv, hd, lp), np.float32)
    _transpose_keys(k, np.int64(length), kt)
    ntile = -(-n * (hq // hkv) // ROWS)
    scores = np.empty((hkv * ntile, ROWS, lp), np.float32)
    spare = np.empty((hkv * ntile, hd), np.float32)
    _attention_tiled(
        q, kt, v, np.int64(start), np.int64(window), np.float32(1.0 / np.sqrt(hd)),
        np.float32(softcap), scores, out, spare,
    )  # fmt: skip
    return out
