"""Plain numpy reference dequantizers for the GGML block formats.

These are the ground truth the Numba kernels are tested against. They are
written to be bit-exact with gguf-py's `gguf.quants.dequantize` (same float32
operation order), and they are only for tests, tools and reference paths:
nothing in the runtime dequantizes a whole matrix.

Block layouts (little endian, fp16 scales):

- Q8_0  (32 elems, 34 B): d f16, qs int8[32];                 x = d * q
- Q4_0  (32 elems, 18 B): d f16, qs u8[16];                   x = d * (nib - 8)
- Q4_1  (32 elems, 20 B): d f16, m f16, qs u8[16];            x = d * nib + m
- Q5_0  (32 elems, 22 B): d f16, qh u32, qs u8[16];           x = d * ((nib | hbit << 4) - 16)
- Q4_K  (256 elems, 144 B): d f16, dmin f16, scales u8[12] (8 x 6-bit scale and min),
  qs u8[128]; sub-block j of 32: x = d*sc_j * nib - dmin*m_j
- Q6_K  (256 elems, 210 B): ql u8[128], qh u8[64], scales int8[16], d f16;
  x = d*sc_(i//16) * (q6 - 32)

In every 32-element nibble group, the low nibbles of 16 bytes are elements
0..15 and the high nibbles are elements 16..31.
"""

from __future__ import annotations

import numpy as np

from edgerun.quant.formats import BLOCK_LAYOUT, QuantType

__all__ = ["dequantize", "q4k_scale_min", "random_blocks", "register_dequantizer"]

# dequantizers of formats defined elsewhere: qtype -> fn(blocks uint8 [n, bytes_per_block])
# returning float32 [n, elems_per_block]
_EXTRA: dict = {}


def register_dequantizer(qtype, fn) -> None:
    """Plug in the reference dequantizer of a block format this module does not know."""
    _EXTRA[qtype] = fn


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 -> [..., 1] float32 (exact fp16 -> fp32)."""
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """[n, 16] uint8 -> [n, 32] uint8: low nibbles then high nibbles."""
    return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K's 12 scale bytes [n, 12] -> (scale [n, 8], min [n, 8]) uint8 6-bit values."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def _deq_blocks(qtype: QuantType, blocks: np.ndarray) -> np.ndarray:
    """[n_blocks, bytes_per_block] uint8 -> [n_blocks, elems_per_block] float32."""
    n = blocks.shape[0]
    if qtype in _EXTRA:
        return np.asarray(_EXTRA[qtype](blocks), np.float32)
    if qtype == QuantType.Q8_0:
        d = _f16(blocks[:, 0:2])
        q = blocks[:, 2:34].view(np.int8).astype(np.float32)
        return q * d
    if qtype == QuantType.Q4_0:
        d = _f16(blocks[:, 0:2])
        q = _nibbles32(blocks[:, 2:18]).astype(np.int8) - np.int8(8)
        return d * q.astype(np.float32)
    if qtype == QuantType.Q4_1:
        d = _f16(blocks[:, 0:2])
        m = _f16(blocks[:, 2:4])
        q = _nibbles32(blocks[:, 4:20]).astype(np.float32)
        return d * q + m
    if qtype == QuantType.Q5_0:
        d = _f16(blocks[:, 0:2])
        qh = np.ascontiguousarray(blocks[:, 2:6]).view(np.uint32)  # [n, 1]
        hbits = ((qh >> np.arange(32, dtype=np.uint32)) & np.uint32(1)).astype(np.uint8)
        q = (_nibbles32(blocks[:, 6:22]) | (hbits << np.uint8(4))).astype(np.int8) - np.int8(16)
        return d * q.astype(np.float32)
    if qtype == QuantType.Q4_K:
        d = _f16(blocks[:, 0:2])
        dmin = _f16(blocks[:, 2:4])
        sc, mn = q4k_scale_min(blocks[:, 4:16])
        ds = (d * sc.astype(np.float32)).reshape(n, 8, 1)
        dm = (dmin * mn.astype(np.float32)).reshape(n, 8, 1)
        qs = blocks[:, 16:144].reshape(n, 4, 32)
        q = np.stack([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=2).reshape(n, 8, 32)
        return (ds * q.astype(np.float32) - dm).reshape(n, 256)
    if qtype == QuantType.Q6_K:
        ql = blocks[:, 0:128].reshape(n, 2, 64)
        qh = blocks[:, 128:192].reshape(n, 2, 32)
        sc = blocks[:, 192:208].view(np.int8).astype(np.float32)
        d = _f16(blocks[:, 208:210])
        ds = (d * sc).reshape(n, 16, 1)
        # per half of 128: ql low nibbles -> elems 0..63, high nibbles -> 64..127
        lo = np.concatenate([ql & np.uint8(0x0F), ql >> np.uint8(4)], axis=-1)  # [n, 2, 128]
        sh = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        hi = ((qh[:, :, None, :] >> sh) & np.uint8(3)).reshape(n, 2, 128)
        q = (lo | (hi << np.uint8(4))).astype(np.int8) - np.int8(32)
        return (ds * q.reshape(n, 16, 16).astype(np.float32)).reshape(n, 256)
    raise NotImplementedError(qtype)


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
    if qtype == QuantType.F32:
        return raw.view(np.float32).reshape(*lead, out_cols).copy()
    if qtype == QuantType.F16:
        return raw.view(np.float16).astype(np.float32).reshape(*lead, out_cols)
    if qtype == QuantType.BF16:
        return (
            (raw.view(np.uint16).astype(np.uint32) << np.uint32(16))
            .view(np.float32)
            .reshape(*lead, out_cols)
        )
    blocks = raw.reshape(-1, nbytes)
    return _deq_blocks(qtype, blocks).reshape(*lead, out_cols)


# byte offsets of the fp16 scales inside one block, per format
_F16_OFFSETS: dict[QuantType, tuple[int, ...]] = {
    QuantType.Q8_0: (0,),
    QuantType.Q4_0: (0,),
    QuantType.Q4_1: (0, 2),
    QuantType.Q5_0: (0,),
    QuantType.Q4_K: (0, 2),
    QuantType.Q6_K: (208,),
    QuantType.Q3_G64: (0, 2),
    QuantType.Q2_G64: (0, 2),
}


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
    for off in _F16_OFFSETS[qtype]:
        s = (rng.uniform(0.25, 1.0, size=(rows, nb)) * scale).astype(np.float16)
        if off == 2 and qtype == QuantType.Q4_1:
            s = -s * np.float16(8)  # a min: negative offset of the order of 8 * d
        raw[:, :, off : off + 2] = s.view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * nbytes)


# edgerun's own low-bit formats (Q3_G64, Q2_G64) plug in through register_dequantizer
from edgerun.quant import lowbit as _lowbit  # noqa: E402

_lowbit.register_dequantizers(register_dequantizer)
