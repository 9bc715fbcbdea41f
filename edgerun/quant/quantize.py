"""Quantizers: float32 matrices -> raw GGML blocks (vectorized numpy).

`quantize(x, qtype, imatrix=None)` returns uint8 [rows, row_bytes(qtype, cols)], the
same bytes a GGUF file would hold, so the kernels in ops/ and the reference
dequantizer (edgerun.quant.reference) read them unchanged.

- Q8_0, Q4_0, Q4_1, Q5_0, BF16, F16: bit-exact with gguf-py's `gguf.quants.quantize`
  (the same float32 operations, in the same order), which itself follows
  ggml-quants.c's reference quantizers.
- Q4_K, Q6_K: ggml-quants.c's reference algorithms (`make_qkx2_quants` for Q4_K's
  (scale, min) pairs per 32, `make_qx_quants` with its 19-step scale search for Q6_K's
  scales per 16; 6-bit / 8-bit second-level scales), vectorized over all sub-blocks.
  gguf-py has no K-quant quantizer to compare with; tests hold them to error bounds and
  to gguf-py's dequantizer.
- Q3_G64, Q2_G64: edgerun's own low-bit formats, see edgerun.quant.lowbit.

`imatrix` (float32 [cols], mean squared activation per input column, see
edgerun.tools.calibrate) turns the scale searches into importance-weighted ones, as
llama.cpp's imatrix quantization does: weights = imatrix[col] * sqrt(sigma2 + x^2).
It is used by the K-quants and the low-bit formats; the 32-block legacy formats and
float formats ignore it.
"""

from __future__ import annotations

import numpy as np

from edgerun.errors import InvalidArgumentError
from edgerun.quant import lowbit
from edgerun.quant.formats import BLOCK_LAYOUT, QuantTensor, QuantType

__all__ = ["quantize", "quantize_tensor", "make_qkx2_quants", "make_qx_quants", "QUANTIZABLE"]

_CHUNK_ELEMS = 1 << 21  # rows are quantized in chunks of about this many elements
_GROUP_MAX_EPS = np.float32(1e-15)


def _np_roundf(n: np.ndarray) -> np.ndarray:
    """Round half away from zero (gguf-py / ggml-quants.c roundf)."""
    a = abs(n)
    floored = np.floor(a)
    b = floored + np.floor(2 * (a - floored))
    return np.sign(n) * b


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 [n, 1] -> uint8 [n, 2] of its fp16 value."""
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(v.shape[0], 2)


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d, and 0 where d is 0 (an all-zero block quantizes to zeros)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, 0, 1 / d)


def _signed_scale(blocks: np.ndarray, levels: int) -> np.ndarray:
    """ggml's symmetric scale: the element of largest magnitude, sign kept, maps to -levels."""
    imax = abs(blocks).argmax(axis=-1, keepdims=True)
    return np.take_along_axis(blocks, imax, axis=-1) / -levels


# --------------------------------------------------------------- legacy 32-element blocks
def _q8_0(blocks: np.ndarray) -> np.ndarray:
    d = abs(blocks).max(axis=1, keepdims=True) / 127
    id = _inverse(d)
    qs = _np_roundf(blocks * id)
    return np.concatenate([_f16_bytes(d), qs.astype(np.int8).view(np.uint8)], axis=1)


def _nib_pack(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32] values < 16 -> [n, 16]: elements 0..15 low nibbles, 16..31 high."""
    q = q.reshape(q.shape[0], 2, 16)
    return q[:, 0, :] | (q[:, 1, :] << np.uint8(4))


def _q4_0(blocks: np.ndarray) -> np.ndarray:
    d = _signed_scale(blocks, 8)
    id = _inverse(d)
    qs = np.trunc((blocks * id) + np.float32(8.5), dtype=np.float32).astype(np.uint8).clip(0, 15)
    return np.concatenate([_f16_bytes(d), _nib_pack(qs)], axis=-1)


def _q4_1(blocks: np.ndarray) -> np.ndarray:
    max_ = blocks.max(axis=-1, keepdims=True)
    min_ = blocks.min(axis=-1, keepdims=True)
    d = (max_ - min_) / 15
    id = _inverse(d)
    qs = (
        np.trunc((blocks - min_) * id + np.float32(0.5), dtype=np.float32)
        .astype(np.uint8)
        .clip(0, 15)
    )
    return np.concatenate([_f16_bytes(d), _f16_bytes(min_), _nib_pack(qs)], axis=-1)


def _q5_0(blocks: np.ndarray) -> np.ndarray:
    n = blocks.shape[0]
    d = _signed_scale(blocks, 16)
    id = _inverse(d)
    q = np.trunc((blocks * id) + np.float32(16.5), dtype=np.float32).astype(np.uint8).clip(0, 31)
    qs = _nib_pack(q & np.uint8(0x0F))
    qh = np.packbits(q.reshape(n, 1, 32) >> np.uint8(4), axis=-1, bitorder="little").reshape(n, 4)
    return np.concatenate([_f16_bytes(d), qh, qs], axis=-1)


# ----------------------------------------------------------------------- scale searches
def make_qkx2_quants(
    x: np.ndarray,
    w: np.ndarray,
    nmax: int,
    rmin: float = -1.0,
    rdelta: float = 0.1,
    nstep: int = 20,
    clamp_min: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric (scale, min) per group, ggml-quants.c's make_qkx2_quants vectorized.

    x, w: float32 [..., n] (groups along the last axis). Minimizes sum w * (s*L + m - x)^2
    over candidate scales; L in [0, nmax]. Returns (scale, min) float32 [...]: x ~ s*L + min.
    clamp_min keeps min <= 0 (the K-quants store -min as an unsigned 6-bit value).
    """
    x = x.astype(np.float32, copy=False)
    w = w.astype(np.float32, copy=False)
    mn = x.min(axis=-1)
    if clamp_min:
        mn = np.minimum(mn, np.float32(0))
    mx = x.max(axis=-1)
    rng = mx - mn
    flat = rng <= 0
    rng = np.where(flat, np.float32(1), rng).astype(np.float32)
    sum_w = w.sum(axis=-1)
    sum_x = (w * x).sum(axis=-1)
    xm = x - mn[..., None]
    iscale = np.float32(nmax) / rng
    scale = (np.float32(1) / iscale).astype(np.float32)
    L = np.clip(np.rint(iscale[..., None] * xm), 0, nmax)
    diff = scale[..., None] * L + mn[..., None] - x
    best_err = (w * diff * diff).sum(axis=-1)
    best_scale, best_min = scale, mn
    for step in range(nstep + 1):
        iscale = (np.float32(rmin + rdelta * step + nmax) / rng).astype(np.float32)
        La = np.clip(np.rint(iscale[..., None] * xm), 0, nmax).astype(np.float32)
        wl = w * La
        sum_l = wl.sum(axis=-1)
        sum_l2 = (wl * La).sum(axis=-1)
        sum_xl = (wl * x).sum(axis=-1)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, np.float32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        if clamp_min:
            pos = this_min > 0
            this_scale = np.where(
                pos, sum_xl / np.where(sum_l2 > 0, sum_l2, np.float32(1)), this_scale
            )
            this_min = np.where(pos, np.float32(0), this_min)
        diff = this_scale[..., None] * La + this_min[..., None] - x
        err = (w * diff * diff).sum(axis=-1)
        better = ok & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, this_scale, best_scale)
        best_min = np.where(better, this_min, best_min)
    best_scale = np.where(flat, np.float32(0), best_scale).astype(np.float32)
    return best_scale, best_min.astype(np.float32)


def make_qx_quants(x: np.ndarray, nmax: int, w: np.ndarray | None = None) -> np.ndarray:
    """Symmetric scale per group (ggml-quants.c make_qx_quants, rmse_type 1), vectorized.

    x: float32 [..., n]; L in [-nmax, nmax-1]; w defaults to x^2. Returns scale [...]
    (x ~ scale * L); 0 for all-zero groups.
    """
    x = x.astype(np.float32, copy=False)
    if w is None:
        w = x * x
    ax = np.abs(x)
    imax = ax.argmax(axis=-1)[..., None]
    amax = np.take_along_axis(ax, imax, axis=-1)[..., 0]
    max_ = np.take_along_axis(x, imax, axis=-1)[..., 0]
    small = amax < _GROUP_MAX_EPS
    max_ = np.where(small, np.float32(1), max_).astype(np.float32)

    def sums(iscale):
        L = np.clip(np.rint(iscale[..., None] * x), -nmax, nmax - 1).astype(np.float32)
        wl = w * L
        return (wl * x).sum(axis=-1), (wl * L).sum(axis=-1)

    sumlx, suml2 = sums((np.float32(-nmax) / max_).astype(np.float32))
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), np.float32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = (np.float32(-(nmax + 0.1 * step)) / max_).astype(np.float32)
        slx, sl2 = sums(iscale)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        new_scale = slx / np.where(sl2 > 0, sl2, 1)
        scale = np.where(better, new_scale, scale)
        best = np.where(better, new_scale * slx, best)
    return np.where(small, np.float32(0), scale).astype(np.float32)


def _importance(xs: np.ndarray, qw: np.ndarray | None, sigma2: np.ndarray) -> np.ndarray | None:
    """llama.cpp's imatrix weights: qw * sqrt(sigma2 + x^2); None without an imatrix."""
    if qw is None:
        return None
    return (qw * np.sqrt(sigma2 + xs * xs)).astype(np.float32)


# -------------------------------------------------------------------------- K-quants
def _q4_k(blocks: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    nb = blocks.shape[0]
    xs = blocks.reshape(nb, 8, 32)
    if qw is None:
        av_x = np.sqrt((xs * xs).mean(axis=-1, keepdims=True))
        w = av_x + np.abs(xs)
    else:
        sigma2 = (2 * (blocks * blocks).mean(axis=-1)).reshape(nb, 1, 1)
        w = _importance(xs, qw.reshape(nb, 8, 32), sigma2)
    scale, mn = make_qkx2_quants(xs, w, 15, -1.0, 0.1, 20, clamp_min=True)
    the_min = -mn  # >= 0
    max_scale = scale.max(axis=-1, keepdims=True)
    max_min = the_min.max(axis=-1, keepdims=True)
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, np.float32(63) / max_scale, np.float32(0))
        inv_min = np.where(max_min > 0, np.float32(63) / max_min, np.float32(0))
    ls = np.minimum(63, np.rint(inv_scale * scale)).astype(np.uint8)
    lm = np.minimum(63, np.rint(inv_min * the_min)).astype(np.uint8)
    d16 = (max_scale / np.float32(63)).astype(np.float16)
    dmin16 = (max_min / np.float32(63)).astype(np.float16)
    dl = d16.astype(np.float32) * ls.astype(np.float32)  # [nb, 8]
    dm = dmin16.astype(np.float32) * lm.astype(np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.rint((xs + dm[..., None]) / dl[..., None])
    L = np.where(dl[..., None] > 0, np.clip(L, 0, 15), 0).astype(np.uint8)
    sc = np.empty((nb, 12), np.uint8)
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    L = L.reshape(nb, 4, 2, 32)
    qs = (L[:, :, 0, :] | (L[:, :, 1, :] << np.uint8(4))).reshape(nb, 128)
    return np.concatenate(
        [d16.view(np.uint8).reshape(nb, 2), dmin16.view(np.uint8).reshape(nb, 2), sc, qs], axis=1
    )


def _q6_k(blocks: np.ndarray, qw: np.ndarray | None) -> np.ndarray:
    nb = blocks.shape[0]
    xs = blocks.reshape(nb, 16, 16)
    w = None
    if qw is not None:
        sigma2 = (2 * (blocks * blocks).mean(axis=-1)).reshape(nb, 1, 1)
        w = _importance(xs, qw.reshape(nb, 16, 16), sigma2)
    scales = make_qx_quants(xs, 32, w)  # [nb, 16]
    imax = np.abs(scales).argmax(axis=-1)[:, None]
    max_scale = np.take_along_axis(scales, imax, axis=-1)  # signed
    zero = np.abs(max_scale) < _GROUP_MAX_EPS
    max_scale = np.where(zero, np.float32(1), max_scale).astype(np.float32)
    iscale = np.float32(-128) / max_scale
    d16 = np.where(zero, np.float32(0), np.float32(1) / iscale).astype(np.float16)
    sc = np.where(zero, 0, np.clip(np.rint(iscale * scales), -128, 127)).astype(np.int8)
    dl = d16.astype(np.float32) * sc.astype(np.float32)  # [nb, 16]
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.rint(xs / dl[..., None])
    L = (np.where(dl[..., None] != 0, np.clip(L, -32, 31), 0) + 32).astype(np.uint8)
    q = L.reshape(nb, 2, 4, 32)
    lo = q & np.uint8(0x0F)
    hi = q >> np.uint8(4)
    ql = np.concatenate(
        [lo[:, :, 0] | (lo[:, :, 2] << np.uint8(4)), lo[:, :, 1] | (lo[:, :, 3] << np.uint8(4))],
        axis=-1,
    )  # [nb, 2, 64]
    qh = hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)  # [nb, 2, 32]
    return np.concatenate(
        [
            ql.reshape(nb, 128),
            qh.reshape(nb, 64),
            sc.view(np.uint8),
            d16.view(np.uint8).reshape(nb, 2),
        ],
        axis=1,
    )


def _bf16(x: np.ndarray) -> np.ndarray:
    n = x.view(np.uint32)
    n = np.where(
        (n & 0x7FFFFFFF) > 0x7F800000, (n & np.uint32(0xFFFF0000)) | np.uint32(64 << 16), n
    )
    n = (n.astype(np.uint64) + (0x7FFF + ((n >> 16) & 1))) >> 16
    return n.astype(np.uint16).view(np.uint8)


_LEGACY = {
    QuantType.Q8_0: _q8_0,
    QuantType.Q4_0: _q4_0,
    QuantType.Q4_1: _q4_1,
    QuantType.Q5_0: _q5_0,
}
_KQUANT = {QuantType.Q4_K: _q4_k, QuantType.Q6_K: _q6_k}


def _lowbit_types() -> dict:
    out = {}
    for name, bits in (("Q3_G64", 3), ("Q2_G64", 2)):
        q = getattr(QuantType, name, None)
        if q is not None:
            out[q] = bits
    return out


_LOWBIT = _lowbit_types()
QUANTIZABLE = frozenset(
    (QuantType.F32, QuantType.F16, QuantType.BF16, *_LEGACY, *_KQUANT, *_LOWBIT)
)


def quantize(
    x: np.ndarray,
    qtype: QuantType | int | str,
    imatrix: np.ndarray | None = None,
    method: str = "search",
) -> np.ndarray:
    """float32 [rows, cols] (or [cols]) -> raw blocks uint8 [rows, row_bytes].

    imatrix: optional float32 [cols] column importances (mean squared activations).
    method: for the low-bit formats, "search" (error-minimizing scale search, weighted by
    the imatrix when given) or "rtn" (plain min/max round-to-nearest).
    """
    qtype = parse_qtype(qtype)
    if qtype not in QUANTIZABLE:
        raise InvalidArgumentError(f"cannot quantize to {qtype.name}")
    x = np.asarray(x, dtype=np.float32)
    if x.ndim == 1:
        x = x.reshape(1, -1)
    if x.ndim != 2:
        raise InvalidArgumentError(f"quantize takes a 1-D or 2-D array, got shape {x.shape}")
    rows, cols = x.shape
    elems, nbytes = BLOCK_LAYOUT[qtype]
    if cols % elems:
        raise InvalidArgumentError(
            f"{qtype.name} needs a row length that is a multiple of {elems}, got {cols}"
        )
    if not np.isfinite(x).all():
        raise InvalidArgumentError("cannot quantize a tensor with NaN or infinite values")
    if qtype == QuantType.F32:
        return np.ascontiguousarray(x).view(np.uint8).reshape(rows, cols * 4)
    if qtype == QuantType.F16:
        return x.astype(np.float16).view(np.uint8).reshape(rows, cols * 2)
    if qtype == QuantType.BF16:
        return _bf16(np.ascontiguousarray(x)).reshape(rows, cols * 2)
    qw = None
    if imatrix is not None and (qtype in _KQUANT or qtype in _LOWBIT):
        qw = np.asarray(imatrix, dtype=np.float32).reshape(-1)
        if qw.shape[0] != cols:
            raise InvalidArgumentError(
                f"imatrix has {qw.shape[0]} entries, the tensor has {cols} columns"
            )
    nb_row = cols // elems
    out = np.empty((rows, nb_row * nbytes), np.uint8)
    step = max(1, _CHUNK_ELEMS // cols)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        blocks = np.ascontiguousarray(x[r0:r1]).reshape(-1, elems)
        if qtype in _LEGACY:
            raw = _LEGACY[qtype](blocks)
        else:
            w = None
            if qw is not None:
                w = np.broadcast_to(qw.reshape(1, nb_row, elems), (r1 - r0, nb_row, elems))
                w = w.reshape(-1, elems)
            if qtype in _KQUANT:
                raw = _KQUANT[qtype](blocks, w)
            else:
                raw = lowbit.quantize_blocks(blocks, _LOWBIT[qtype], w, method)
        out[r0:r1] = raw.reshape(r1 - r0, nb_row * nbytes)
    return out


def quantize_tensor(
    name: str,
    x: np.ndarray,
    qtype: QuantType | int | str,
    imatrix: np.ndarray | None = None,
    method: str = "search",
) -> QuantTensor:
    """quantize() wrapped as a QuantTensor (shape (rows, cols); 1-D -> rows 1)."""
    x = np.asarray(x, dtype=np.float32)
    x2 = x.reshape(1, -1) if x.ndim == 1 else x
    data = quantize(x2, qtype, imatrix, method)
    return QuantTensor(name, parse_qtype(qtype), (x2.shape[0], x2.shape[1]), data)


def parse_qtype(q: QuantType | int | str) -> QuantType:
    """A QuantType from an enum, a GGML id or a name such as 'q4_k' / 'Q8_0'."""
    if isinstance(q, QuantType):
        return q
    if isinstance(q, (int, np.integer)):
        return QuantType(int(q))
    name = str(q).strip().upper()
    try:
        return QuantType[name]
    except KeyError:
        known = ", ".join(t.name.lower() for t in QUANTIZABLE)
        raise InvalidArgumentError(f"unknown quantization type {q!r} (known: {known})") from None
