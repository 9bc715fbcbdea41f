"""edgerun's own 3-bit and 2-bit block formats (Q3_G64, Q2_G64).

Why not GGML's Q3_K / Q2_K: their 256-element super-blocks need row lengths that are
multiples of 256, and the small models edgerun targets have d_model 576 (SmolLM2),
896 (Qwen2.5-0.5B) or 640 (Gemma 3 270M): llama.cpp falls those tensors back to
4-bit formats. 64 divides all of them.

Layouts (little endian, one block = 64 elements; x = d * q + m, asymmetric):

- Q2_G64 (64 elems, 20 B, 2.5 bits/weight): d f16, m f16, qs u8[16].
  Element e = 16*s + l (s = 0..3, l = 0..15) is bits 2s..2s+1 of qs[l].
- Q3_G64 (64 elems, 28 B, 3.5 bits/weight): d f16, m f16, ql u8[16], qh u8[8].
  Element e = 16*s + l: low two bits are bits 2s..2s+1 of ql[l] (as Q2_G64), the third
  bit is bit (2s + (l >> 3)) of qh[l & 7].

Both put the 4 elements of one byte 16 apart, so a kernel's 16 lanes each read one byte
per block (the same lane structure as GGML's nibble formats).

Quantization: "rtn" is min/max round-to-nearest (d = (max-min)/nmax, m = min); "search"
minimizes the (importance-)weighted squared error over 21 candidate scales with a
closed-form least-squares (d, m) for each (ggml's make_qkx2_quants without the m <= 0
constraint), then rounds d, m to fp16 and re-rounds the values with them.

This module is the format only (layout, quantize, numpy dequantize); formats.py's table
names its classes, and ops/traits.py's table their kernels.
"""

from __future__ import annotations

import numpy as np

from edgerun.quant.block import BlockFormat
from edgerun.quant.scale_search import make_qkx2_quants

__all__ = ["BLOCK", "BYTES", "Q2_G64", "Q3_G64", "dequantize_blocks", "quantize_blocks"]

BLOCK = 64
BYTES = {3: 28, 2: 20}


def _requant(x: np.ndarray, d: np.ndarray, m: np.ndarray, nmax: int) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.rint((x - m[:, None]) / d[:, None])
    return np.where(d[:, None] > 0, np.clip(q, 0, nmax), 0).astype(np.uint8)


def quantize_blocks(
    blocks: np.ndarray, bits: int, w: np.ndarray | None = None, method: str = "search"
) -> np.ndarray:
    """float32 [n, 64] -> uint8 [n, BYTES[bits]]. w: optional importance weights [n, 64]."""
    x = np.asarray(blocks, dtype=np.float32)
    n = x.shape[0]
    nmax = (1 << bits) - 1
    if method == "rtn":
        mn = x.min(axis=-1)
        d = (x.max(axis=-1) - mn) / np.float32(nmax)
    elif method == "search":
        if w is None:
            # ggml's default weighting for the K-quants: favour large magnitudes a little
            av = np.sqrt((x * x).mean(axis=-1, keepdims=True))
            w = av + np.abs(x)
        else:
            sigma2 = 2 * (x * x).mean(axis=-1, keepdims=True)
            w = (np.asarray(w, dtype=np.float32) * np.sqrt(sigma2 + x * x)).astype(np.float32)
        d, mn = make_qkx2_quants(x, w, nmax, -1.0, 0.1, 20, clamp_min=False)
    else:
        raise ValueError(f"unknown quantization method {method!r} (rtn or search)")
    d16 = d.astype(np.float16)
    m16 = mn.astype(np.float16)
    L = _requant(x, d16.astype(np.float32), m16.astype(np.float32), nmax)  # [n, 64]
    L4 = L.reshape(n, 4, 16)
    low = L4 & np.uint8(3)
    ql = low[:, 0] | (low[:, 1] << 2) | (low[:, 2] << 4) | (low[:, 3] << 6)  # [n, 16]
    head = [d16.view(np.uint8).reshape(n, 2), m16.view(np.uint8).reshape(n, 2), ql]
    if bits == 2:
        return np.concatenate(head, axis=1)
    hb = (L4 >> np.uint8(2)) & np.uint8(1)  # [n, s, l]
    # qh[j] bit (2s + t) = high bit of element 16 s + 8 t + j
    hb = hb.reshape(n, 4, 2, 8)  # [n, s, t, j]
    shifts = (2 * np.arange(4)[:, None] + np.arange(2)[None, :]).astype(np.uint8)  # [s, t]
    qh = (hb << shifts[None, :, :, None]).sum(axis=(1, 2)).astype(np.uint8)  # [n, 8]
    return np.concatenate([*head, qh], axis=1)


def dequantize_blocks(raw: np.ndarray, bits: int) -> np.ndarray:
    """uint8 [n, BYTES[bits]] -> float32 [n, 64] (numpy reference)."""
    raw = np.ascontiguousarray(raw)
    n = raw.shape[0]
    d = raw[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n, 1]
    m = raw[:, 2:4].copy().view(np.float16).astype(np.float32)
    ql = raw[:, 4:20]
    sh = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    q = (ql[:, None, :] >> sh) & np.uint8(3)  # [n, s, l]
    if bits == 3:
        qh = raw[:, 20:28]  # [n, 8]
        l = np.arange(16)
        hsrc = qh[:, l & 7]  # [n, 16]
        bitpos = (2 * np.arange(4)[:, None] + (l >> 3)[None, :]).astype(np.uint8)  # [s, l]
        h = (hsrc[:, None, :] >> bitpos[None]) & np.uint8(1)
        q = q | (h << np.uint8(2))
    return d * q.reshape(n, 64).astype(np.float32) + m


class _G64(BlockFormat):
    bits: int
    block_size = BLOCK
    uses_imatrix = True
    f16_offsets = (0, 2)

    @classmethod
    def quantize_blocks(cls, blocks, w=None, method="search"):
        return quantize_blocks(blocks, cls.bits, w, method)

    @classmethod
    def dequantize_blocks(cls, blocks):
        return dequantize_blocks(blocks, cls.bits)


class Q3_G64(_G64):
    bits, type_size = 3, BYTES[3]


class Q2_G64(_G64):
    bits, type_size = 2, BYTES[2]
