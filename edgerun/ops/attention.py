"""Causal grouped-query attention of new queries against the KV cache."""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange, types
from numba.extending import overload

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
from edgerun.ops.kv_blocks import (
    BLOCK_BYTES,
    dequantize_rows,
    quantize_rows,
    rotate_rows,
    rotated_queries,
    row_width,
    scratch,
    unrotate_output,
    unrotate_rows,
    values,
)


def cache_values(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x [..., head_dim] (float32) as a KV cache of element type `dtype` stores it: f16
    caches hold the bits of x rounded to nearest even (uint16, Numba has no float16 on
    the CPU); q8_0 (int8) and q4_0 (uint8) caches rows of blocks [..., row width]."""
    if dtype == np.uint16:
        return x.astype(np.float16).view(np.uint16)
    if np.dtype(dtype) in BLOCK_BYTES:
        hd = x.shape[-1]
        rows = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, hd)
        out = np.empty((rows.shape[0], row_width(dtype, hd)), dtype)
        quantize_rows(rows, out)
        return out.reshape(x.shape[:-1] + out.shape[-1:])
    return x


def cache_floats(rows: np.ndarray, head_dim: int) -> np.ndarray:
    """A cache's rows [..., row width] as float32 [..., head_dim] (a reference's and a
    session conversion's view; the kernels never make it)."""
    if rows.dtype == np.uint16:
        return rows.view(np.float16).astype(np.float32)
    if rows.dtype in BLOCK_BYTES:
        flat = np.ascontiguousarray(rows).reshape(-1, rows.shape[-1])
        out = np.empty((flat.shape[0], head_dim), np.float32)
        dequantize_rows(flat, out)
        return out.reshape(rows.shape[:-1] + (head_dim,))
    return rows.astype(np.float32, copy=False)


def attention_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    start: int,
    window: int = 0,
    softcap: float = 0.0,
) -> np.ndarray:
    """q [n, Hq, hd]; k, v [Hkv, L, row] with L >= start + n. Query i sits at start + i.
    k and v may be f16 bits (uint16) or q8_0 / q4_0 rows, as such caches store them.
    softcap > 0: the scaled scores s -> softcap * tanh(s / softcap) before the softmax."""
    n, hq, hd = q.shape
    k, v = cache_floats(k, hd), cache_floats(v, hd)
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


def _weighted_sum(o, p, v, lo, hi, inv):
    """o[:hd] = inv * sum_t p[t] * (value row t of v) for t in lo..hi-1; v: one KV
    head's rows, flat (row t at value t * hd)."""


@overload(_weighted_sum, inline="always")
def _weighted_sum_impl(o, p, v, lo, hi, inv):
    if v.dtype in (types.int8, types.uint8):

        def blocks(o, p, v, lo, hi, inv):
            # q8_0 / q4_0 rows, dequantised 16 at a time; every column sums over t in order
            hd = o.shape[0]
            buf = np.empty(16 * hd, np.float32)
            for d in range(hd):
                o[d] = np.float32(0.0)
            for t0 in range(lo, hi, 16):
                nt = min(16, hi - t0)
                va, vo = values(v, t0 * hd, nt * hd, buf)
                for t in range(nt):
                    w = p[t0 + t]
                    for d in range(hd):
                        o[d] += w * va[vo + t * hd + d]
            for d in range(hd):
                o[d] *= inv

        return blocks

    def rows(o, p, v, lo, hi, inv):
        # whole 16-column vectors in registers (attention_decode.weighted_rows: o does
        # not round-trip through memory once per position, and four FMA chains hide each
        # other's latency), then the columns past them. Every column sums over t in order.
        hd = o.shape[0]
        n16 = hd // 16
        weighted_rows(o, 0, p, lo, v, lo * hd, hi - lo, hd, n16 * 16, inv)
        for d in range(n16 * 16, hd):
            x = np.float32(0.0)
            for t in range(lo, hi):
                x += p[t] * widen(v[t * hd + d])
            o[d] = x * inv

    return rows


@njit(inline="always")
def _dot16x4(a, k, base, a0, a1, a2, a3):
    """a . (the 4 rows of k from flat element base), in four independent 16-lane vector
    sums (a0..a3: stack16 scratch), so the horizontal sums of four positions overlap
    instead of each waiting on the one before."""
    n = a.shape[0]
    n16 = n // 16
    zero16(a0)
    zero16(a1)
    zero16(a2)
    zero16(a3)
    for c in range(n16):
        madd16(a0, a, c * 16, k, base + c * 16)
        madd16(a1, a, c * 16, k, base + n + c * 16)
        madd16(a2, a, c * 16, k, base + 2 * n + c * 16)
        madd16(a3, a, c * 16, k, base + 3 * n + c * 16)
    s0, s1, s2, s3 = vsum16(a0), vsum16(a1), vsum16(a2), vsum16(a3)
    for j in range(n16 * 16, n):
        x = a[j]
        s0 += x * widen(k[base + j])
        s1 += x * widen(k[base + n + j])
        s2 += x * widen(k[base + 2 * n + j])
        s3 += x * widen(k[base + 3 * n + j])
    return s0, s1, s2, s3


@njit(inline="always")
def _dot1(a, k, base, a0):
    """a . (the row of k from flat element base), as one lane of _dot16x4 computes it."""
    n = a.shape[0]
    n16 = n // 16
    zero16(a0)
    for c in range(n16):
        madd16(a0, a, c * 16, k, base + c * 16)
    s = vsum16(a0)
    for j in range(n16 * 16, n):
        s += a[j] * widen(k[base + j])
    return s


@njit(inline="always")
def _attend_row(qi, kh, vh, lo, hi, scale, softcap, sc, o):
    """o = softmax(qi . kh[lo:hi] * scale) @ vh[lo:hi], scores in sc (capped first when
    softcap > 0). The one body both kernels inline, so a batched decode row equals the
    single-sequence one bit for bit. kh, vh: one KV head's cache rows, flat (row t at
    value t * hd; f32, f16 bits, or q8_0 / q4_0 blocks dequantised a few rows at a time);
    qi, sc, o: C-contiguous. Quantised blocks hold rotated rows: qi is rotated to score
    them and o turned back from their weighted sum (kv_blocks)."""
    hd = qi.shape[0]
    qi = rotated_queries(kh, qi, hd)
    kbuf = scratch(kh, 4 * hd)
    a0, a1, a2, a3 = stack16(), stack16(), stack16(), stack16()
    m = np.float32(-np.inf)
    t = lo
    while t + 4 <= hi:
        ka, ko = values(kh, t * hd, 4 * hd, kbuf)
        s0, s1, s2, s3 = _dot16x4(qi, ka, ko, a0, a1, a2, a3)
        s0, s1, s2, s3 = s0 * scale, s1 * scale, s2 * scale, s3 * scale
        if softcap > 0:
            s0, s1 = capped_score(s0, softcap), capped_score(s1, softcap)
            s2, s3 = capped_score(s2, softcap), capped_score(s3, softcap)
        sc[t], sc[t + 1], sc[t + 2], sc[t + 3] = s0, s1, s2, s3
        m = max(m, max(max(s0, s1), max(s2, s3)))
        t += 4
    for u in range(t, hi):
        ka, ko = values(kh, u * hd, hd, kbuf)
        s = _dot1(qi, ka, ko, a0) * scale
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
    unrotate_output(vh, o, hd)


# The one-row kernels run without fastmath: a reassociated sum (the softmax's total, a
# vectorised tail) rounds as the surrounding compiled code lets LLVM reorder it, and
# token_step.attend_rows_at compiles _attention into itself, so the bound decode step's
# rows would stop equalling the general path's bit for bit.
@njit(cache=True, parallel=True, nogil=True)
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
        _attend_row(q[i, h], k[kh].reshape(-1), v[kh].reshape(-1), lo, hi, scale, softcap,
                    scores[job], out[i, h])  # fmt: skip


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
    kw, vw = k_new.shape[2], v_new.shape[2]  # a cache row's elements (hd, or block bytes)
    for b in range(n):  # store first: each query attends to its own new key too
        koff = layer * hkv * nctx[b] * kw * k_new.itemsize
        voff = layer * hkv * nctx[b] * vw * v_new.itemsize
        kc = numba.carray(cache_at(kaddr[b] + koff, k_new), (hkv, nctx[b], kw))
        vc = numba.carray(cache_at(vaddr[b] + voff, v_new), (hkv, nctx[b], vw))
        pos = starts[b]
        for h in range(hkv):
            for d in range(kw):
                kc[h, pos, d] = k_new[b, h, d]
            for d in range(vw):
                vc[h, pos, d] = v_new[b, h, d]
    if takes(hd):
        attend_many(q, k_new, v_new, kaddr, vaddr, nctx, layer, starts, window, scale, out,
                    softcap)  # fmt: skip
    else:
        _attention_rows_batch(q, k_new, v_new, kaddr, vaddr, nctx, layer, starts, window,
                              scale, softcap, scores, out)  # fmt: skip


@njit(cache=True, parallel=True, nogil=True)
def _attention_rows_batch(
    q, klike, vlike, kaddr, vaddr, nctx, layer, starts, window, scale, softcap, scores, out
):
    """_attention_batch's attention on the one-row kernel (head sizes attention_decode
    does not take)."""
    n, hq, hd = q.shape
    hkv = klike.shape[1]
    kw, vw = klike.shape[2], vlike.shape[2]
    group = hq // hkv
    for job in prange(n * hq):
        b = job // hq
        h = job - b * hq
        kh = h // group
        pos = starts[b]
        lo, hi = span(pos, window)
        head = layer * hkv + kh  # the head's rows, flat
        ks, vs = nctx[b] * kw, nctx[b] * vw
        kh_ = numba.carray(cache_at(kaddr[b] + head * ks * klike.itemsize, klike), ks)
        vh_ = numba.carray(cache_at(vaddr[b] + head * vs * vlike.itemsize, vlike), vs)
        _attend_row(q[b, h], kh_, vh_, lo, hi, scale, softcap, scores[job], out[b, h])


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
        if k.dtype in BLOCK_BYTES:  # rotated key blocks score R q (kv_blocks)
            q = q.copy()
            rotate_rows(q.reshape(-1, hd))
        attention_tiled.attention_tiled(q, k, v, start, window, out.reshape(n, hq, hd), softcap)
        if v.dtype in BLOCK_BYTES:  # the weighted rotated values: R out
            unrotate_rows(out.reshape(-1, hd))
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

    ks, vs: each cache's [layers, kv_heads, n_ctx, row] arrays (f32, f16 bits as uint16,
    or q8_0 / q4_0 blocks; the keys of every cache of one type, the values of one type);
    starts: the position each new token takes; centres: each cache's key centre
    [layers, kv_heads, head_dim] (model/kvcache.key_centre), subtracted from its new keys
    before they are stored (None: none, and the default for every cache); scales: each
    cache's key scale, the same shape (model/kvcache.key_scale), dividing its new keys and
    multiplying its queries (None: none). Built once per step, called once per layer.
    """

    def __init__(
        self,
        ks: list[np.ndarray],
        vs: list[np.ndarray],
        starts: list[int],
        centres: list[np.ndarray | None] | None = None,
        scales: list[np.ndarray | None] | None = None,
    ) -> None:
        # one head count, and one row width for each element type (of one head_dim)
        widths = {(a.dtype, a.shape[3]) for a in ks + vs}
        if len({a.shape[1] for a in ks + vs}) != 1 or len(widths) != len(dict(widths)):
            raise ValueError("BatchAttention: the caches differ in head layout")
        self.starts = np.asarray(starts, dtype=np.int64)
        self._each = (ks, vs)
        self.centres = [None] * len(ks) if centres is None else list(centres)
        self.scales = [None] * len(ks) if scales is None else list(scales)
        self.dtype, self.v_dtype = ks[0].dtype, vs[0].dtype
        # One sequence: the single kernel. Caches of mixed types or centres, or an array
        # that is not one C-contiguous block: one call per sequence.
        self.batched = len(ks) > 1 and self.one_kernel(ks, vs, self.centres, self.scales)
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
    def one_kernel(
        ks: list[np.ndarray],
        vs: list[np.ndarray],
        centres: list | None = None,
        scales: list | None = None,
    ) -> bool:
        """Whether these caches can share the batched kernel: one element type for the
        keys and one for the values, one key centre and one key scale (the same array, or
        None for all), each K and V the same positions, every array one writeable
        C-contiguous block."""
        for each in (centres, scales):
            if each is not None and any(c is not each[0] for c in each):
                return False
        return not (
            any(a.dtype != ks[0].dtype for a in ks)
            or any(a.dtype != vs[0].dtype for a in vs)
            or not all(a.flags.c_contiguous and a.flags.writeable for a in ks + vs)
            or any(k.shape[:3] != v.shape[:3] for k, v in zip(ks, vs))
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
        centre, scale = self.centres[0], self.scales[0]
        if centre is not None:
            k = k - centre[layer]
        if scale is not None:  # powers of two (model/kvcache.key_scale): q . k unchanged
            k = k / scale[layer]
            q = q * np.repeat(scale[layer], hq // scale.shape[1], axis=0)
        k, v = cache_values(k, self.dtype), cache_values(v, self.v_dtype)
        scores = np.empty((n * hq, int(self.starts.max()) + 1), dtype=np.float32)
        _attention_batch(
            np.ascontiguousarray(q, dtype=np.float32),
            np.ascontiguousarray(k, dtype=self.dtype),
            np.ascontiguousarray(v, dtype=self.v_dtype),
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
            centre, scale = self.centres[b], self.scales[b]
            kb = k[b] if centre is None else k[b] - centre[layer]
            qb = q[b : b + 1]
            if scale is not None:
                kb = kb / scale[layer]
                qb = qb * np.repeat(scale[layer], qb.shape[1] // scale.shape[1], axis=0)
            kc[layer, :, pos] = cache_values(kb, kc.dtype)
            vc[layer, :, pos] = cache_values(v[b], vc.dtype)
            out[b] = attention(qb, kc[layer], vc[layer], pos, window, softcap=softcap)[0]
        return out
