"""GGML's K-quant formats with 256-element super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Layouts (little endian, fp16 scales):

- Q2_K  (256 elems, 84 B): scales u8[16] (4-bit scale | 4-bit min << 4 per 16), qs u8[64],
  d f16, dmin f16; element 128 h + 32 s + l is bits 2s..2s+1 of qs[32 h + l];
  x = d*(sc & 15) * q - dmin*(sc >> 4)
- Q3_K  (256 elems, 110 B): hmask u8[32], qs u8[64], scales u8[12] (16 x 6-bit, offset
  32), d f16; low bits as Q2_K's, the third bit of element 32 j + l is bit j of
  hmask[l] (set: +0, clear: -4); x = d*(sc - 32) * (q2 - 4 (1 - hbit))
- Q4_K  (256 elems, 144 B): d f16, dmin f16, scales u8[12] (8 x 6-bit scale and min),
  qs u8[128]; sub-block j of 32: x = d*sc_j * nib - dmin*m_j
- Q5_K  (256 elems, 176 B): d f16, dmin f16, scales u8[12] (as Q4_K), qh u8[32], qs u8[128];
  Q4_K's nibbles, bit 4 of element 32 j + l is bit j of qh[l]
- Q6_K  (256 elems, 210 B): ql u8[128], qh u8[64], scales int8[16], d f16;
  x = d*sc_(i//16) * (q6 - 32)

Quantizers: ggml-quants.c's reference algorithms (`make_qkx2_quants` for Q4_K's (scale,
min) pairs per 32, `make_qx_quants` with its 19-step scale search for Q6_K's scales per
16; 6-bit / 8-bit second-level scales), vectorized over all sub-blocks, importance-weighted
with an imatrix; Q5_K is Q4_K's with 31 levels. Q2_K and Q3_K have no quantizer here (they
load from files llama.cpp wrote). gguf-py has no K-quant quantizer to compare with; tests
hold them to error bounds and to gguf-py's dequantizer, which the dequantizers here match
bit for bit.
"""

from __future__ import annotations

import numpy as np

from edgerun.quant.block import BlockFormat, f16
from edgerun.quant.scale_search import (
    GROUP_MAX_EPS,
    importance,
    make_qkx2_quants,
    make_qx_quants,
)

__all__ = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "q4k_scale_min"]


def q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K's 12 scale bytes [n, 12] -> (scale [n, 8], min [n, 8]) uint8 6-bit values."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _scale_min_quants(blocks, qw, nmax, rmin, nstep):
    """Q4_K / Q5_K's (scale, min) per 32 with 6-bit second-level scales: (d f16 [n, 2]
    bytes, dmin f16 bytes, the 12 packed scale bytes, levels uint8 [n, 8, 32] in 0..nmax)."""
    nb = blocks.shape[0]
    xs = blocks.reshape(nb, 8, 32)
    if qw is None:
        av_x = np.sqrt((xs * xs).mean(axis=-1, keepdims=True))
        w = av_x + np.abs(xs)
    else:
        sigma2 = (2 * (blocks * blocks).mean(axis=-1)).reshape(nb, 1, 1)
        w = importance(xs, qw.reshape(nb, 8, 32), sigma2)
    scale, mn = make_qkx2_quants(xs, w, nmax, rmin, 0.1, nstep, clamp_min=True)
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
    L = np.where(dl[..., None] > 0, np.clip(L, 0, nmax), 0).astype(np.uint8)
    sc = np.empty((nb, 12), np.uint8)
    sc[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    sc[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:8] & 0x0F) | ((lm[:, 4:8] & 0x0F) << 4)
    return d16.view(np.uint8).reshape(nb, 2), dmin16.view(np.uint8).reshape(nb, 2), sc, L


def _nibble_pairs(L):
    """[n, 8, 32] values (low 4 bits used) -> the 128 nibble bytes: sub-block 2g in the
    low nibbles of bytes 32 g .. 32 g + 31, sub-block 2g + 1 in their high nibbles."""
    L = (L & np.uint8(0x0F)).reshape(L.shape[0], 4, 2, 32)
    return (L[:, :, 0, :] | (L[:, :, 1, :] << np.uint8(4))).reshape(L.shape[0], 128)


def _scale_min_deq(blocks, q):
    """Q4_K / Q5_K: x = d sc_j q - dmin m_j over sub-blocks j of 32 (gguf-py's order)."""
    n = blocks.shape[0]
    d = f16(blocks[:, 0:2])
    dmin = f16(blocks[:, 2:4])
    sc, mn = q4k_scale_min(blocks[:, 4:16])
    ds = (d * sc.astype(np.float32)).reshape(n, 8, 1)
    dm = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
    return (ds * q.astype(np.float32) - dm).reshape(n, 256)


def _nibbles_of(qs):
    """The 128 nibble bytes [n, 128] -> [n, 8, 32] uint8 values (_nibble_pairs' inverse)."""
    n = qs.shape[0]
    qs = qs.reshape(n, 4, 32)
    return np.stack([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2).reshape(n, 8, 32)


class Q4_K(BlockFormat):
    block_size, type_size = 256, 144
    uses_imatrix = True
    f16_offsets = (0, 2)

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        d16, dmin16, sc, L = _scale_min_quants(blocks, w, 15, -1.0, 20)
        return np.concatenate([d16, dmin16, sc, _nibble_pairs(L)], axis=1)

    @classmethod
    def dequantize_blocks(cls, blocks):
        return _scale_min_deq(blocks, _nibbles_of(blocks[:, 16:144]))


class Q5_K(BlockFormat):
    block_size, type_size = 256, 176
    uses_imatrix = True
    f16_offsets = (0, 2)

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        # ggml-quants.c's quantize_row_q5_K_ref: make_qkx2_quants(32, 31, ..., -0.5, 0.1, 15)
        d16, dmin16, sc, L = _scale_min_quants(blocks, w, 31, -0.5, 15)
        hb = (L >> np.uint8(4)) << np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        qh = np.bitwise_or.reduce(hb, axis=1)  # [n, 32]: bit j = high bit of sub-block j
        return np.concatenate([d16, dmin16, sc, qh, _nibble_pairs(L)], axis=1)

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        qh = blocks[:, 16:48].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        q = _nibbles_of(blocks[:, 48:176]) | ((qh & np.uint8(1)) << np.uint8(4))
        return _scale_min_deq(blocks, q)


def _crumbs(qs):
    """K-quant 2-bit fields: qs [n, 64] -> [n, 256] uint8 (element 128 h + 32 s + l is
    bits 2s..2s+1 of qs[32 h + l])."""
    n = qs.shape[0]
    sh = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return ((qs.reshape(n, 2, 1, 32) >> sh) & np.uint8(3)).reshape(n, 256)


class Q2_K(BlockFormat):
    block_size, type_size = 256, 84
    f16_offsets = (80, 82)

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        scales = blocks[:, 0:16]
        d = f16(blocks[:, 80:82])
        dmin = f16(blocks[:, 82:84])
        dl = (d * (scales & 0xF).astype(np.float32)).reshape(n, 16, 1)
        ml = (dmin * (scales >> 4).astype(np.float32)).reshape(n, 16, 1)
        q = _crumbs(blocks[:, 16:80]).reshape(n, 16, 16).astype(np.float32)
        return (dl * q - ml).reshape(n, 256)


def q3k_scales(scales: np.ndarray) -> np.ndarray:
    """Q3_K's 12 scale bytes [n, 12] -> the 16 signed scales [n, 16] int8 (6-bit - 32)."""
    n = scales.shape[0]
    lo = scales[:, 0:8].reshape(n, 1, 8) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
    hi = scales[:, 8:12].reshape(n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 4, 1)
    s = (lo.reshape(n, 16) & np.uint8(0x0F)) | ((hi.reshape(n, 16) & np.uint8(3)) << np.uint8(4))
    return s.astype(np.int8) - np.int8(32)


class Q3_K(BlockFormat):
    block_size, type_size = 256, 110
    f16_offsets = (108,)

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = f16(blocks[:, 108:110])
        dl = (d * q3k_scales(blocks[:, 96:108]).astype(np.float32)).reshape(n, 16, 1)
        ql = _crumbs(blocks[:, 32:96]).reshape(n, 16, 16)
        sh = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        qh = ((blocks[:, 0:32].reshape(n, 1, 32) >> sh) & np.uint8(1)).reshape(n, 16, 16)
        qh = qh ^ np.uint8(1)  # a clear bit subtracts 4
        q = (ql.astype(np.int8) - (qh << np.uint8(2)).astype(np.int8)).astype(np.float32)
        return (dl * q).reshape(n, 256)


class Q6_K(BlockFormat):
    block_size, type_size = 256, 210
    uses_imatrix = True
    f16_offsets = (208,)

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        qw = w
        nb = blocks.shape[0]
        xs = blocks.reshape(nb, 16, 16)
        w = None
        if qw is not None:
            sigma2 = (2 * (blocks * blocks).mean(axis=-1)).reshape(nb, 1, 1)
            w = importance(xs, qw.reshape(nb, 16, 16), sigma2)
        scales = make_qx_quants(xs, 32, w)  # [nb, 16]
        imax = np.abs(scales).argmax(axis=-1)[:, None]
        max_scale = np.take_along_axis(scales, imax, axis=-1)  # signed
        zero = np.abs(max_scale) < GROUP_MAX_EPS
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
            [
                lo[:, :, 0] | (lo[:, :, 2] << np.uint8(4)),
                lo[:, :, 1] | (lo[:, :, 3] << np.uint8(4)),
            ],
            axis=-1,
        )  # [nb, 2, 64]
        qh = (
            hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)
        )  # [nb, 2, 32]
        return np.concatenate(
            [
                ql.reshape(nb, 128),
                qh.reshape(nb, 64),
                sc.view(np.uint8),
                d16.view(np.uint8).reshape(nb, 2),
            ],
            axis=1,
        )

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        ql = blocks[:, 0:128].reshape(n, 2, 64)
        qh = blocks[:, 128:192].reshape(n, 2, 32)
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = f16(blocks[:, 208:210])
        ds = (d * sc).reshape(n, 16, 1)
        # per half of 128: ql low nibbles -> elems 0..63, high nibbles -> 64..127
        lo = np.concatenate([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=-1)  # [n, 2, 128]
        sh = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        hi = ((qh[:, :, None, :] >> sh) & np.uint8(3)).reshape(n, 2, 128)
        q = (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)
        return (ds * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)
