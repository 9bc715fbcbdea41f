"""The block formats' table and the QuantTensor view that every kernel consumes.

FORMATS maps each QuantType to its class (layout, quantize_blocks, dequantize_blocks) in
one module per family: floats (F32, F16, BF16), legacy (GGML's 32-element blocks), kquants
(GGML's 256-element super-blocks), iquants (GGML's non-linear IQ4 formats), gridquants
(GGML's 1-3 bit grid formats, IQ1_S to IQ3_S), lowbit (edgerun's own G64 formats). A new
format is an enum member and a row here plus its class; its kernels are one row of
ops/traits.py.

A QuantTensor never owns a float copy of a quantized matrix: `data` is a
uint8 view of the raw blocks (usually over an mmap), one row per output row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from edgerun.quant import floats, gridquants, iquants, kquants, legacy, lowbit
from edgerun.quant.block import BlockFormat


class QuantType(IntEnum):
    """GGML type ids (the numbers GGUF stores)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    BF16 = 30
    # edgerun's own low-bit formats (not GGML ids): see edgerun.quant.lowbit
    Q3_G64 = 200
    Q2_G64 = 201


# the one table of formats: QuantType -> its class
FORMATS: dict[QuantType, type[BlockFormat]] = {
    QuantType.F32: floats.F32,
    QuantType.F16: floats.F16,
    QuantType.BF16: floats.BF16,
    QuantType.Q8_0: legacy.Q8_0,
    QuantType.Q4_0: legacy.Q4_0,
    QuantType.Q4_1: legacy.Q4_1,
    QuantType.Q5_0: legacy.Q5_0,
    QuantType.Q5_1: legacy.Q5_1,
    QuantType.Q2_K: kquants.Q2_K,
    QuantType.Q3_K: kquants.Q3_K,
    QuantType.Q4_K: kquants.Q4_K,
    QuantType.Q5_K: kquants.Q5_K,
    QuantType.Q6_K: kquants.Q6_K,
    QuantType.IQ4_NL: iquants.IQ4_NL,
    QuantType.IQ4_XS: iquants.IQ4_XS,
    QuantType.IQ2_XXS: gridquants.IQ2_XXS,
    QuantType.IQ2_XS: gridquants.IQ2_XS,
    QuantType.IQ2_S: gridquants.IQ2_S,
    QuantType.IQ3_XXS: gridquants.IQ3_XXS,
    QuantType.IQ3_S: gridquants.IQ3_S,
    QuantType.IQ1_S: gridquants.IQ1_S,
    QuantType.Q3_G64: lowbit.Q3_G64,
    QuantType.Q2_G64: lowbit.Q2_G64,
}

# elements per block, bytes per block
BLOCK_LAYOUT: dict[QuantType, tuple[int, int]] = {
    q: (f.block_size, f.type_size) for q, f in FORMATS.items()
}


def row_bytes(qtype: QuantType, cols: int) -> int:
    """Bytes one row of `cols` elements takes in `qtype`."""
    elems, nbytes = BLOCK_LAYOUT[qtype]
    if cols % elems:
        raise ValueError(
            f"{qtype.name} needs a row length that is a multiple of {elems}, got {cols}"
        )
    return cols // elems * nbytes


@dataclass(frozen=True)
class QuantTensor:
    """A weight matrix in a block format.

    shape is (rows, cols) in math order: y = W @ x has len(y) == rows and
    len(x) == cols. data is uint8 [rows, row_bytes(qtype, cols)]. 1-D tensors
    have rows == 1. interleaved: the same blocks 16 rows at a time in the decode kernels'
    layout (ops/int8/rows16.interleave), or None: decode then reads data.
    """

    name: str
    qtype: QuantType
    shape: tuple[int, int]
    data: np.ndarray
    interleaved: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Weights are never written through a tensor, and one read-only array type keeps
        # each Numba kernel at one signature per format: a mapped file's rows are
        # read-only, a copy's are writable, and the mix on a held row (dense offloading)
        # would load a kernel variant on the first token, after the warm-up.
        d = self.data
        if isinstance(d, np.ndarray) and d.flags.writeable:
            d = d.view()
            d.flags.writeable = False
            object.__setattr__(self, "data", d)

    @property
    def rows(self) -> int:
        return self.shape[0]

    @property
    def cols(self) -> int:
        return self.shape[1]

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def bits_per_weight(self) -> float:
        elems, nbytes = BLOCK_LAYOUT[self.qtype]
        return 8.0 * nbytes / elems

    def stacked(self, n: int) -> list[QuantTensor]:
        """This matrix's rows as n equal matrices, one after another (a 3-D tensor
        [n, rows, cols] read as 2-D [n * rows, cols]: a mixture of experts' experts), each a
        view of its rows named '<name>[<index>]'."""
        if n < 1 or self.rows % n:
            raise ValueError(f"{self.name}: {self.rows} rows do not split into {n} matrices")
        rows = self.rows // n
        return [
            QuantTensor(
                f"{self.name}[{e}]",
                self.qtype,
                (rows, self.cols),
                self.data[e * rows : (e + 1) * rows],
            )
            for e in range(n)
        ]
