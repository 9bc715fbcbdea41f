"""The shape every block format class has (gguf-py's quants.py style).

A format is a class with its layout (elements and bytes per block) and its two numpy
directions: quantize_blocks (float32 [n, block_size] -> uint8 [n, type_size]) and
dequantize_blocks (the reverse, the reference the kernels are tested against). The table
in formats.py maps each QuantType to its class; quantize.py and reference.py only look
formats up there.
"""

from __future__ import annotations

import numpy as np

__all__ = ["BlockFormat", "f16", "f16_bytes", "nib_pack", "nibbles32"]


class BlockFormat:
    """One block format: layout + quantize + dequantize, all class-level (no instances)."""

    block_size: int  # elements per block
    type_size: int  # bytes per block
    # whether quantize_blocks takes importance weights (an imatrix) and a method
    uses_imatrix: bool = False
    # byte offsets of the fp16 scales inside a block (reference.random_blocks sets them sane)
    f16_offsets: tuple[int, ...] = ()
    # an offset of f16_offsets that holds a min (random_blocks makes it about -8 d)
    min_offset: int | None = None

    @classmethod
    def quantize_blocks(
        cls, blocks: np.ndarray, w: np.ndarray | None = None, method: str = "search"
    ) -> np.ndarray:
        """float32 [n, block_size] -> uint8 [n, type_size]. w: importance weights [n,
        block_size] for the formats that use them (uses_imatrix), else ignored."""
        raise NotImplementedError(cls.__name__)

    @classmethod
    def dequantize_blocks(cls, blocks: np.ndarray) -> np.ndarray:
        """uint8 [n, type_size] -> float32 [n, block_size]."""
        raise NotImplementedError(cls.__name__)


def f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [..., 1] float32 (exact fp16 -> fp32)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def f16_bytes(v: np.ndarray) -> np.ndarray:
    """float32 [n, 1] -> uint8 [n, 2] of its fp16 value."""
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(v.shape[0], 2)


def nibbles32(qs: np.ndarray) -> np.ndarray:
    """[n, 16] uint8 -> [n, 32] uint8: low nibbles then high nibbles."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def nib_pack(q: np.ndarray) -> np.ndarray:
    """uint8 [n, 32] values < 16 -> [n, 16]: elements 0..15 low nibbles, 16..31 high."""
    q = q.reshape(q.shape[0], 2, 16)
    return q[:, 0, :] | (q[:, 1, :] << np.uint8(4))
