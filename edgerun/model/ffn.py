"""FFN executors: the seam between model code and where the FFN weights live.

Each layer's FFN is an object the model calls with the normed hidden state
``x [n, d_model] -> [n, d_model]``. The resident executor here is the dense
gated FFN on weights in memory. Other placements (sparse rows from a flash
neuron cache, hot neurons on a torch device) are other executors returned by
their WeightStore; the model code never changes when weights move.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edgerun.errors import ModelFormatError
from edgerun.ops import qmatvec
from edgerun.ops.activations import glu
from edgerun.quant.formats import QuantTensor

__all__ = ["FFNExecutor", "DenseFFN", "check_shapes", "decode_rows"]


class FFNExecutor(Protocol):
    """What the model needs of a layer's FFN."""

    d_model: int
    d_ff: int

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x float32 [n, d_model] -> float32 [n, d_model]."""
        ...


def decode_rows(ffn: FFNExecutor, x: np.ndarray) -> np.ndarray:
    """The FFN of several sequences' decode rows x [n, d_model], each row as a one-token
    call would compute it (batched decode must not change a sequence's tokens). An
    executor with a `decode_batch` method shares its weight reads across the rows; others
    run row by row."""
    batch = getattr(ffn, "decode_batch", None)
    if batch is not None:
        return batch(x)
    return np.concatenate([ffn(x[i : i + 1]) for i in range(x.shape[0])], axis=0)


def check_shapes(tensors, source: str) -> None:
    """(QuantTensor, expected shape) pairs: a ModelFormatError naming the first mismatch."""
    for t, shape in tensors:
        if t.shape != shape:
            raise ModelFormatError(
                f"{source}: tensor '{t.name}' has shape {t.shape}, expected {shape}"
            )


class DenseFFN:
    """down(act(gate x) * up x) on three resident quantized matrices."""

    __slots__ = ("gate", "up", "down", "activation", "d_model", "d_ff")

    def __init__(
        self,
        gate: QuantTensor,
        up: QuantTensor,
        down: QuantTensor,
        activation: str,
        expected: tuple[int, int] | None = None,
        source: str = "model",
    ) -> None:
        d_ff, d_model = expected if expected is not None else gate.shape
        check_shapes(
            ((gate, (d_ff, d_model)), (up, (d_ff, d_model)), (down, (d_model, d_ff))), source
        )
        self.gate, self.up, self.down = gate, up, down
        self.activation = activation
        self.d_model, self.d_ff = d_model, d_ff

    def __call__(self, x: np.ndarray) -> np.ndarray:
        gate, up = qmatvec.project_many((self.gate, self.up), x)
        return qmatvec.project(self.down, glu(gate, up, self.activation))

    def decode_batch(self, x: np.ndarray) -> np.ndarray:
        """Rows of different sequences' decode steps: weights read once, each row equal to
        the one-token result (qmatvec.matvec_batch)."""
        gate, up = qmatvec.matvec_batch_many((self.gate, self.up), x)
        return qmatvec.matvec_batch(self.down, glu(gate, up, self.activation))
