"""GGML's 32-element block formats: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1.

Layouts (little endian, fp16 scales):

- Q8_0  (32 elems, 34 B): d f16, qs int8[32];                 x = d * q
- Q4_0  (32 elems, 18 B): d f16, qs u8[16];                   x = d * (nib - 8)
- Q4_1  (32 elems, 20 B): d f16, m f16, qs u8[16];            x = d * nib + m
- Q5_0  (32 elems, 22 B): d f16, qh u32, qs u8[16];           x = d * ((nib | hbit << 4) - 16)
- Q5_1  (32 elems, 24 B): d f16, m f16, qh u32, qs u8[16];    x = d * (nib | hbit << 4) + m

In every 32-element nibble group, the low nibbles of 16 bytes are elements 0..15 and the
high nibbles are elements 16..31.

Quantizers and dequantizers are bit-exact with gguf-py's `gguf.quants` (the same float32
operations, in the same order), which itself follows ggml-quants.c's reference code. They
take no importance weights.
"""

from __future__ import annotations

import numpy as np

from edgerun.quant.block import BlockFormat, f16, f16_bytes, nib_pack, nibbles32
from edgerun.quant.scale_search import roundf

__all__ = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def _inverse(d: np.ndarray) -> np.ndarray:
    """1 / d, and 0 where d is 0 (an all-zero block quantizes to zeros)."""
    with np.errstate(divide="ignore"):
        return np.where(d == 0, 0, 1 / d)


def _signed_scale(blocks: np.ndarray, levels: int) -> np.ndarray:
    """ggml's symmetric scale: the element of largest magnitude, sign kept, maps to -levels."""
    imax = abs(blocks).argmax(axis=-1, keepdims=True)
    return np.take_along_axis(blocks, imax, axis=-1) / -levels


class Q8_0(BlockFormat):
    block_size, type_size = 32, 34
    f16_offsets = (0,)

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        d = abs(blocks).max(axis=1, keepdims=True) / 127
        id = _inverse(d)
        qs = roundf(blocks * id)
        return np.concatenate([f16_bytes(d), qs.astype(np.int8).view(np.uint8)], axis=1)

    @classmethod
    def dequantize_blocks(cls, blocks):
        d = f16(blocks[:, 0:2])
        q = blocks[:, 2:34].view(np.int8).astype(np.float32)
        return q * d


class Q4_0(BlockFormat):
    block_size, type_size = 32, 18
    f16_offsets = (0,)

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        d = _signed_scale(blocks, 8)
        id = _inverse(d)
        qs = (
            np.trunc((blocks * id) + np.float32(8.5), dtype=np.float32).astype(np.uint8).clip(0, 15)
        )
        return np.concatenate([f16_bytes(d), nib_pack(qs)], axis=-1)

    @classmethod
    def dequantize_blocks(cls, blocks):
        d = f16(blocks[:, 0:2])
        q = nibbles32(blocks[:, 2:18]).astype(np.int8) - np.int8(8)
        return d * q.astype(np.float32)


class Q4_1(BlockFormat):
    block_size, type_size = 32, 20
    f16_offsets = (0, 2)
    min_offset = 2

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        max_ = blocks.max(axis=-1, keepdims=True)
        min_ = blocks.min(axis=-1, keepdims=True)
        d = (max_ - min_) / 15
        id = _inverse(d)
        qs = (
            np.trunc((blocks - min_) * id + np.float32(0.5), dtype=np.float32)
            .astype(np.uint8)
            .clip(0, 15)
        )
        return np.concatenate([f16_bytes(d), f16_bytes(min_), nib_pack(qs)], axis=-1)

    @classmethod
    def dequantize_blocks(cls, blocks):
        d = f16(blocks[:, 0:2])
        m = f16(blocks[:, 2:4])
        q = nibbles32(blocks[:, 4:20]).astype(np.float32)
        return d * q + m


class Q5_0(BlockFormat):
    block_size, type_size = 32, 22
    f16_offsets = (0,)

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        n = blocks.shape[0]
        d = _signed_scale(blocks, 16)
        id = _inverse(d)
        q = (
            np.trunc((blocks * id) + np.float32(16.5), dtype=np.float32)
            .astype(np.uint8)
            .clip(0, 31)
        )
        qs = nib_pack(q & np.uint8(0x0F))
        qh = np.packbits(q.reshape(n, 1, 32) >> np.uint8(4), axis=-1, bitorder="little").reshape(
            n, 4
        )
        return np.concatenate([f16_bytes(d), qh, qs], axis=-1)

    @classmethod
    def dequantize_blocks(cls, blocks):
        d = f16(blocks[:, 0:2])
        qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)  # [n, 1]
        hbits = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
        q = (nibbles32(blocks[:, 6:22]) | (hbits << np.uint8(4))).astype(np.int8) - np.int8(16)
        return d * q.astype(np.float32)


def _five_bits(qh: np.ndarray, qs: np.ndarray) -> np.ndarray:
    """qh [n, 4] (one u32 of high bits) and qs [n, 16] -> the 32 5-bit values uint8."""
    qh = np.ascontiguousarray(qh).view(np.uint32)  # [n, 1]
    hbits = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
    return nibbles32(qs) | (hbits << np.uint8(4))


class Q5_1(BlockFormat):
    block_size, type_size = 32, 24
    f16_offsets = (0, 2)
    min_offset = 2

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        n = blocks.shape[0]
        max_ = blocks.max(axis=-1, keepdims=True)
        min_ = blocks.min(axis=-1, keepdims=True)
        d = (max_ - min_) / 31
        id = _inverse(d)
        q = (
            np.trunc((blocks - min_) * id + np.float32(0.5), dtype=np.float32)
            .astype(np.uint8)
            .clip(0, 31)
        )
        qh = np.packbits(q.reshape(n, 1, 32) >> np.uint8(4), axis=-1, bitorder="little").reshape(
            n, 4
        )
        return np.concatenate([f16_bytes(d), f16_bytes(min_), qh, nib_pack(q & np.uint8(0x0F))], -1)

    @classmethod
    def dequantize_blocks(cls, blocks):
        d = f16(blocks[:, 0:2])
        m = f16(blocks[:, 2:4])
        q = _five_bits(blocks[:, 4:8], blocks[:, 8:24]).astype(np.float32)
        return (d * q) + m
