"""WeightStore: the only way model code reaches weights.

Offloading (flash) and GPU hand-off become other stores that return other FFN
executors from `ffn()`; model.py stays unchanged. ResidentStore keeps everything
where the file reader put it (for GGUF: views over one mmap, so "resident" costs
page cache, not copies).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import ModelFormatError
from edgerun.ffn import DenseFFN, FFNExecutor
from edgerun.quant.formats import QuantTensor, QuantType


class WeightStore(Protocol):
    def has(self, name: str) -> bool: ...

    def matrix(self, name: str) -> QuantTensor:
        """A 2-D weight in its block format, for the matvec/matmul kernels."""
        ...

    def vector(self, name: str) -> np.ndarray:
        """A small 1-D weight (norm gains, biases) as float32."""
        ...

    def ffn(self, spec: ModelSpec, layer: int) -> FFNExecutor:
        """The executor that computes layer `layer`'s FFN wherever its weights live."""
        ...

    def resident_bytes(self) -> int: ...


class ResidentStore:
    """All tensors held by a reader exposing `tensor(name)` and `tensor_names()`."""

    def __init__(self, reader, source: str) -> None:
        self._reader = reader
        self._names = set(reader.tensor_names())
        self._source = source
        self._matrices: dict[str, QuantTensor] = {}
        self._vectors: dict[str, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return name in self._names

    def matrix(self, name: str) -> QuantTensor:
        t = self._matrices.get(name)
        if t is None:
            t = self._reader.tensor(name)
            self._matrices[name] = t
        return t

    def vector(self, name: str) -> np.ndarray:
        v = self._vectors.get(name)
        if v is None:
            t = self._reader.tensor(name)
            if t.rows != 1:
                raise ModelFormatError(
                    f"{self._source}: tensor '{name}' should be 1-D, found shape {t.shape}"
                )
            if t.qtype == QuantType.F32:
                v = t.data.view(np.float32).reshape(-1).copy()
            elif t.qtype == QuantType.F16:
                v = t.data.view(np.float16).reshape(-1).astype(np.float32)
            elif t.qtype == QuantType.BF16:
                v = (t.data.view(np.uint16).reshape(-1).astype(np.uint32) << 16).view(np.float32)
            else:
                from edgerun.quant.reference import dequantize

                v = dequantize(t.qtype, t.data).reshape(-1)
            self._vectors[name] = v
        return v

    def ffn(self, spec: ModelSpec, layer: int) -> FFNExecutor:
        return DenseFFN(
            self.matrix(spec.layer_tensor("ffn_gate", layer)),
            self.matrix(spec.layer_tensor("ffn_up", layer)),
            self.matrix(spec.layer_tensor("ffn_down", layer)),
            spec.activation,
            expected=(spec.d_ff, spec.d_model),
            source=self._source,
        )

    def resident_bytes(self) -> int:
        return sum(t.nbytes for t in self._matrices.values()) + sum(
            v.nbytes for v in self._vectors.values()
        )
