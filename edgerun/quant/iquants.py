"""GGML's non-linear 4-bit formats: IQ4_NL and IQ4_XS.

Both map each 4-bit index through one fixed table of 16 signed levels (KVALUES, denser
near zero, as weights are) and scale it:

- IQ4_NL (32 elems, 18 B): d f16, qs u8[16]; x = d * KVALUES[nib] (nibbles as Q4_0:
  low nibbles elements 0..15, high 16..31)
- IQ4_XS (256 elems, 136 B): d f16, scales_h u16, scales_l u8[4], qs u8[128]; sub-block j
  of 32 has the 6-bit scale ls_j = (scales_l nibble j) | (bits 2j..2j+1 of scales_h) << 4
  and its 16 bytes at qs[16 j]; x = d * (ls_j - 32) * KVALUES[nib]

Dequantizers are bit-exact with gguf-py's. Quantizers: none (the formats load from files
llama.cpp wrote).
"""

from __future__ import annotations

import numpy as np

from edgerun.quant.block import BlockFormat, f16, nibbles32

__all__ = ["IQ4_NL", "IQ4_XS", "KVALUES", "iq4xs_scales"]

# ggml-common.h's kvalues_iq4nl
KVALUES = np.array(
    [-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8
)


class IQ4_NL(BlockFormat):
    block_size, type_size = 32, 18
    f16_offsets = (0,)

    @classmethod
    def dequantize_blocks(cls, blocks):
        d = f16(blocks[:, 0:2])
        return d * KVALUES[nibbles32(blocks[:, 2:18])].astype(np.float32)


def iq4xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS blocks [n, 136] -> their 8 signed sub-block scales [n, 8] int8 (6-bit - 32)."""
    n = blocks.shape[0]
    sh = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16)  # [n, 1]
    lo = blocks[:, 4:8].reshape(n, 4, 1) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2)
    lo = lo.reshape(n, 8) & np.uint8(0x0F)
    hi = (sh >> np.arange(0, 16, 2, dtype=np.uint16)).astype(np.uint8) & np.uint8(3)
    return (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)


class IQ4_XS(BlockFormat):
    block_size, type_size = 256, 136
    f16_offsets = (0,)

    @classmethod
    def dequantize_blocks(cls, blocks):
        n = blocks.shape[0]
        d = f16(blocks[:, 0:2])
        dl = (d * iq4xs_scales(blocks).astype(np.float32)).reshape(n, 8, 1)
        q = nibbles32(blocks[:, 8:136].reshape(n * 8, 16)).reshape(n, 8, 32)
        return (dl * KVALUES[q].astype(np.float32)).reshape(n, 256)
