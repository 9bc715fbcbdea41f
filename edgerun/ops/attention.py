"""Causal grouped-query attention of new queries against the KV cache."""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from edgerun.ops._simd import h2f, stack16


def _widen(x):
    """A cache element as float32: f32 as is, f16 bits (uint16) converted."""
    return x


@overload(_widen, inline="always")
def _widen_impl(x):
    if isinstance(x, types.Float):
        return lambda x: x
    if isinstance(x, types.Integer):
        return lambda x: h2f(x)
    return None


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
def _dot(a, b, acc, n16, hd):
    """sum(a[:hd] * b[:hd]) in 16 independent lanes, which the SLP vectorizer packs
    into one vector FMA per 16 elements (Numba's loop vectorizer stays off)."""
    for l in range(16):
        acc[l] = np.float32(0.0)
    for c in range(n16):
        ab = a[c * 16 : c * 16 + 16]
        bb = b[c * 16 : c * 16 + 16]
        for l in range(16):
            acc[l] += ab[l] * _widen(bb[l])
    s = np.float32(0.0)
    for l in range(16):
        s += acc[l]
    for d in range(n16 * 16, hd):
        s += a[d] * _widen(b[d])
    return s


@njit(inline="always")
def _weighted_sum(o, p, v, lo, hi, inv, acc, n16, hd):
    """o[:hd] = inv * sum_t p[t] * v[t, :hd] for t in lo..hi-1. Column chunks outside,
    positions inside: the 16-lane sum stays in registers instead of o round-tripping
    through memory once per position."""
    for c in range(n16):
        for l in range(16):
            acc[l] = np.float32(0.0)
        for t in range(lo, hi):
            w = p[t]
            vb = v[t, c * 16 : c * 16 + 16]
            for l in range(16):
                acc[l] += w * _widen(vb[l])
        for l in range(16):
            o[c * 16 + l] = acc[l] * inv
    for d in range(n16 * 16, hd):
        x = np.float32(0.0)
        for t in range(lo, hi):
            x += p[t] * _widen(v[t, d])
        o[d] = x * inv


@njit(cache=True, parallel=True, fastmath=True)
def _attention(q, k, v, start, window, scale, scores, out):
    n, hq, hd = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    n16 = hd // 16
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
        acc = numba.carray(stack16(), 16)
        m = np.float32(-np.inf)
        for t in range(lo, pos + 1):
            s = _dot(qi, k[kh, t], acc, n16, hd) * scale
            sc[t] = s
            if s > m:
                m = s
        total = np.float32(0.0)
        for t in range(lo, pos + 1):
            e = np.exp(sc[t] - m)
            sc[t] = e
            total += e
        _weighted_sum(out[i, h], sc, v[kh], lo, pos + 1, np.float32(1.0) / total, acc, n16, hd)


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
