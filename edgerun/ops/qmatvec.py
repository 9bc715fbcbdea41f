"""Quantized matrix-vector / matrix-matrix products on raw GGUF blocks.

Public API (the model code calls only these):

- `matvec(w, x, out=None)`        y[rows] = W @ x              (decode)
- `matmul(w, x, out=None)`        Y[n, rows] = X[n, cols] @ W.T (prefill)
- `embedding_rows(w, ids)`        float32 [len(ids), cols] rows of W, dequantized
- `matvec_reference`, `matmul_reference`: numpy references (dequantize + float64 matmul)

The kernels never build a float copy of the matrix: each output row is computed
from the row's blocks. The number of threads is whatever the caller set with
`numba.set_num_threads`.
"""

from __future__ import annotations

from edgerun import _numba_env

_numba_env.configure()

import numpy as np  # noqa: E402

from edgerun.errors import InvalidArgumentError  # noqa: E402
from edgerun.ops import qmatvec_portable as _p  # noqa: E402
from edgerun.quant.formats import QuantTensor, QuantType, row_bytes  # noqa: E402
from edgerun.quant.reference import dequantize  # noqa: E402

__all__ = [
    "available_paths",
    "embedding_rows",
    "kernel_path",
    "set_kernel_path",
    "matmul",
    "matmul_reference",
    "matvec",
    "matvec_reference",
    "quantize_x_reference",
    "quantizes_activations",
]

_MM_ROW_BLOCK = 16

# ----------------------------------------------------------------- kernel path selection
PATHS = ("portable",)
_path = "portable"


def available_paths() -> tuple[str, ...]:
    """Kernel paths this CPU can run: always "portable", plus "vnni" on AVX-512 VNNI."""
    return PATHS


def kernel_path() -> str:
    """The kernel path in use."""
    return _path


def set_kernel_path(path: str = "auto") -> str:
    """Select "portable", "vnni" or "auto" (the fastest this CPU supports); returns the choice."""
    global _path
    if path == "auto":
        path = PATHS[-1]
    if path not in PATHS:
        raise InvalidArgumentError(
            f"kernel path {path!r} is not available on this CPU; choose one of {PATHS} or 'auto'"
        )
    _path = path
    return _path


def _raw(w: QuantTensor) -> np.ndarray:
    rows, cols = w.shape
    data = w.data
    if data.dtype != np.uint8:
        data = data.view(np.uint8)
    nbytes = row_bytes(w.qtype, cols)
    if data.ndim != 2 or data.shape != (rows, nbytes):
        data = data.reshape(rows, nbytes)
    if not data.flags.c_contiguous:
        data = np.ascontiguousarray(data)
    return data


def _vec(x: np.ndarray, cols: int, name: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != (cols,):
        raise InvalidArgumentError(f"matvec of {name}: x has shape {x.shape}, expected ({cols},)")
    return x


def _out(out: np.ndarray | None, shape: tuple[int, ...], name: str) -> np.ndarray:
    if out is None:
        return np.empty(shape, np.float32)
    if out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise InvalidArgumentError(
            f"{name}: out must be a C-contiguous float32 array of shape {shape}, "
            f"got {out.dtype} {out.shape}"
        )
    return out


def quantizes_activations(qtype: QuantType) -> bool:
    """Whether the current path quantizes x to int8 blocks for this weight format."""
    return _path != "portable" and qtype in _INT8_FORMATS


_INT8_FORMATS: frozenset[QuantType] = frozenset()


def quantize_x_reference(x: np.ndarray) -> np.ndarray:
    """What the int8 paths compute with instead of x: x rounded to Q8 blocks of 32.

    Per block: d = max|x| / 127, q = rint(x * (1/d)), returns q * d (float32). The last
    axis must be a multiple of 32.
    """
    x = np.asarray(x, dtype=np.float32)
    b = x.reshape(*x.shape[:-1], -1, 32)
    d = np.abs(b).max(axis=-1, keepdims=True) / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0.0), np.float32(1.0) / d).astype(np.float32)
    q = np.rint(b * inv)
    return (q * d).astype(np.float32).reshape(x.shape)


def matvec(w: QuantTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """y = W @ x for a quantized W [rows, cols] and float32 x [cols] -> float32 [rows]."""
    rows, cols = w.shape
    x = _vec(x, cols, w.name)
    out = _out(out, (rows,), w.name)
    data = _raw(w)
    q = w.qtype
    if q == QuantType.Q4_1:
        _p.mv_q4_1(data, x, out)
    elif q == QuantType.Q8_0:
        _p.mv_q8_0(data, x, out)
    elif q == QuantType.Q4_K:
        _p.mv_q4_k(data, x, out)
    elif q == QuantType.Q6_K:
        _p.mv_q6_k(data, x, out)
    elif q == QuantType.Q5_0:
        _p.mv_q5_0(data, x, out)
    elif q == QuantType.Q4_0:
        _p.mv_q4_0(data, x, out)
    elif q == QuantType.F32:
        _p.mv_f32(data.view(np.float32), x, out)
    elif q == QuantType.F16:
        _p.mv_f16(data.view(np.uint16), x, out, False)
    elif q == QuantType.BF16:
        _p.mv_f16(data.view(np.uint16), x, out, True)
    else:  # pragma: no cover - QuantType has no other members
        raise InvalidArgumentError(f"matvec: unsupported format {q!r}")
    return out


def matmul(w: QuantTensor, x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Y = X @ W.T for float32 X [n, cols] -> float32 [n, rows] (prefill)."""
    rows, cols = w.shape
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] != cols:
        raise InvalidArgumentError(
            f"matmul of {w.name}: x has shape {x.shape}, expected (n, {cols})"
        )
    n = x.shape[0]
    out = _out(out, (n, rows), w.name)
    if n == 0 or rows == 0:
        return out
    if n == 1:
        matvec(w, x[0], out[0])
        return out
    _p.mm_kernel(_p.KIND_OF[w.qtype], _raw(w), x, out, _MM_ROW_BLOCK)
    return out


def embedding_rows(w: QuantTensor, ids: np.ndarray) -> np.ndarray:
    """Rows `ids` of W dequantized: float32 [len(ids), cols]; bit-exact with the reference."""
    rows, cols = w.shape
    ids = np.ascontiguousarray(ids, dtype=np.int64).reshape(-1)
    if ids.size and (ids.min() < 0 or ids.max() >= rows):
        raise InvalidArgumentError(
            f"embedding_rows of {w.name}: ids must be in [0, {rows}), got "
            f"[{int(ids.min())}, {int(ids.max())}]"
        )
    out = np.empty((ids.shape[0], cols), np.float32)
    if ids.size:
        _p.embedding_rows_kernel(_p.KIND_OF[w.qtype], _raw(w), ids, out)
    return out


def matvec_reference(w: QuantTensor, x: np.ndarray) -> np.ndarray:
    """numpy reference: dequantize the whole matrix, float64 product -> float32 [rows]."""
    wf = dequantize(w.qtype, _raw(w)).astype(np.float64)
    return (wf @ np.asarray(x, dtype=np.float64)).astype(np.float32)


def matmul_reference(w: QuantTensor, x: np.ndarray) -> np.ndarray:
    """numpy reference: dequantize the whole matrix, float64 product -> float32 [n, rows]."""
    wf = dequantize(w.qtype, _raw(w)).astype(np.float64)
    return (np.asarray(x, dtype=np.float64) @ wf.T).astype(np.float32)
