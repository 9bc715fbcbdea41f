"""One decode token's small ops in a few kernels: the attention block and the residual.

A decode step of a small model runs ~10 small ops a layer around its matvecs (bias,
q/k norm, RoPE, the KV store, attention, residual adds, norms). Called one by one
from Python, their wrappers cost more than their arithmetic: SmolLM2-135M spent
~4.3 ms of a 14 ms token (2 threads) between kernels. Here they run in a few calls,
through the same compiled kernels the one-by-one path calls, so the results are equal
bit for bit (decode_step.py holds the sequence).

The attention block is two calls (`token_calls`): `prepare_token` (biases, norms, RoPE,
the KV store) and the decode attention kernel of the model's head size. One kernel for
both would compile the attention of every head size and the general fallback into
itself (26.5 s of CPU on a first run, the longest compile before the first token). Apart, each
compiles and caches on its own, in parallel processes (offload/warm_kernels.py), and
only the head size the model has; the second call costs about a microsecond a layer.
"""

from __future__ import annotations

import numpy as np
from numba import njit, types
from numba.extending import overload

from edgerun.ops.attention import _attention, _attention_batch
from edgerun.ops.attention_decode import attend_one_kernel, supports
from edgerun.ops.kv_blocks import put_row
from edgerun.ops.norm import _layernorm_serial, _rmsnorm_serial
from edgerun.ops.rope import _rope_inplace_serial

__all__ = [
    "prepare_token",
    "token_calls",
    "attend_rows",
    "add_normed",
    "add_layernormed",
    "add_rows",
    "half_bits",
]


@njit(cache=True, nogil=True)
def half_bits(f: np.ndarray, out: np.ndarray) -> None:
    """float32 f -> IEEE half bits (uint16), rounded to nearest even as numpy's
    `astype(np.float16)` rounds; overflow gives infinity, NaN a quiet NaN."""
    bits = f.view(np.uint32)
    for i in range(f.shape[0]):
        out[i] = _half(bits[i])


@njit(inline="always")
def _half(b):
    sign = np.uint32((b >> np.uint32(16)) & np.uint32(0x8000))
    e = np.int64((b >> np.uint32(23)) & np.uint32(0xFF))
    m = np.uint32(b & np.uint32(0x7FFFFF))
    if e == 255:
        return np.uint16(sign | (np.uint32(0x7E00) if m != 0 else np.uint32(0x7C00)))
    exp = e - 127
    if exp > 15:
        return np.uint16(sign | np.uint32(0x7C00))
    if exp >= -14:  # a normal half: keep 10 of the 23 fraction bits
        h = np.uint32((exp + 15) << 10) | (m >> np.uint32(13))
        rem = m & np.uint32(0x1FFF)
        if rem > np.uint32(0x1000) or (rem == np.uint32(0x1000) and (h & np.uint32(1))):
            h += np.uint32(1)  # a carry into the exponent is right (up to infinity)
        return np.uint16(sign | h)
    if exp < -25:
        return np.uint16(sign)
    full = m | np.uint32(0x800000)  # a subnormal half: units of 2^-24
    s = np.uint32(-(exp + 1))
    h = full >> s
    rem = full & ((np.uint32(1) << s) - np.uint32(1))
    halfway = np.uint32(1) << (s - np.uint32(1))
    if rem > halfway or (rem == halfway and (h & np.uint32(1))):
        h += np.uint32(1)
    return np.uint16(sign | h)


def _put(dst, src):
    """dst[:] = src as the cache stores it (f32, f16 bits in uint16, q8_0 / q4_0 blocks)."""


@overload(_put)
def _put_impl(dst, src):
    if dst.dtype in (types.int8, types.uint8):
        return lambda dst, src: put_row(dst, src)
    if dst.dtype == types.uint16:

        def impl(dst, src):
            bits = src.view(np.uint32)
            for j in range(src.shape[0]):
                dst[j] = _half(bits[j])

        return impl

    def impl(dst, src):
        for j in range(src.shape[0]):
            dst[j] = src[j]

    return impl


@njit(inline="always")
def _centre(k, centre):
    """k [rows, head_dim] -= centre [kv_heads, head_dim] (row r: head r % kv_heads),
    where centre is not empty."""
    hkv = centre.shape[0]
    if hkv:
        for r in range(k.shape[0]):
            for j in range(k.shape[1]):
                k[r, j] -= centre[r % hkv, j]


@njit(inline="always")
def _scale_keys(q, k, k_scale):
    """k [rows, head_dim] /= k_scale [kv_heads, head_dim] (row r: head r % kv_heads) and
    q [rows', heads, head_dim] *= it (head h: KV head h // (heads / kv_heads)), where
    k_scale is not empty (model/kvcache.key_scale: powers of two, so q . k is unchanged)."""
    hkv = k_scale.shape[0]
    if hkv:
        for r in range(k.shape[0]):
            for j in range(k.shape[1]):
                k[r, j] /= k_scale[r % hkv, j]
        group = q.shape[1] // hkv
        for i in range(q.shape[0]):
            for h in range(q.shape[1]):
                for j in range(q.shape[2]):
                    q[i, h, j] *= k_scale[h // group, j]


@njit(cache=True, nogil=True)
def prepare_token(
    q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, positions, cos, sin, neox,
    q_scale, q_temps, kc, vc, k_centre, k_scale,
):  # fmt: skip
    """One token's attention block after its q, k, v projections (1-D, written in place),
    up to the attention itself: biases (empty arrays: none), q/k RMSNorm in groups of the
    norm's width (a head, or the whole projection; empty: none), RoPE at positions[0], q
    times q_scale (1: none) then times q_temps[position] (the attention temperature per
    position; empty: none), k less k_centre [kv_heads, head_dim] (the cache's key centre,
    model/kvcache.key_centre; empty: none) then over k_scale (the cache's key scale,
    model/kvcache.key_scale, by which q is multiplied; empty: none) and v stored into the
    layer's cache kc, vc [kv_heads, n_ctx, row] (f32, f16 bits or q8_0 / q4_0 blocks)."""
    hkv = kc.shape[0]
    hd = k.shape[0] // hkv
    hq = q.shape[0] // hd
    if q_bias.shape[0]:
        for j in range(q.shape[0]):
            q[j] += q_bias[j]
        for j in range(k.shape[0]):
            k[j] += k_bias[j]
            v[j] += v_bias[j]
    k2 = k.reshape(hkv, hd)
    v2 = v.reshape(hkv, hd)
    if q_norm.shape[0]:
        qg = q.reshape(-1, q_norm.shape[0])
        kg = k.reshape(-1, k_norm.shape[0])
        _rmsnorm_serial(qg, q_norm, eps, qg)
        _rmsnorm_serial(kg, k_norm, eps, kg)
    q3 = q.reshape(1, hq, hd)
    _rope_inplace_serial(q3, positions, cos, sin, neox)
    _rope_inplace_serial(k.reshape(1, hkv, hd), positions, cos, sin, neox)
    if q_scale != 1.0:
        for j in range(q.shape[0]):
            q[j] *= q_scale
    pos = positions[0]
    if q_temps.shape[0]:
        t = q_temps[pos]
        for j in range(q.shape[0]):
            q[j] *= t
    _centre(k2, k_centre)
    _scale_keys(q3, k2, k_scale)
    for h in range(hkv):
        _put(kc[h, pos], k2[h])
        _put(vc[h, pos], v2[h])


@njit(cache=True, nogil=True)
def attend_rows_at(q, kc, vc, positions, window, scale, softcap, scores, ctx):
    """The one-row decode attention (ops/attention._attention) of q [1, hq, hd] at
    positions[0] -> ctx [1, hq, hd]: head sizes the split-position kernel does not take."""
    _attention(q, kc, vc, positions[0], window, scale, softcap, scores, ctx)


NO_CENTRE = np.zeros((0, 0), np.float32)  # a cache's keys stored as they are


def token_calls(
    head: tuple, kc: np.ndarray, vc: np.ndarray, window: np.int64, scale: np.float32,
    softcap: np.float32, scores: np.ndarray, ctx: np.ndarray, k_centre: np.ndarray = NO_CENTRE,
    k_scale: np.ndarray = NO_CENTRE,
) -> list[tuple]:  # fmt: skip
    """The bound decode step's calls (kernel, args) for one token's attention block:
    head = (q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, positions, cos, sin,
    neox, q_scale, q_temps) as prepare_token takes them, then attention of q into ctx
    [q_dim] against the layer's caches kc, vc (scores capped by softcap when > 0;
    scores: [heads, >= position + 1], for head sizes the split kernel does not take).
    k_centre, k_scale: the layer's key centre and key scale [kv_heads, head_dim]
    (NO_CENTRE: none)."""
    q, k, positions = head[0], head[1], head[9]
    hd = k.shape[0] // kc.shape[0]
    hq = q.shape[0] // hd
    calls = [(prepare_token, (*head, kc, vc, k_centre, k_scale))]
    if supports(hd):
        attend = attend_one_kernel(hd)
        args = (q.reshape(hq, hd), kc, vc, positions, window, scale, ctx.reshape(hq, hd), softcap)
        calls.append((attend, args))
    else:
        q3, ctx3 = q.reshape(1, hq, hd), ctx.reshape(1, hq, hd)
        calls.append((attend_rows_at, (q3, kc, vc, positions, window, scale, softcap, scores,
                                       ctx3)))  # fmt: skip
    return calls


def _as_cache(src, dst):
    """src [n, kv_dim] as the cache's element type, shaped as dst [n, kv_heads, row]:
    src itself (f32), or its f16 bits (uint16) or q8_0 / q4_0 blocks written into dst."""


@overload(_as_cache)
def _as_cache_impl(src, dst):
    if dst.dtype in (types.int8, types.uint8):

        def blocks(src, dst):
            n, hkv = dst.shape[0], dst.shape[1]
            rows = src.reshape(n * hkv, src.shape[1] // hkv)
            out = dst.reshape(n * hkv, dst.shape[2])
            for r in range(n * hkv):
                put_row(out[r], rows[r])
            return dst

        return blocks
    if dst.dtype == types.uint16:

        def impl(src, dst):
            flat = dst.reshape(-1)
            half_bits(src.reshape(-1), flat)
            return dst

        return impl

    def impl(src, dst):
        return src.reshape(dst.shape)

    return impl


@njit(cache=True, nogil=True)
def attend_rows(
    q, k, v, q_bias, k_bias, v_bias, q_norm, k_norm, eps, positions, cos, sin, neox,
    q_scale, q_temps, k_new, v_new, kaddr, vaddr, nctx, layer, window, scale, softcap, scores,
    ctx, k_centre, k_scale,
):  # fmt: skip
    """token_calls' work for n >= 2 sequences' decode rows q [n, q_dim], k, v [n, kv_dim], each
    against its own cache (kaddr, vaddr, nctx: ops/attention.BatchAttention's addresses):
    the general path's batched steps (parallel RoPE, _attention_batch). k_new, v_new:
    [n, kv_heads, row] of the caches' key and value types (f16 bits and q8_0 / q4_0 blocks
    are written there); k_centre: the caches' key centre of the layer [kv_heads, head_dim]
    (one for all of them; empty: none), taken from the keys before they are stored, and
    their key scale (the same; empty: none), dividing the keys and multiplying q."""
    n = q.shape[0]
    hkv = k_new.shape[1]
    hd = k.shape[1] // hkv
    hq = q.shape[1] // hd
    if q_bias.shape[0]:
        for i in range(n):
            for j in range(q.shape[1]):
                q[i, j] += q_bias[j]
            for j in range(k.shape[1]):
                k[i, j] += k_bias[j]
                v[i, j] += v_bias[j]
    if q_norm.shape[0]:
        q2 = q.reshape(-1, q_norm.shape[0])
        k2 = k.reshape(-1, k_norm.shape[0])
        _rmsnorm_serial(q2, q_norm, eps, q2)
        _rmsnorm_serial(k2, k_norm, eps, k2)
    q3 = q.reshape(n, hq, hd)
    _rope_inplace_serial(q3, positions, cos, sin, neox)
    _rope_inplace_serial(k.reshape(n, hkv, hd), positions, cos, sin, neox)
    if q_scale != 1.0:
        for i in range(n):
            for j in range(q.shape[1]):
                q[i, j] *= q_scale
    if q_temps.shape[0]:
        for i in range(n):
            t = q_temps[positions[i]]
            for j in range(q.shape[1]):
                q[i, j] *= t
    _centre(k.reshape(n * hkv, hd), k_centre)
    _scale_keys(q3, k.reshape(n * hkv, hd), k_scale)
    kn = _as_cache(k, k_new)
    vn = _as_cache(v, v_new)
    _attention_batch(
        q3, kn, vn, kaddr, vaddr, nctx, layer, positions, window, scale, softcap, scores,
        ctx.reshape(n, hq, hd),
    )  # fmt: skip


@njit(cache=True, nogil=True)
def add_normed(h, a, post_norm, eps, scale, norm, x):
    """h += a * scale (a first RMSNorm-ed by post_norm unless it is empty), then
    x = RMSNorm(h) by norm (empty: x = h): the residual add that ends a block and the
    norm that starts the next one. h, a, x: [n, d_model]."""
    if post_norm.shape[0]:
        _rmsnorm_serial(a, post_norm, eps, a)
    if scale != 1.0:
        for i in range(h.shape[0]):
            for j in range(h.shape[1]):
                a[i, j] *= scale
    for i in range(h.shape[0]):
        for j in range(h.shape[1]):
            h[i, j] += a[i, j]
    if norm.shape[0]:
        _rmsnorm_serial(h, norm, eps, x)
    else:  # a loop: `x[:] = h` compiles Numba's shape-mismatch message (3.8 s of CPU)
        for i in range(h.shape[0]):
            for j in range(h.shape[1]):
                x[i, j] = h[i, j]


@njit(cache=True, nogil=True)
def add_layernormed(h, a, eps, norm, x):
    """h += a, then x = LayerNorm(h) by norm (Cohere's mean-centred norm, no bias): the
    residual add that ends a layer and the norm that starts the next. [n, d_model]."""
    for i in range(h.shape[0]):
        for j in range(h.shape[1]):
            h[i, j] += a[i, j]
    _layernorm_serial(h, norm, eps, x)


@njit(cache=True, nogil=True)
def add_rows(h, a):
    """h += a: a parallel block's attention output joins the residual stream while the
    FFN reads the same normed input. [n, d_model]."""
    for i in range(h.shape[0]):
        for j in range(h.shape[1]):
            h[i, j] += a[i, j]
