"""Quantizers: float32 matrices -> raw GGML blocks (vectorized numpy).

`quantize(x, qtype, imatrix=None)` returns uint8 [rows, row_bytes(qtype, cols)], the
same bytes a GGUF file would hold, so the kernels in ops/ and the reference
dequantizer (edgerun.quant.reference) read them unchanged. Each format's own
quantize_blocks (its class in formats.FORMATS) does the work; see legacy.py (bit-exact
with gguf-py), kquants.py (ggml-quants.c's reference algorithms), lowbit.py, floats.py.

`imatrix` (float32 [cols], mean squared activation per input column, see
edgerun.tools.calibrate) turns the scale searches into importance-weighted ones, as
llama.cpp's imatrix quantization does: weights = imatrix[col] * sqrt(sigma2 + x^2).
It is used by the formats with uses_imatrix (the K-quants and the low-bit formats); the
32-block legacy formats and float formats ignore it.
"""

from __future__ import annotations

import numpy as np

from edgerun.errors import InvalidArgumentError
from edgerun.quant.block import BlockFormat
from edgerun.quant.formats import BLOCK_LAYOUT, FORMATS, QuantTensor, QuantType
from edgerun.quant.scale_search import make_qkx2_quants, make_qx_quants

__all__ = ["quantize", "quantize_tensor", "make_qkx2_quants", "make_qx_quants", "QUANTIZABLE"]

_CHUNK_ELEMS = 1 << 21  # rows are quantized in chunks of about this many elements
# the formats with a quantizer (Q2_K, Q3_K and the IQ4 formats only load from files)
QUANTIZABLE = frozenset(
    q
    for q, f in FORMATS.items()
    if f.quantize_blocks.__func__ is not BlockFormat.quantize_blocks.__func__
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
    fmt = FORMATS[qtype]
    if elems == 1:  # a float format: one element per block, no chunks needed
        return fmt.quantize_blocks(x.reshape(-1, 1)).reshape(rows, cols * nbytes)
    qw = None
    if imatrix is not None and fmt.uses_imatrix:
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
        w = None
        if qw is not None:
            w = np.broadcast_to(qw.reshape(1, nb_row, elems), (r1 - r0, nb_row, elems))
            w = w.reshape(-1, elems)
        raw = fmt.quantize_blocks(blocks, w, method)
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
