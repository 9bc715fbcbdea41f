"""Plain numpy reference dequantization of every block format, and random valid blocks.

These are the ground truth the Numba kernels are tested against. Each format's
dequantize_blocks (its class in formats.FORMATS) is written to be bit-exact with gguf-py's
`gguf.quants.dequantize` (same float32 operation order); they are only for tests, tools and
reference paths: nothing in the runtime dequantizes a whole matrix.
"""

from __future__ import annotations

import numpy as np

from edgerun.quant.formats import BLOCK_LAYOUT, FORMATS, QuantType
from edgerun.quant.kquants import q4k_scale_min

__all__ = ["dequantize", "q4k_scale_min", "random_blocks"]


def dequantize(qtype: QuantType | int, raw: np.ndarray) -> np.ndarray:
    """Dequantize raw GGML blocks: uint8 [..., k*bytes_per_block] -> float32 [..., k*elems].

    For F32/F16/BF16 the raw bytes are the little-endian element values.
    """
    qtype = QuantType(qtype)
    raw = np.ascontiguousarray(raw)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    elems, nbytes = BLOCK_LAYOUT[qtype]
    lead = raw.shape[:-1]
    if raw.shape[-1] % nbytes:
        raise ValueError(
            f"{qtype.name} rows must be a multiple of {nbytes} bytes, got {raw.shape[-1]}"
        )
    out_cols = raw.shape[-1] // nbytes * elems
    blocks = raw.reshape(-1, nbytes)
    return FORMATS[qtype].dequantize_blocks(blocks).reshape(*lead, out_cols)


def random_blocks(
    qtype: QuantType | int, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01
) -> np.ndarray:
    """Random valid raw blocks uint8 [rows, row_bytes]: random payload bits, sane fp16 scales.

    Meant for tests and benchmarks of formats gguf-py cannot quantize to.
    """
    qtype = QuantType(qtype)
    elems, nbytes = BLOCK_LAYOUT[qtype]
    nb = cols // elems
    if qtype in (QuantType.F32, QuantType.F16, QuantType.BF16):
        x = rng.standard_normal((rows, cols)).astype(np.float32)
        if qtype == QuantType.F32:
            return x.view(np.uint8)
        if qtype == QuantType.F16:
            return x.astype(np.float16).view(np.uint8)
        return (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16).view(np.uint8)
    raw = rng.integers(0, 256, size=(rows, nb, nbytes), dtype=np.uint8)
    fmt = FORMATS[qtype]
    for off in fmt.f16_offsets:
        s = (rng.uniform(0.25, 1.0, size=(rows, nb)) * scale).astype(np.float16)
        if off == fmt.min_offset:
            s = -s * np.float16(8)  # a min: negative offset of the order of 8 * d
        raw[:, :, off : off + 2] = s.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * nbytes)
