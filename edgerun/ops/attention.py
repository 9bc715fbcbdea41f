"""Causal grouped-query attention of new queries against the KV cache."""

from __future__ import annotations

import numpy as np
from numba import njit, prange


def attention_reference(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, start: int, window: int = 0
) -> np.ndarray:
    """q [n, Hq, hd]; k, v [Hkv, L, hd] with L >= start + n. Query i sits at start + i."""
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


@njit(cache=True, parallel=True, fastmath=True)
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
        m = np.float32(-np.inf)
        for t in range(lo, pos + 1):
            kt = k[kh, t]
            s = np.float32(0.0)
            for d in range(hd):
                s += q[i, h, d] * kt[d]
            s *= scale
            sc[t] = s
            if s > m:
                m = s
        total = np.float32(0.0)
        for t in range(lo, pos + 1):
            e = np.exp(sc[t] - m)
            sc[t] = e
            total += e
        inv = np.float32(1.0) / total
        o = out[i, h]
        for d in range(hd):
            o[d] = 0.0
        for t in range(lo, pos + 1):
            w = sc[t] * inv
            vt = v[kh, t]
            for d in range(hd):
                o[d] += w * vt[d]


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
