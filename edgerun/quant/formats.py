"""GGML block formats and the QuantTensor view that every kernel consumes.

A QuantTensor never owns a float copy of a quantized matrix: `data` is a
uint8 view of the raw blocks (usually over an mmap), one row per output row.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class QuantType(IntEnum):
    """GGML type ids (the numbers GGUF stores)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14
    BF16 = 30
    # edgerun's own low-bit formats (not GGML ids): see edgerun.quant.lowbit
    Q3_G64 = 200
    Q2_G64 = 201


# elements per block, bytes per block
BLOCK_LAYOUT: dict[QuantType, tuple[int, int]] = {
    QuantType.F32: (1, 4),
    QuantType.F16: (1, 2),
    QuantType.BF16: (1, 2),
    QuantType.Q8_0: (32, 34),
    QuantType.Q4_0: (32, 18),
    QuantType.Q4_1: (32, 20),
    QuantType.Q5_0: (32, 22),
    QuantType.Q4_K: (256, 144),
    QuantType.Q6_K: (256, 210),
    QuantType.Q3_G64: (64, 28),
    QuantType.Q2_G64: (64, 20),
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
    layout (ops/qmatvec_rows16.interleave), or None: decode then reads data.
    """

    name: str
    qtype: QuantType
    shape: tuple[int, int]
    data: np.ndarray
    interleaved: np.ndarray | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Weights are never written through a tensor, and one read-only array type keeps
        # each Numba kernel at one signature per format: a mapped file's rows are
        # read-only, a copy's were writable, and the mix on a held row (dense offloading)
        # loaded a kernel variant on the first token, after the warm-up.
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
