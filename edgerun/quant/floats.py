"""Float element formats as one-element blocks: F32, F16, BF16 (little endian).

BF16 rounds to nearest even with NaNs kept quiet, as gguf-py's `gguf.quants` does.
"""

from __future__ import annotations

import numpy as np

from edgerun.quant.block import BlockFormat

__all__ = ["BF16", "F16", "F32"]


class F32(BlockFormat):
    block_size, type_size = 1, 4

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        return np.ascontiguousarray(blocks).view(np.uint8).reshape(blocks.shape[0], 4)

    @classmethod
    def dequantize_blocks(cls, blocks):
        return blocks.view(np.float32).copy()


class F16(BlockFormat):
    block_size, type_size = 1, 2

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        return blocks.astype(np.float16).view(np.uint8).reshape(blocks.shape[0], 2)

    @classmethod
    def dequantize_blocks(cls, blocks):
        return blocks.view(np.float16).astype(np.float32)


class BF16(BlockFormat):
    block_size, type_size = 1, 2

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        n = np.ascontiguousarray(blocks).view(np.uint32)
        n = np.where(
            (n & 0x7FFFFFFF) > 0x7F800000, (n & np.uint32(0xFFFF0000)) | np.uint32(64 << 16), n
        )
        n = (n.astype(np.uint64) + (0x7FFF + ((n >> 16) & 1))) >> 16
        return n.astype(np.uint16).view(np.uint8).reshape(blocks.shape[0], 2)

    @classmethod
    def dequantize_blocks(cls, blocks):
        return (blocks.view(np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)
