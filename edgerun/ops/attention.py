"""Causal grouped-query attention of new queries against the KV cache."""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from edgerun.ops import attention_decode, attention_tiled
from edgerun.ops._simd import madd16, stack16, vsum16, widen, zero16
from edgerun.ops.attention_decode import (
    attend_many,
    attend_one,
    cache_at,
    capped_score,
    span,
    takes,
    weighted_rows,
)


def cache_values(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x (float32) as a KV cache of element type `dtype` stores it: f16 caches hold the
    bits of x rounded to nearest even (uint16, Numba has no float16 on the CPU)."""
    if dtype == np.uint16:
        return x.astype(np.float16).view(np.uint16)
    return x


def attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    window: int = 0,
    softcap: float = 0.0,
) -> np.ndarray:
    """q [n, Hq, hd]; k, v [Hkv, L, hd] with L >= start + n. Query i sits at start + i.
    k and v may be f16 bits (uint16), as an f16 cache stores them. softcap > 0: the
    scaled scores s -> softcap * tanh(s / softcap) before the softmax."""
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
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            p = np.exp(s - s.max())
            p /= p.sum()
            out[i, h] = p @ v[kh, lo : pos + 1].astype(np.float64)
    return out.reshape(n, hq * hd).astype(np.float32)


@njit(inline="always")
def _weighted_sum(o, p, v, lo, hi, inv):
    """o[:hd] = inv * sum_t p[t] * v[t, :hd] for t in lo..hi-1: whole 16-column vectors
    in registers (attention_decode.weighted_rows: o does not round-trip through memory
    once per position, and four FMA chains hide each other's latency), then the columns
    past them. Every column still sums over t in order."""
    hd = o.shape[0]
    n16 = hd // 16
    weighted_rows(o, 0, p, lo, v, lo * hd, hi - lo, hd, n16 * 16, inv)
    for d in range(n16 * 16, hd):
        x = np.float32(0.0)
        for t in range(lo, hi):
            x += p[t] * widen(v[t, d])
        o[d] = x * inv


@njit(inline="always")
def _dot16x4(a, k, t, a0, a1, a2, a3):
    """a . k[t + j] for j = 0..3, in four independent 16-lane vector sums (a0..a3:
    stack16 scratch), so the horizontal sums of four positions overlap instead of
    each waiting on the one before."""
    n = a.shape[0]
    n16 = n // 16
    zero16(a0)
    zero16(a1)
    zero16(a2)
    zero16(a3)
    base = t * n
    for c in range(n16):
        madd16(a0, a, c * 16, k, base + c * 16)
        madd16(a1, a, c * 16, k, base + n + c * 16)
        madd16(a2, a, c * 16, k, base + 2 * n + c * 16)
        madd16(a3, a, c * 16, k, base + 3 * n + c * 16)
    s0, s1, s2, s3 = vsum16(a0), vsum16(a1), vsum16(a2), vsum16(a3)
    for j in range(n16 * 16, n):
        x = a[j]
        s0 += x * widen(k[t, j])
        s1 += x * widen(k[t + 1, j])
        s2 += x * widen(k[t + 2, j])
        s3 += x * widen(k[t + 3, j])
    return s0, s1, s2, s3


@njit(inline="always")
def _dot1(a, k, t, a0):
    """a . k[t], as one lane of _dot16x4 computes it."""
    n = a.shape[0]
    n16 = n // 16
    zero16(a0)
    for c in range(n16):
        madd16(a0, a, c * 16, k, t * n + c * 16)
    s = vsum16(a0)
    for j in range(n16 * 16, n):
        s += a[j] * widen(k[t, j])
    return s


@njit(inline="always")
def _attend_row(qi, kh, vh, lo, hi, scale, softcap, sc, o):
    """o = softmax(qi . kh[lo:hi] * scale) @ vh[lo:hi], scores in sc (capped first when
    softcap > 0). The one body both kernels inline, so a batched decode row equals the
    single-sequence one bit for bit. qi, kh, vh, sc, o: C-contiguous (the vector loads
    index their flat elements)."""
    a0, a1, a2, a3 = stack16(), stack16(), stack16(), stack16()
    m = np.float32(-np.inf)
    t = lo
    while t + 4 <= hi:
        s0, s1, s2, s3 = _dot16x4(qi, kh, t, a0, a1, a2, a3)
        s0, s1, s2, s3 = s0 * scale, s1 * scale, s2 * scale, s3 * scale
        if softcap > 0:
            s0, s1 = capped_score(s0, softcap), capped_score(s1, softcap)
            s2, s3 = capped_score(s2, softcap), capped_score(s3, softcap)
        sc[t], sc[t + 1], sc[t + 2], sc[t + 3] = s0, s1, s2, s3
        m = max(m, max(max(s0, s1), max(s2, s3)))
        t += 4
    for u in range(t, hi):
        s = _dot1(qi, kh, u, a0) * scale
        if softcap > 0:
            s = capped_score(s, softcap)
        sc[u] = s
        if s > m:
            m = s
    total = np.float32(0.0)
    for t in range(lo, hi):
        e = np.exp(sc[t] - m)
        sc[t] = e
        total += e
    _weighted_sum(o, sc, vh, lo, hi, np.float32(1.0) / total)


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def _attention(q, k, v, start, window, scale, softcap, scores, out):
    n, hq, hd = q.shape
    hkv = k.shape[0]
    group = hq // hkv
    for job in prange(n * hq):
        i = job // hq
        h = job - i * hq
        kh = h // group
        pos = start + i
        lo, hi = span(pos, window)
        _attend_row(q[i, h], k[kh], v[kh], lo, hi, scale, softcap, scores[job], out[i, h])


@njit(cache=True, nogil=True)
def _attention_batch(
    q, k_new, v_new, kaddr, vaddr, nctx, layer, starts, window, scale, softcap, scores, out
):
    """Each sequence's cache is passed as the address of its [layers, kv_heads, n_ctx,
    head_dim] array (kaddr, vaddr; n_ctx per cache): one signature for any number of
    sequences, and no typed list (whose helpers Numba compiles anew in every process).
    Stores each sequence's new key and value, then attends: attention_decode's kernel
    where it takes the head size, the one-row kernel otherwise (as `attention` does for
    one token, so a batched row equals a single one)."""
    n, hq, hd = q.shape
    hkv = k_new.shape[1]
    item = k_new.itemsize
    for b in range(n):  # store first: each query attends to its own new key too
        off = layer * hkv * nctx[b] * hd * item
        kc = numba.carray(cache_at(kaddr[b] + off, k_new), (hkv, nctx[b], hd))
        vc = numba.carray(cache_at(vaddr[b] + off, k_new), (hkv, nctx[b], hd))
        pos = starts[b]
        for h in range(hkv):
            for d in range(hd):
                kc[h, pos, d] = k_new[b, h, d]
                vc[h, pos, d] = v_new[b, h, d]
    if takes(hd):
        attend_many(q, k_new, kaddr, vaddr, nctx, layer, starts, window, scale, out, softcap)
    else:
        _attention_rows_batch(q, k_new, kaddr, vaddr, nctx, layer, starts, window, scale,
                              softcap, scores, out)  # fmt: skip


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def _attention_rows_batch(
    q, like, kaddr, vaddr, nctx, layer, starts, window, scale, softcap, scores, out
):
    """_attention_batch's attention on the one-row kernel (head sizes attention_decode
    does not take)."""
    n, hq, hd = q.shape
    hkv = like.shape[1]
    item = like.itemsize
    group = hq // hkv
    for job in prange(n * hq):
        b = job // hq
        h = job - b * hq
        kh = h // group
        pos = starts[b]
        lo, hi = span(pos, window)
        off = layer * hkv * nctx[b] * hd * item
        kc = numba.carray(cache_at(kaddr[b] + off, like), (hkv, nctx[b], hd))
        vc = numba.carray(cache_at(vaddr[b] + off, like), (hkv, nctx[b], hd))
        _attend_row(q[b, h], kc[kh], vc[kh], lo, hi, scale, softcap, scores[job], out[b, h])


def attention(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    window: int = 0,
    out: np.ndarray | None = None,
    softcap: float = 0.0,
) -> np.ndarray:
    """Softmax(q k^T / sqrt(hd)) v, causal, optional sliding window; returns [n, Hq*hd].
    softcap > 0: the scaled scores s are capped to softcap * tanh(s / softcap) before the
    softmax (Gemma 2)."""
    n, hq, hd = q.shape
    length = start + n
    if out is None:
        out = np.empty((n, hq, hd), dtype=np.float32)
    elif not out.flags.c_contiguous:
        raise ValueError("attention: out must be C-contiguous")
    # the kernel's vector loads index flat elements: C-contiguous views (a cache layer,
    # a projection's rows already are; anything else is copied)
    q, k, v = (
        np.ascontiguousarray(q, dtype=np.float32),
        np.ascontiguousarray(k),
        np.ascontiguousarray(v),
    )
    if attention_tiled.supports(n, hd):  # prefill: query rows in register tiles
        attention_tiled.attention_tiled(q, k, v, start, window, out.reshape(n, hq, hd), softcap)
        return out.reshape(n, hq * hd)
    s32, cap = np.float32(1.0 / np.sqrt(hd)), np.float32(softcap)
    if n == 1 and attention_decode.supports(hd):  # decode: the split-position kernel
        attend_one(q[0], k, v, np.int64(start), np.int64(window), s32, out.reshape(hq, hd), cap)
        return out.reshape(n, hq * hd)
    scores = np.empty((n * hq, length), dtype=np.float32)
    _attention(q, k, v, np.int64(start), np.int64(window), s32, cap, scores, out.reshape(n, hq, hd))
    return out.reshape(n, hq * hd)


class BatchAttention:
    """Decode-step attention of n sequences, each against its own KV cache, in one
    parallel kernel call per layer (not n calls of a few heads each, which left most of
    the threads idle and paid the call overhead n times).

    ks, vs: each cache's [layers, kv_heads, n_ctx, head_dim] arrays, one dtype for all
    (f32, or f16 bits as uint16); starts: the position each new token takes. Built once
    per step, called once per layer.
    """

    def __init__(self, ks: list[np.ndarray], vs: list[np.ndarray], starts: list[int]) -> None:
        if len({a.shape[1:2] + a.shape[3:] for a in ks + vs}) != 1:
            raise ValueError("BatchAttention: the caches differ in head layout")
        self.starts = np.asarray(starts, dtype=np.int64)
        self._each = (ks, vs)
        self.dtype = ks[0].dtype
        # One sequence: the single kernel. Mixed f32 / f16 caches, or an array that is
        # not one C-contiguous block: one call per sequence.
        self.batched = len(ks) > 1 and self.one_kernel(ks, vs)
        if not self.batched:
            return
        # the arrays stay referenced by self._each while the kernel writes through these
        self._kaddr = np.array([a.ctypes.data for a in ks], dtype=np.int64)
        self._vaddr = np.array([a.ctypes.data for a in vs], dtype=np.int64)
        self._nctx = np.array([a.shape[2] for a in ks], dtype=np.int64)
        self._layers = min(a.shape[0] for a in ks)
        if ((self.starts < 0) | (self.starts >= self._nctx)).any():
            raise ValueError(f"BatchAttention: positions {starts} outside the caches")

    @staticmethod
    def one_kernel(ks: list[np.ndarray], vs: list[np.ndarray]) -> bool:
        """Whether these caches can share the batched kernel: one element type, each K
        and V the same shape, every array one writeable C-contiguous block."""
        dtype = ks[0].dtype
        return not (
            any(a.dtype != dtype for a in ks + vs)
            or not all(a.flags.c_contiguous and a.flags.writeable for a in ks + vs)
            or any(k.shape != v.shape for k, v in zip(ks, vs))
        )

    def __call__(
        self,
        layer: int,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        window: int,
        out: np.ndarray,
        softcap: float = 0.0,
    ) -> np.ndarray:
        """Store k, v [n, kv_heads, hd] at each sequence's position, then attend
        q [n, Hq, hd]; fills and returns out [n, Hq*hd]. softcap: as `attention`."""
        n, hq, hd = q.shape
        if not self.batched:
            return self._one_by_one(layer, q, k, v, window, out, softcap)
        if not 0 <= layer < self._layers:  # the kernel writes through raw addresses
            raise ValueError(f"BatchAttention: layer {layer} outside the caches")
        k, v = cache_values(k, self.dtype), cache_values(v, self.dtype)
        scores = np.empty((n * hq, int(self.starts.max()) + 1), dtype=np.float32)
        _attention_batch(
            np.ascontiguousarray(q, dtype=np.float32),
            np.ascontiguousarray(k, dtype=self.dtype),
            np.ascontiguousarray(v, dtype=self.dtype),
            self._kaddr,
            self._vaddr,
            self._nctx,
            np.int64(layer),
            self.starts,
            np.int64(window),
            np.float32(1.0 / np.sqrt(hd)),
            np.float32(softcap),
            scores,
            out.reshape(n, hq, hd),
        )
        return out.reshape(n, hq * hd)

    def _one_by_one(self, layer, q, k, v, window, out, softcap):
        out = out.reshape(q.shape[0], -1)
        for b, (kc, vc) in enumerate(zip(*self._each)):
            pos = int(self.starts[b])
            kc[layer, :, pos] = cache_values(k[b], kc.dtype)
            vc[layer, :, pos] = cache_values(v[b], vc.dtype)
            out[b] = attention(q[b : b + 1], kc[layer], vc[layer], pos, window, softcap=softcap)[0]
        return out
