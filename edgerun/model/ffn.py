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

__all__ = ["FFNExecutor", "DenseFFN", "check_shapes", "decode_rows", "gaussian_topk"]


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


def gaussian_topk(g: np.ndarray, std_above: float) -> np.ndarray:
    """Gemma 3n's activation sparsity of gate rows g [n, d_ff]: relu(g - cutoff) with the
    cutoff each row's mean plus std_above of its standard deviations (the population's,
    as transformers' _gaussian_topk; a normal's quantile keeps the top share of a row)."""
    g64 = g.astype(np.float64)
    mean = g64.mean(axis=-1, keepdims=True)
    std = np.sqrt(np.mean((g64 - mean) ** 2, axis=-1, keepdims=True))
    return np.maximum(g64 - (mean + std * std_above), 0.0).astype(np.float32)


class DenseFFN:
    """down(act(gate x) * up x) on three resident quantized matrices; sparsity (not None,
    Gemma 3n): the gate rows first through gaussian_topk with that many deviations."""

    __slots__ = ("gate", "up", "down", "activation", "d_model", "d_ff", "sparsity")

    def __init__(
        self,
        gate: QuantTensor,
        up: QuantTensor,
        down: QuantTensor,
        activation: str,
        expected: tuple[int, int] | None = None,
        source: str = "model",
        sparsity: float | None = None,
    ) -> None:
        self.sparsity = sparsity
        d_ff, d_model = expected if expected is not None else gate.shape
        check_shapes(
            ((gate, (d_ff, d_model)), (up, (d_ff, d_model)), (down, (d_model, d_ff))), source
        )
        self.gate, self.up, self.down = gate, up, down
        self.activation = activation
        self.d_model, self.d_ff = d_model, d_ff

    def __call__(self, x: np.ndarray) -> np.ndarray:
        gate, up = qmatvec.project_many((self.gate, self.up), x)
        if self.sparsity is not None:
            gate = gaussian_topk(gate, self.sparsity)
        return qmatvec.project(self.down, glu(gate, up, self.activation))

    def decode_batch(self, x: np.ndarray) -> np.ndarray:
        """Rows of different sequences' decode steps: weights read once, each row equal to
        the one-token result (qmatvec.matvec_batch)."""
        gate, up = qmatvec.matvec_batch_many((self.gate, self.up), x)
        if self.sparsity is not None:
            gate = gaussian_topk(gate, self.sparsity)
        return qmatvec.matvec_batch(self.down, glu(gate, up, self.activation))
