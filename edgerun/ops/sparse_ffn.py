"""Kernels of the sparse FFN: only the neurons a token needs.

An FFN is down(act(gate x) * up x); neuron i is gate row i, up row i and down column i.
With a neuron subset S the result is sum_{i in S} h_i * down[:, i], h = act(g_S) * u_S.
The flash layout keeps down transposed and requantized to Q8_0 (one row of d_model per
neuron), so the down projection becomes an accumulation of Q8_0 rows.

- `matvec_rows(qtype, cols, data, idx, x, out, offset)`: y[k] = row(idx[k]) . x, where
  the rows are byte ranges [idx[k] * stride + offset, + row_bytes) of a uint8 matrix.
  Reads the gate rows of the active neurons straight out of a resident gate matrix, and
  up rows straight out of bundle records [up | down] (offset 0), with no gather copy.
  On an int8 path it reuses the row functions of `ops/int8`; elsewhere it gathers the
  rows (one numpy take) and calls `qmatvec.matvec`.
- `accumulate_q8_0_rows(rows, coeff, out, idx, offset)`: out += sum_k coeff_k *
  dequant(row idx[k]) for Q8_0 rows of d_model (the down part of bundle records at byte
  `offset`, or a contiguous down matrix with offset 0). Parallel over output column
  chunks, so no reduction between threads.
- `accumulate_q8_0_rows_many`: the same for several tokens (coeff [T, n], out [T, d]).
- The activation of the subset is `edgerun.ops.activations.glu` on [1, n] arrays.

All kernels are `nogil` so reader threads can fill the neuron cache meanwhile.
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from edgerun.errors import InvalidArgumentError  # noqa: E402
from edgerun.ops import qmatvec  # noqa: E402
from edgerun.ops._simd import h2f, stack16  # noqa: E402
from edgerun.ops.traits import TRAITS  # noqa: E402
from edgerun.quant.formats import QuantTensor, QuantType, row_bytes  # noqa: E402
from edgerun.quant.reference import dequantize  # noqa: E402

__all__ = [
    "Q8_0_BLOCK",
    "accumulate_q8_0_rows",
    "accumulate_q8_0_rows_many",
    "accumulate_q8_0_rows_reference",
    "matvec_rows",
    "matvec_rows_reference",
    "sparse_ffn_reference",
]

Q8_0_BLOCK = 34  # bytes of one Q8_0 block: f16 scale + 32 int8
F0 = np.float32(0.0)

# the int8 row kernels exist where qmatvec has an int8 path (int8.DOT)
_HAS_INT8 = any(p in qmatvec.INT8_PATHS for p in qmatvec.available_paths())

if _HAS_INT8:
    from edgerun.ops import int8 as _v
    from edgerun.ops.int8.blocks import row_layout as _row_layout

    @njit(cache=True, nogil=True, parallel=True)
    def _mv_rows_vnni(kind, sb8, nib2, nunit, flat, stride, offset, idx, x, out):
        """kind: the format's int8 kind (its traits row's gemm_kind); sb8: its
        sb8_decode (mv_q4_k's / mv_q6_k's single-level int8 activations)."""
        cols = x.shape[0]
        if sb8:
            xb, xsb, xp, bs = _v.x_k8(kind, x)
            for k in prange(idx.shape[0]):
                base = np.int64(idx[k]) * stride + offset
                if kind == _v.KIND_Q4_K:
                    out[k] = _v._row_k8(_v.KIND_Q4_K, flat, base, nunit, xb, xsb, xp, bs)
                else:
                    out[k] = _v._row_k8(_v.KIND_Q6_K, flat, base, nunit, xb, xsb, xp, bs)
            return
        xq, xds, xs16 = _v._scratch(cols)
        span = _v.x1_span(_v.KIND_Q5_0) if kind == _v.KIND_Q5_0 else 0
        _v.quantize_xn(x, span, nib2, xq, xds, xs16)
        for k in prange(idx.shape[0]):
            base = np.int64(idx[k]) * stride + offset
            if kind == _v.KIND_Q8_0:
                out[k] = _v._row_q8_0(flat, base, nunit, xq, xds, xs16)
            elif kind == _v.KIND_Q4_1:
                out[k] = _v._row_q4_1(flat, base, nunit, xq, xds, xs16)
            elif kind == _v.KIND_Q4_0:
                out[k] = _v._row_q4_0(flat, base, nunit, xq, xds, xs16)
            else:
                out[k] = _v._row_q5_0(flat, base, nunit, xq, xds, xs16)


def _check_rows(data: np.ndarray, need: int, offset: int, what: str) -> np.ndarray:
    if data.dtype != np.uint8 or data.ndim != 2 or not data.flags.c_contiguous:
        raise InvalidArgumentError(f"{what}: rows must be a C-contiguous uint8 matrix")
    if offset < 0 or offset + need > data.shape[1]:
        raise InvalidArgumentError(
            f"{what}: bytes [{offset}, {offset + need}) do not fit in rows of {data.shape[1]}"
        )
    return data


def _check_idx(idx: np.ndarray | None, nrows: int, what: str) -> np.ndarray:
    if idx is None:
        return np.arange(nrows, dtype=np.int32)
    idx = np.ascontiguousarray(idx, dtype=np.int32).reshape(-1)
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= nrows):
        raise InvalidArgumentError(f"{what}: row indices must be in [0, {nrows})")
    return idx


def matvec_rows(
    qtype: QuantType,
    cols: int,
    data: np.ndarray,
    idx: np.ndarray | None,
    x: np.ndarray,
    out: np.ndarray | None = None,
    offset: int = 0,
) -> np.ndarray:
    """y[k] = W_row(idx[k]) . x for rows stored at byte `offset` of each row of `data`.

    data: C-contiguous uint8 [R, stride] (a resident matrix, or neuron records whose first
    part is the row); idx: int32 row indices (None: all rows). Same numbers as
    `qmatvec.matvec` on the gathered rows.
    """
    rb = row_bytes(qtype, cols)
    _check_rows(data, rb, offset, "matvec_rows")
    idx = _check_idx(idx, data.shape[0], "matvec_rows")
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.shape != (cols,):
        raise InvalidArgumentError(f"matvec_rows: x has shape {x.shape}, expected ({cols},)")
    n = idx.shape[0]
    if out is None:
        out = np.empty(n, np.float32)
    elif out.shape != (n,) or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise InvalidArgumentError(f"matvec_rows: out must be C-contiguous float32 [{n}]")
    if n == 0:
        return out
    t = TRAITS.get(qtype)
    if _HAS_INT8 and t is not None and t.sparse_rows and qmatvec.quantizes_activations(qtype):
        kind = t.gemm_kind
        unit, nib2 = _row_layout.py_func(kind)
        flat = data.reshape(-1)
        sb8 = t.sb8_decode
        _mv_rows_vnni(kind, sb8, nib2, cols // unit, flat, data.shape[1], offset, idx, x, out)
        return out
    sub = data[idx, offset : offset + rb] if (offset or rb != data.shape[1]) else data[idx]
    qmatvec.matvec(QuantTensor("rows", qtype, (n, cols), np.ascontiguousarray(sub)), x, out)
    return out


def matvec_rows_reference(
    qtype: QuantType, cols: int, data: np.ndarray, idx: np.ndarray, x: np.ndarray, offset: int = 0
) -> np.ndarray:
    """numpy reference of `matvec_rows` (dequantize the selected rows, float64 product)."""
    rb = row_bytes(qtype, cols)
    w = dequantize(qtype, np.ascontiguousarray(data[np.asarray(idx), offset : offset + rb]))
    return (w.reshape(len(idx), cols).astype(np.float64) @ x.astype(np.float64)).astype(np.float32)


# ------------------------------------------------------------------ Q8_0 row accumulation
@njit(inline="always")
def _f16(flat, i):
    return h2f(np.uint16(flat[i]) | (np.uint16(flat[i + 1]) << np.uint16(8)))


@njit(inline="always")
def _acc_chunk(flat, sflat, stride, offset, idx, coeff, out, b0, b1):
    """out[b0*32 : b1*32] += sum_k coeff[k] * row(idx[k]) over blocks b0..b1.

    The sums go through a 16-float stack tile: with loads from `out` and the rows and the
    stores to a stack slot LLVM knows nothing aliases, so the SLP vectorizer packs them
    (direct `out[j] += s * q[j]` stays 32 scalar FMAs: 4x slower).
    """
    t = numba.carray(stack16(), 16)
    for k in range(idx.shape[0]):
        c = coeff[k]
        if c == F0:
            continue
        base = np.int64(idx[k]) * stride + offset
        for b in range(b0, b1):
            p = base + b * 34
            s = c * _f16(flat, p)
            for h in range(2):
                o = out[b * 32 + 16 * h : b * 32 + 16 * h + 16]
                q = sflat[p + 2 + 16 * h : p + 18 + 16 * h]
                for j in range(16):
                    t[j] = o[j] + s * np.float32(q[j])
                for j in range(16):
                    o[j] = t[j]


@njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _acc_q8_0(flat, sflat, stride, offset, idx, coeff, out, nchunk):
    nb = out.shape[0] // 32
    for t in prange(nchunk):
        b0 = t * nb // nchunk
        b1 = (t + 1) * nb // nchunk
        _acc_chunk(flat, sflat, stride, offset, idx, coeff, out, b0, b1)


@njit(cache=True, nogil=True, fastmath=True)
def _acc_q8_0_serial(flat, sflat, stride, offset, idx, coeff, out):
    _acc_chunk(flat, sflat, stride, offset, idx, coeff, out, 0, out.shape[0] // 32)


@njit(cache=True, nogil=True, fastmath=True, parallel=True)
def _acc_q8_0_many(flat, sflat, stride, offset, idx, coeff, out, nchunk):
    nb = out.shape[1] // 32
    for u in prange(nchunk * out.shape[0]):
        tok = u // nchunk
        t = u % nchunk
        b0 = t * nb // nchunk
        b1 = (t + 1) * nb // nchunk
        _acc_chunk(flat, sflat, stride, offset, idx, coeff[tok], out[tok], b0, b1)


# below this many bytes of rows one thread is faster than waking the pool (~3 us)
PARALLEL_MIN_BYTES = 1 << 16


def _acc_args(rows, coeff, out, idx, offset, what):
    if out.dtype != np.float32 or not out.flags.c_contiguous or out.shape[-1] % 32:
        raise InvalidArgumentError(f"{what}: out must be C-contiguous float32, d % 32 == 0")
    d = out.shape[-1]
    _check_rows(rows, d // 32 * Q8_0_BLOCK, offset, what)
    idx = _check_idx(idx, rows.shape[0], what)
    coeff = np.ascontiguousarray(coeff, dtype=np.float32)
    if coeff.shape[-1] != idx.shape[0]:
        raise InvalidArgumentError(
            f"{what}: {coeff.shape[-1]} coefficients for {idx.shape[0]} rows"
        )
    flat = rows.reshape(-1)
    return flat, flat.view(np.int8), idx, coeff


def accumulate_q8_0_rows(
    rows: np.ndarray,
    coeff: np.ndarray,
    out: np.ndarray,
    idx: np.ndarray | None = None,
    offset: int = 0,
) -> np.ndarray:
    """out [d] += sum_k coeff[k] * dequant(Q8_0 row idx[k]) (the down projection).

    rows: C-contiguous uint8 [R, stride]; row k's d/32 Q8_0 blocks start at byte
    `offset` (0 for a down matrix, up_row_bytes inside [up | down] bundle records).
    idx: int32 [n] (None: rows 0..n-1 with n = len(coeff)); zero coefficients are skipped.
    """
    if idx is None:
        idx = np.arange(len(coeff), dtype=np.int32)
    flat, sflat, idx, coeff = _acc_args(rows, coeff, out, idx, offset, "accumulate_q8_0_rows")
    if idx.shape[0] == 0:
        return out
    nth = numba.get_num_threads()
    if nth == 1 or idx.shape[0] * out.shape[0] < PARALLEL_MIN_BYTES:
        _acc_q8_0_serial(flat, sflat, rows.shape[1], offset, idx, coeff, out)
    else:
        _acc_q8_0(flat, sflat, rows.shape[1], offset, idx, coeff, out, min(nth, out.shape[0] // 32))
    return out


def accumulate_q8_0_rows_many(
    rows: np.ndarray,
    coeff: np.ndarray,
    out: np.ndarray,
    idx: np.ndarray | None = None,
    offset: int = 0,
) -> np.ndarray:
    """out [T, d] += coeff [T, n] @ dequant(rows idx) for T tokens sharing one row set
    (prefill over the union of the tokens' neurons; zeros mark a token's inactive ones)."""
    if idx is None:
        idx = np.arange(coeff.shape[-1], dtype=np.int32)
    flat, sflat, idx, coeff = _acc_args(rows, coeff, out, idx, offset, "accumulate_q8_0_rows_many")
    if coeff.ndim != 2 or out.ndim != 2 or coeff.shape[0] != out.shape[0]:
        raise InvalidArgumentError("accumulate_q8_0_rows_many: coeff [T, n] and out [T, d]")
    if idx.shape[0] == 0 or out.shape[0] == 0:
        return out
    nchunk = max(1, min(numba.get_num_threads(), out.shape[1] // 32))
    _acc_q8_0_many(flat, sflat, rows.shape[1], offset, idx, coeff, out, nchunk)
    return out


def accumulate_q8_0_rows_reference(
    rows: np.ndarray, coeff: np.ndarray, d: int, idx: np.ndarray | None = None, offset: int = 0
) -> np.ndarray:
    """numpy reference: sum_k coeff[k] * dequant(row idx[k]) in float64 -> float32 [d]."""
    idx = np.arange(len(coeff)) if idx is None else np.asarray(idx)
    sub = np.ascontiguousarray(rows[idx, offset : offset + d // 32 * Q8_0_BLOCK])
    w = dequantize(QuantType.Q8_0, sub).reshape(len(idx), d).astype(np.float64)
    return (np.asarray(coeff, np.float64) @ w).astype(np.float32)


def sparse_ffn_reference(
    gate: np.ndarray, up: np.ndarray, down: np.ndarray, x: np.ndarray, idx: np.ndarray, act: str
) -> np.ndarray:
    """Float reference of the sparse FFN over neurons idx: gate, up [d_ff, d], down [d, d_ff]."""
    from edgerun.ops.activations import glu_reference

    g = gate[idx].astype(np.float64) @ x
    u = up[idx].astype(np.float64) @ x
    h = glu_reference(g, u, act).astype(np.float64)
    return (down[:, idx].astype(np.float64) @ h).astype(np.float32)
