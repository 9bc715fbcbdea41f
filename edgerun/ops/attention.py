"""Causal grouped-query attention of new queries against the KV cache."""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from edgerun.ops._simd import dot16, stack16, widen


def attention_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int = 0
) -> np.ndarray:
    """q [n, Hq, hd]; k, v [Hkv, L, hd] with L >= start + n. Query i sits at start + i.
    k and v may be f16 bits (uint16), as an f16 cache stores them."""
    if k.dtype == np.uint16:
        k, v = k.view(np.float16), v.view(np.float16)
    n, hq, hd = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    out = np.zeros((n, hq, hd), dtype=np.float64)
    for i in range(n):
        pos = start + i
        lo = max(0, pos - window + 1) if window > 0 else 0
        for h in range(hq):
            kh = h // group
            s = k[kh, lo : pos + 1].astype(np.float64) @ q[i, h].astype(np.float64) / np.sqrt(hd)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = p @ v[kh, lo : pos + 1].astype(np.float64)
    return out.reshape(n, hq * hd).astype(np.float32)


@njit(inline="always")
def _weighted_sum(o, p, v, lo, hi, inv):
    """o[:hd] = inv * sum_t p[t] * v[t, :hd] for t in lo..hi-1. Column chunks outside,
    positions inside: the 16-lane sum stays in registers instead of o round-tripping
    through memory once per position."""
    hd = o.shape[0]
    n16 = hd // 16
    acc = numba.carray(stack16(), 16)
    for c in range(n16):
        for l in range(16):
            acc[l] = np.float32(0.0)
        for t in range(lo, hi):
            w = p[t]
            vb = v[t, c * 16 : c * 16 + 16]
            for l in range(16):
                acc[l] += w * widen(vb[l])
        for l in range(16):
            o[c * 16 + l] = acc[l] * inv
    for d in range(n16 * 16, hd):
        x = np.float32(0.0)
        for t in range(lo, hi):
            x += p[t] * widen(v[t, d])
        o[d] = x * inv


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def _attention(q, k, v, start, window, scale, scores, out):
    n, hq, hd = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    for job in prange(n * hq):
        i = job // hq
        h = job - i * hq
        kh = h // group
        pos = start + i
        lo = 0
        if window > 0:
            lo = max(0, pos - window + 1)
        sc = scores[job]
        qi = q[i, h]
        m = np.float32(-np.inf)
        for t in range(lo, pos + 1):
            s = dot16(qi, k[kh, t]) * scale
            sc[t] = s
            if s > m:
                m = s
        total = np.float32(0.0)
        for t in range(lo, pos + 1):
            e = np.exp(sc[t] - m)
            sc[t] = e
            total += e
        _weighted_sum(out[i, h], sc, v[kh], lo, pos + 1, np.float32(1.0) / total)


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    window: int = 0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """Softmax(q k^T / sqrt(hd)) v, causal, optional sliding window; returns [n, Hq*hd]."""
    n, hq, hd = q.shape
    length = start + n
    scores = np.empty((n * hq, length), dtype=np.float32)
    if out is None:
        out = np.empty((n, hq, hd), dtype=np.float32)
    _attention(
        q,
        k,
        v,
        np.int64(start),
        np.int64(window),
        np.float32(1.0 / np.sqrt(hd)),
        scores,
        out.reshape(n, hq, hd),
    )
    return out.reshape(n, hq * hd)
