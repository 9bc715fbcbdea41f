"""KV cache rows in ggml's 32-value block formats, q8_0 and q4_0 (llama.cpp's -ctk / -ctv).

A quantised cache holds, per (layer, KV head, position), head_dim / 32 blocks laid out
as ggml lays them out:

- q8_0 (34 bytes): f16 scale d, 32 int8 q;                       value = d * q
- q4_0 (18 bytes): f16 scale d, 16 bytes of nibbles (byte j holds value j in its low
  nibble, value j + 16 in its high one);                          value = d * (nibble - 8)
  (d: of a few candidates the one with the least squared error, not only ggml's max / -8;
  any reader of ggml's q4_0 reads it)

The array's element type tells the two apart, so Numba compiles each kernel for the
cache it reads: int8 for q8_0, uint8 for q4_0 (f32 caches are float32, f16 caches
uint16 bits). The attention kernels address every cache in values (row * head_dim +
column), as they address f32 and f16 ones; `values` hands them a span of values as
float32: the cache itself where it is f32 or f16 (their vector loads widen f16), the
span's blocks dequantised into a small buffer of the caller's otherwise. A quantised
cache is read in place, a few rows at a time, and never copied whole.

A quantised row holds its values rotated: R x = H (s * x), s a fixed +-1 per column and
H the normalised Walsh-Hadamard transform over each group of G columns (G the largest
power of two dividing head_dim), as QuaRot / SpinQuant rotate. R is orthogonal, so
(R q) . (R k) = q . k and sum_t p_t R v_t = R (sum_t p_t v_t): the attention kernels
rotate the query once per head (`rotated_queries`) and turn the output back
(`unrotate_output`) and score and sum on the stored blocks as they are. What the rotation
buys: a channel that carries an outlier in every row (Qwen2.5's keys, from their bias)
spreads over all G columns instead of setting one 32-value block's scale, so the other
values of that block keep their resolution. f32 and f16 caches are not rotated.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic, overload

from edgerun.ops._simd import h2f

BLOCK = 32  # values a block holds
BLOCK_BYTES = {np.dtype(np.int8): 34, np.dtype(np.uint8): 18}  # q8_0, q4_0
ROTATION = "hadamard-signs/1"  # what a saved session records of its blocks' rotation


def row_width(dtype: np.dtype, head_dim: int) -> int:
    """Elements of `dtype` one cache row (one position of one KV head) takes."""
    bb = BLOCK_BYTES.get(np.dtype(dtype))
    return head_dim if bb is None else head_dim // BLOCK * bb


@intrinsic
def f2h(typingctx, x):
    """float32 -> IEEE half bits (uint16), rounded to nearest even as numpy rounds."""
    if x != types.float32:
        return None

    def codegen(context, builder, sig, args):
        h = builder.fptrunc(args[0], ir.HalfType())
        return builder.bitcast(h, ir.IntType(16))

    return types.uint16(x), codegen


@njit(inline="always")
def _scale(src, o):
    """The f16 scale at bytes o, o + 1 of a block stream (int8 or uint8 elements)."""
    lo = np.int64(src[o]) & 0xFF
    hi = np.int64(src[o + 1]) & 0xFF
    return h2f(np.uint16(lo | (hi << 8)))


@njit(inline="always")
def _put_scale(dst, o, d):
    h = np.int64(f2h(d))
    dst[o] = h & 0xFF
    dst[o + 1] = (h >> 8) & 0xFF


@njit(inline="always")
def _roundf(v):
    """Round half away from zero, as ggml-quants.c's roundf (quant/scale_search.roundf)."""
    a = abs(v)
    f = np.floor(a)
    b = f + np.floor(np.float32(2.0) * (a - f))
    return -b if v < 0 else b


@njit(inline="always")
def _quantize_q8_0(x, xo, dst, o):
    """The 32 values x[xo:xo + 32] -> a q8_0 block at dst[o:o + 34]
    (ggml's quantize_row_q8_0_ref; quant/legacy.Q8_0)."""
    amax = np.float32(0.0)
    for j in range(BLOCK):
        amax = max(amax, abs(x[xo + j]))
    d = amax / np.float32(127.0)
    inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
    _put_scale(dst, o, d)
    for j in range(BLOCK):
        dst[o + 2 + j] = np.int64(_roundf(x[xo + j] * inv))


# The q4_0 block scales a block's values are tried with, as multiples of llama.cpp's
# (max / -8, the largest value on level -8) and of the other sign's (max / 7, on level
# +7): a smaller step clips the largest value and rounds the other 31 finer. The least
# squared error wins, then the least-squares scale of the winner's levels is tried.
# Gaussian blocks (rotated rows are near it): 0.90x the squared error of max / -8 alone
# (a dense search of 87 scales: 0.89x).
Q4_STEPS = (1.0, 0.94, 0.88, 0.82, 0.76, 0.7)


@njit(inline="always")
def _q4_level(v, inv):
    """A value's q4_0 nibble (0..15) at 1 / scale inv, as ggml rounds (+8.5, truncate)."""
    return min(15, max(0, np.int64(np.floor(v * inv + np.float32(8.5)))))


@njit(inline="always")
def _q4_error(x, xo, d):
    """(scale as f16 stores it, squared error of x[xo:xo + 32] on q4_0 levels of it)."""
    dh = h2f(f2h(d))
    inv = np.float32(1.0) / dh if dh != 0 else np.float32(0.0)
    e = np.float32(0.0)
    for j in range(BLOCK):
        r = x[xo + j] - dh * np.float32(_q4_level(x[xo + j], inv) - 8)
        e += r * r
    return dh, e


@njit(inline="always")
def _quantize_q4_0(x, xo, dst, o):
    """The 32 values x[xo:xo + 32] -> a q4_0 block at dst[o:o + 18] (ggml's layout, as
    quant/legacy.Q4_0 reads it), its scale the one of Q4_STEPS' candidates (and the
    least-squares refit) with the least squared error."""
    amax = np.float32(0.0)
    mx = np.float32(0.0)
    for j in range(BLOCK):
        a = abs(x[xo + j])
        if a > amax:
            amax = a
            mx = x[xo + j]
    best_d, best_e = np.float32(0.0), np.float32(np.inf)
    for f in Q4_STEPS:
        for base in (mx / np.float32(-8.0), mx / np.float32(7.0)):
            d, e = _q4_error(x, xo, base * np.float32(f))
            if e < best_e:
                best_d, best_e = d, e
    inv = np.float32(1.0) / best_d if best_d != 0 else np.float32(0.0)
    num = np.float32(0.0)
    den = np.float32(0.0)
    for j in range(BLOCK):
        q = np.float32(_q4_level(x[xo + j], inv) - 8)
        num += q * x[xo + j]
        den += q * q
    if den > 0:
        d, e = _q4_error(x, xo, num / den)
        if e < best_e:
            best_d = d
    inv = np.float32(1.0) / best_d if best_d != 0 else np.float32(0.0)
    _put_scale(dst, o, best_d)
    for j in range(BLOCK // 2):
        q0 = _q4_level(x[xo + j], inv)
        q1 = _q4_level(x[xo + j + 16], inv)
        dst[o + 2 + j] = q0 | (q1 << 4)


@njit(inline="always")
def _dequantize_q8_0(src, o, dst, do):
    d = _scale(src, o)
    for j in range(BLOCK):
        dst[do + j] = d * np.float32(src[o + 2 + j])


@njit(inline="always")
def _dequantize_q4_0(src, o, dst, do):
    d = _scale(src, o)
    for j in range(BLOCK // 2):
        b = np.int64(src[o + 2 + j])
        dst[do + j] = d * np.float32((b & 15) - 8)
        dst[do + j + 16] = d * np.float32((b >> 4) - 8)


@njit(inline="always")
def _sign(j):
    """Column j's fixed sign: a bit of a multiplicative hash of j (structured rows, such
    as one constant channel, do not line up with a Hadamard row)."""
    return np.float32(1.0 - 2.0 * (((np.int64(j) * 2654435761) >> 17) & 1))


@njit(nogil=True)
def _hadamard(x, o, n):
    """x[o:o + n] <- H x[o:o + n] for each group of G columns (normalised: H H = 1).
    A called function, not an inlined one: inlined into the overloads below, its loops
    made Numba warn about its variables' scope at every compile."""
    g = n & -n
    norm = np.float32(1.0 / np.sqrt(np.float64(g)))
    for base in range(o, o + n, g):
        for stage in range(31):
            h = 1 << stage
            if h >= g:
                break
            for i in range(base, base + g, 2 * h):
                for j in range(i, i + h):
                    a = x[j]
                    b = x[j + h]
                    x[j] = a + b
                    x[j + h] = a - b
        for j in range(base, base + g):
            x[j] *= norm


@njit(inline="always")
def rotate(x, o, n):
    """x[o:o + n] <- R x[o:o + n], the rotation a quantised row is stored in."""
    for j in range(n):
        x[o + j] *= _sign(j)
    _hadamard(x, o, n)


@njit(inline="always")
def unrotate(x, o, n):
    """x[o:o + n] <- R^T x[o:o + n] (R's inverse)."""
    _hadamard(x, o, n)
    for j in range(n):
        x[o + j] *= _sign(j)


def rotation(head_dim: int) -> np.ndarray:
    """R as a float64 matrix [head_dim, head_dim] (R x: the row as stored), for references."""
    g = head_dim & -head_dim
    h = np.ones((1, 1))
    while h.shape[0] < g:
        h = np.block([[h, h], [h, -h]])
    j = np.arange(head_dim, dtype=np.int64)
    signs = 1.0 - 2.0 * (((j * 2654435761) >> 17) & 1)
    return np.kron(np.eye(head_dim // g), h / np.sqrt(g)) * signs[None, :]


def rotated_queries(cache, q, hd):
    """q (flat float32, rows of hd) as scores against `cache`'s rows need it: q itself
    for f32 / f16 caches, a copy with each row rotated (R q) for quantised ones."""


@overload(rotated_queries, inline="always")
def _rotated_queries_impl(cache, q, hd):
    if cache.dtype in (types.int8, types.uint8):

        def impl(cache, q, hd):
            r = q.copy()
            for o in range(0, r.shape[0], hd):
                rotate(r, o, hd)
            return r

        return impl
    return lambda cache, q, hd: q


def unrotate_output(cache, out, hd):
    """out (flat float32, rows of hd) weighted from `cache`'s value rows <- R^T out where
    those rows are quantised (stored rotated); nothing for f32 / f16 caches."""


@overload(unrotate_output, inline="always")
def _unrotate_output_impl(cache, out, hd):
    if cache.dtype in (types.int8, types.uint8):

        def impl(cache, out, hd):
            for o in range(0, out.shape[0], hd):
                unrotate(out, o, hd)

        return impl
    return lambda cache, out, hd: None


@njit(cache=True, nogil=True)
def rotate_rows(x: np.ndarray) -> None:
    """x [m, n] float32 <- each row rotated (R x), in place."""
    for i in range(x.shape[0]):
        rotate(x[i], 0, x.shape[1])


@njit(cache=True, nogil=True)
def unrotate_rows(x: np.ndarray) -> None:
    """x [m, n] float32 <- each row turned back (R^T x), in place."""
    for i in range(x.shape[0]):
        unrotate(x[i], 0, x.shape[1])


def put_row(dst, src):
    """dst[:] = the float32 values src as a cache row of dst's element type stores them
    (f32 as is; q8_0 / q4_0 blocks of R src). f16 rows are token_step's (its rounding)."""


@overload(put_row, inline="always")
def _put_row_impl(dst, src):
    if dst.dtype == types.int8:

        def impl(dst, src):
            x = src.copy()
            rotate(x, 0, x.shape[0])
            for b in range(x.shape[0] // BLOCK):
                _quantize_q8_0(x, b * BLOCK, dst, b * 34)

        return impl
    if dst.dtype == types.uint8:

        def impl(dst, src):
            x = src.copy()
            rotate(x, 0, x.shape[0])
            for b in range(x.shape[0] // BLOCK):
                _quantize_q4_0(x, b * BLOCK, dst, b * 18)

        return impl
    if dst.dtype == types.float32:

        def impl(dst, src):
            for j in range(src.shape[0]):
                dst[j] = src[j]

        return impl
    return None


@njit(cache=True, nogil=True)
def quantize_rows(src: np.ndarray, dst: np.ndarray) -> None:
    """src [m, head_dim] float32 -> dst [m, row width] of q8_0 (int8) or q4_0 (uint8)
    blocks of each row rotated (R src)."""
    for i in range(src.shape[0]):
        put_row(dst[i], src[i])


def values(src, v0, n, buf):
    """Values v0 .. v0 + n of a cache's flat elements as float32 (or f16 bits) ->
    (array, index of value v0 in it): (src, v0) for f32 and f16, else the blocks holding
    them dequantised into buf[:n] and (buf, 0), still rotated (R x, as stored). v0 and
    n: multiples of 32 for blocks."""


@overload(values, inline="always")
def _values_impl(src, v0, n, buf):
    if src.dtype == types.int8:

        def impl(src, v0, n, buf):
            b0 = v0 // BLOCK
            for b in range(n // BLOCK):
                _dequantize_q8_0(src, (b0 + b) * 34, buf, b * BLOCK)
            return buf, np.int64(0)

        return impl
    if src.dtype == types.uint8:

        def impl(src, v0, n, buf):
            b0 = v0 // BLOCK
            for b in range(n // BLOCK):
                _dequantize_q4_0(src, (b0 + b) * 18, buf, b * BLOCK)
            return buf, np.int64(0)

        return impl

    def impl(src, v0, n, buf):
        return src, np.int64(v0)

    return impl


def scratch(src, n):
    """A float32 buffer for `values` of n values of src: empty unless src holds blocks."""


@overload(scratch, inline="always")
def _scratch_impl(src, n):
    if src.dtype in (types.int8, types.uint8):
        return lambda src, n: np.empty(n, np.float32)
    return lambda src, n: np.empty(0, np.float32)


@njit(cache=True, nogil=True)
def dequantize_rows(src: np.ndarray, dst: np.ndarray) -> None:
    """src [m, row width] of q8_0 (int8) or q4_0 (uint8) blocks -> dst [m, head_dim], the
    rows' values (R^T of the dequantised blocks)."""
    hd = dst.shape[1]
    for i in range(src.shape[0]):
        row, at = values(src[i], 0, hd, dst[i])
        for j in range(hd):
            dst[i, j] = row[at + j]
        unrotate(dst[i], 0, hd)
