"""GGML's 1-3 bit grid formats: IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S.

Each 256-element super-block stores, per group of 8 (IQ2, IQ1) or 4 (IQ3) weights, an
index into a fixed grid of level vectors (edgerun.quant.iq_grids, from llama.cpp's
ggml-common.h) plus sign bits, and a few small scales:

- IQ2_XXS (66 B): d f16, 8 x (u32 a, u32 b) per 32 weights: a = 4 byte indices into
  IQ2XXS_GRID; b = four 7-bit sign indices into KSIGNS (bits 0, 7, 14, 21) and the 4-bit
  scale s (bits 28..31); x = d (0.5 + s) / 4 * grid * sign
- IQ2_XS (74 B): d f16, qs u16[32] (low 9 bits an IQ2XS_GRID index, high 7 a KSIGNS
  index), scales u8[8] (one nibble per 16 weights); x = d (0.5 + s) / 4 * grid * sign
- IQ2_S (82 B): d f16, qs u8[32] (index low bytes), signs u8[32] (one bit per weight),
  qh u8[8] (2 high index bits each), scales u8[8]; 10-bit IQ2S_GRID indices
- IQ3_XXS (98 B): d f16, qs u8[64] (IQ3XXS_GRID indices of 4 weights), 8 x u32 as
  IQ2_XXS's b; x = d (0.5 + s) / 2 * grid * sign
- IQ3_S (110 B): d f16, qs u8[64], qh u8[8] (bit 8 of each index), signs u8[32],
  scales u8[4] (one nibble per 32); x = d (1 + 2 s) * grid * sign
- IQ1_S (50 B): d f16, qs u8[32], qh u16[8] (per 32 weights: 3 high index bits per group
  of 8, a 3-bit scale at bits 12..14, the delta's sign at bit 15);
  x = d (2 s + 1) * (grid + delta), delta = +-0.125

The dequantizers repeat gguf-py's float32 operations in its order (bit-exact with
`gguf.quants.dequantize`). Quantizers: none (the formats load from files llama.cpp's
quantizer wrote with an importance matrix).
"""

from __future__ import annotations

import numpy as np

from edgerun.quant.block import BlockFormat, f16
from edgerun.quant.iq_grids import (
    IQ1S_GRID,
    IQ2S_GRID,
    IQ2XS_GRID,
    IQ2XXS_GRID,
    IQ3S_GRID,
    IQ3XXS_GRID,
    KSIGNS,
)

__all__ = ["IQ1_DELTA", "IQ1_S", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ3_S", "IQ3_XXS"]

IQ1_DELTA = np.float32(0.125)
_BITS8 = np.arange(8, dtype=np.uint8)


def _grid_f32(grid: np.ndarray) -> np.ndarray:
    return grid.astype(np.float32)


_G2XXS, _G2XS, _G2S = _grid_f32(IQ2XXS_GRID), _grid_f32(IQ2XS_GRID), _grid_f32(IQ2S_GRID)
_G3XXS, _G3S, _G1S = _grid_f32(IQ3XXS_GRID), _grid_f32(IQ3S_GRID), _grid_f32(IQ1S_GRID)


def _sign_bits(bits: np.ndarray) -> np.ndarray:
    """uint8 [...] of 8 sign bits -> float32 [..., 8] of +1 / -1 (bit j set: element j < 0)."""
    b = (bits[..., None] >> _BITS8) & np.uint8(1)
    return np.where(b == 0, np.float32(1), np.float32(-1))


def _ksign_words(w: np.ndarray) -> np.ndarray:
    """uint32 [n, k] of four 7-bit sign indices (bits 0, 7, 14, 21) -> float32 [n, k, 4, 8]."""
    idx = (w[..., None] >> np.array([0, 7, 14, 21], dtype=np.uint32)) & np.uint32(0x7F)
    return _sign_bits(KSIGNS[idx])


def _half_nibble_scales(b: np.ndarray) -> np.ndarray:
    """uint8 [n, k] -> [n, 2k]: low nibble then high nibble of each byte."""
    n = b.shape[0]
    return ((b[:, :, None] >> np.array([0, 4], dtype=np.uint8)) & np.uint8(0x0F)).reshape(n, -1)


class IQ2_XXS(BlockFormat):
    block_size, type_size = 256, 66
    f16_offsets = (0,)

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = f16(blocks[:, 0:2])
        qs = np.ascontiguousarray(blocks[:, 2:66]).view(np.uint32).reshape(n, 8, 2)
        db = d * (np.float32(0.5) + (qs[..., 1] >> 28).astype(np.float32)) * np.float32(0.25)
        signs = _ksign_words(qs[..., 1])  # [n, 8, 4, 8]
        grid = _G2XXS[np.ascontiguousarray(qs[..., 0]).view(np.uint8).reshape(n, 8, 4)]
        return (db.reshape(n, 8, 1, 1) * grid * signs).reshape(n, 256)


class IQ2_XS(BlockFormat):
    block_size, type_size = 256, 74
    f16_offsets = (0,)

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = f16(blocks[:, 0:2])
        qs = np.ascontiguousarray(blocks[:, 2:66]).view(np.uint16)  # [n, 32]
        db = d * (np.float32(0.5) + _half_nibble_scales(blocks[:, 66:74])) * np.float32(0.25)
        signs = _sign_bits(KSIGNS[qs >> 9]).reshape(n, 16, 2, 8)
        grid = _G2XS[qs & np.uint16(511)].reshape(n, 16, 2, 8)
        return (db.reshape(n, 16, 1, 1) * grid * signs).reshape(n, 256)


class IQ2_S(BlockFormat):
    block_size, type_size = 256, 82
    f16_offsets = (0,)

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = f16(blocks[:, 0:2])
        db = d * (np.float32(0.5) + _half_nibble_scales(blocks[:, 74:82])) * np.float32(0.25)
        signs = _sign_bits(blocks[:, 34:66]).reshape(n, 16, 2, 8)
        qh = (blocks[:, 66:74, None] >> np.array([0, 2, 4, 6], dtype=np.uint8)) & np.uint8(3)
        idx = blocks[:, 2:34].astype(np.uint16) | (qh.astype(np.uint16) << 8).reshape(n, 32)
        grid = _G2S[idx].reshape(n, 16, 2, 8)
        return (db.reshape(n, 16, 1, 1) * grid * signs).reshape(n, 256)


class IQ3_XXS(BlockFormat):
    block_size, type_size = 256, 98
    f16_offsets = (0,)

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = f16(blocks[:, 0:2])
        sw = np.ascontiguousarray(blocks[:, 66:98]).view(np.uint32)  # [n, 8]
        db = d * (np.float32(0.5) + (sw >> 28).astype(np.float32)) * np.float32(0.5)
        signs = _ksign_words(sw)  # [n, 8, 4, 8]
        grid = _G3XXS[blocks[:, 2:66]].reshape(n, 8, 4, 8)
        return (db.reshape(n, 8, 1, 1) * grid * signs).reshape(n, 256)


class IQ3_S(BlockFormat):
    block_size, type_size = 256, 110
    f16_offsets = (0,)

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = f16(blocks[:, 0:2])
        s = _half_nibble_scales(blocks[:, 106:110])  # [n, 8] uint8
        db = d * (1 + 2 * s)
        signs = _sign_bits(blocks[:, 74:106]).reshape(n, 8, 4, 8)
        qh = ((blocks[:, 66:74, None] >> _BITS8) & np.uint8(1)).astype(np.uint16).reshape(n, 64)
        idx = blocks[:, 2:66].astype(np.uint16) | (qh << 8)
        grid = _G3S[idx].reshape(n, 8, 4, 8)
        return (db.reshape(n, 8, 1, 1) * grid * signs).reshape(n, 256)


class IQ1_S(BlockFormat):
    block_size, type_size = 256, 50
    f16_offsets = (0,)

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = f16(blocks[:, 0:2])
        qh = np.ascontiguousarray(blocks[:, 34:50]).view(np.uint16)  # [n, 8]
        dl = (d * (2 * ((qh >> 12) & 7) + 1)).reshape(n, 8, 1, 1)
        delta = np.where((qh & np.uint16(0x8000)) == 0, IQ1_DELTA, -IQ1_DELTA)
        hi = (qh[:, :, None] >> np.array([0, 3, 6, 9], dtype=np.uint16)) & np.uint16(7)
        idx = blocks[:, 2:34].astype(np.uint16) | (hi << 8).reshape(n, 32)
        grid = _G1S[idx].reshape(n, 8, 4, 8)
        return (dl * (grid + delta.reshape(n, 8, 1, 1))).reshape(n, 256)
