"""Stand-in weights for a compile child: the model's tensor table with zero pages for data.

A kernel compile needs its arguments' Numba types (dtype, dimensions, layout, read-only),
never their values. A first run's compile child (offload/warm_kernels.py) that loaded the
model as the serving process does would read every weight of the mapped file and build
its own interleaved decode copies (Qwen2.5-Coder-1.5B: 1.1 GB of anonymous memory a
child, the process tree at 2.8x a warm run's RSS). Here a child reads the same file's
metadata and tensor table, but each matrix's rows are a private anonymous mapping that is
never written: reading it maps the kernel's shared zero page, which no process's RSS
counts. The matrices keep their shapes, formats and array types, so the child builds the
same Transformer, runs the same warm-up through the same code, and caches the very kernel
signatures the serving process then loads; what they compute on zeros is thrown away.

StandInFile wraps the GGUF reader (1-D tensors, the norms and biases whose values the
load checks, stay the file's: a few KB). stand_in_interleave stands for
qmatvec.interleave: it makes the real copy of a matrix's first ROWS rows (compiling the
copy kernel for that format, with the same argument types) and gives the matrix a
zero-page copy of the full copy's shape.
"""

from __future__ import annotations

import dataclasses
import mmap
from typing import Any

import numpy as np

from edgerun.ops import qmatvec
from edgerun.quant.formats import QuantTensor

__all__ = ["ROWS", "StandInFile", "stand_in_interleave", "zero_pages"]

ROWS = 16  # rows of the real interleaved copy that compiles its kernel (one group)
# The real copier: a child that loads stand-ins puts stand_in_interleave in its place
_interleave = qmatvec.interleave


def zero_pages(shape: tuple[int, ...]) -> np.ndarray:
    """A read-only uint8 array of `shape` over a private anonymous mapping: zeros that
    cost no resident memory while only read (the kernel maps its zero page)."""
    n = int(np.prod(shape, dtype=np.int64))
    if n == 0:
        return np.zeros(shape, np.uint8)
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    a = np.frombuffer(buf, np.uint8).reshape(shape)
    a.flags.writeable = False
    return a


class StandInFile:
    """A GGUF reader (formats/gguf.GGUFFile) whose matrices read as zero pages: metadata,
    tensor table and 1-D tensors are the file's; everything else it delegates."""

    def __init__(self, file: Any) -> None:
        self._file = file
        self._tensors: dict[str, QuantTensor] = {}

    def __getattr__(self, name: str) -> Any:  # metadata, infos, file_size, paths, ...
        return getattr(self._file, name)

    def tensor(self, name: str) -> QuantTensor:
        t = self._tensors.get(name)
        if t is None:
            t = self._file.tensor(name)  # a view: checks the entry, reads no page
            if t.rows > 1:
                t = QuantTensor(t.name, t.qtype, t.shape, zero_pages(t.data.shape))
            self._tensors[name] = t
        return t

    def tensor_names(self) -> list[str]:
        return self._file.tensor_names()

    def expert_matrices(
        self, name: str, n_expert: int, shape: tuple[int, int]
    ) -> list[QuantTensor]:
        """As GGUFFile.expert_matrices (which checks the shape) over the stand-in rows."""
        self._file.expert_matrices(name, n_expert, shape)
        return self.tensor(name).stacked(n_expert)

    def release_pages(self, name: str) -> int:
        """Nothing to let go (zero pages are not resident); present so that a load takes
        the same path as on the file (api.Model: a reader that can release pages)."""
        return 0


def stand_in_interleave(w: QuantTensor) -> QuantTensor:
    """qmatvec.interleave for stand-in weights: w with a zero-page interleaved copy of the
    real copy's shape, after making the real copy of its first ROWS rows (the copy kernel
    compiles for w's format with the arguments it takes on the full matrix)."""
    full = qmatvec.copy_bytes(w)
    if full == 0:
        return _interleave(w)  # no copy here: w itself
    rows = min(ROWS, w.rows)
    head = _interleave(QuantTensor(w.name, w.qtype, (rows, w.cols), w.data[:rows]))
    row_bytes = head.interleaved.shape[1]
    if full % row_bytes:
        raise AssertionError(f"{w.name}: a copy of {full} bytes is not rows of {row_bytes}")
    return dataclasses.replace(w, interleaved=zero_pages((full // row_bytes, row_bytes)))
