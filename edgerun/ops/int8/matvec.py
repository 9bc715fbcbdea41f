"""Decode matvec kernels: mv_<fmt>(d0, d1, d2, x, o0, o1, o2), up to three matrices sharing
x (one x quantization, one parallel launch; 0-row arrays for unused slots), built from the
per-format row loops _row_<fmt>.
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numba  # noqa: E402
import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from edgerun.ops.int8.activations import (  # noqa: E402
    _hsum,
    _scratch,
    quantize_xn,
    x_k8,
)
from edgerun.ops.int8.blocks import (  # noqa: E402
    KIND_IQ4_NL,
    KIND_IQ4_XS,
    KIND_Q2_G64,
    KIND_Q2_K,
    KIND_Q3_G64,
    KIND_Q3_K,
    KIND_Q4_0,
    KIND_Q4_1,
    KIND_Q4_K,
    KIND_Q5_0,
    KIND_Q5_1,
    KIND_Q5_K,
    KIND_Q6_K,
    KIND_Q8_0,
    iq4_nl_pair,
    iq4_nl_single,
    iq4_xs_block,
    q2_g64_block,
    q2_k_block,
    q3_g64_block,
    q3_k_block,
    q4_0_pair,
    q4_0_single,
    q4_1_pair,
    q4_1_single,
    q4_k_block8,
    q5_0_pair,
    q5_0_single,
    q5_1_pair,
    q5_1_single,
    q5_k_block8,
    q6_k_block8,
    q8_0_pair,
    q8_0_single,
    row_layout,
    x1_span,
)
from edgerun.ops.int8.ir import (  # noqa: E402
    acc4,
    acc16,
)


# --------------------------------------------------------------------------- matvec
@njit(inline="always")
def _row_q4_1(row, base, nb, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for p in range(nb // 2):
        q4_1_pair(a16, a4, row, base + p * 40, xq, p * 128, xds, p * 4)
    if nb & 1:
        b = nb - 1
        q4_1_single(a16, a4, row, base + b * 20, xq, b * 64, xds, b * 2)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) + (s[1] + s[3])


@njit(inline="always")
def _row_q4_0(row, base, nb, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for p in range(nb // 2):
        q4_0_pair(a16, a4, row, base + p * 36, xq, p * 128, xds, p * 4)
    if nb & 1:
        b = nb - 1
        q4_0_single(a16, a4, row, base + b * 18, xq, b * 64, xds, b * 2)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) - np.float32(8.0) * (s[1] + s[3])


@njit(inline="always")
def _row_q5_0(row, base, nb, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for p in range(nb // 2):
        q5_0_pair(a16, a4, row, base + p * 44, xq, p * 64, xds, p * 4)
    if nb & 1:
        b = nb - 1
        q5_0_single(a16, a4, row, base + b * 22, xq, b * 32, xds, b * 2)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) - np.float32(16.0) * (s[1] + s[3])


@njit(inline="always")
def _row_q5_1(row, base, nb, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for p in range(nb // 2):
        q5_1_pair(a16, a4, row, base + p * 48, xq, p * 128, xds, p * 4)
    if nb & 1:
        b = nb - 1
        q5_1_single(a16, a4, row, base + b * 24, xq, b * 64, xds, b * 2)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) + (s[1] + s[3])


@njit(inline="always")
def _row_iq4_nl(row, base, nb, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for p in range(nb // 2):
        iq4_nl_pair(a16, a4, row, base + p * 36, xq, p * 128, xds, p * 4)
    if nb & 1:
        b = nb - 1
        iq4_nl_single(a16, a4, row, base + b * 18, xq, b * 64, xds, b * 2)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) - np.float32(128.0) * (s[1] + s[3])


@njit(inline="always")
def _row_q8_0(row, base, nb, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for p in range(nb // 2):
        q8_0_pair(a16, a4, row, base + p * 68, xq, p * 128, xds, p * 4)
    if nb & 1:
        b = nb - 1
        q8_0_single(a16, a4, row, base + b * 34, xq, b * 64, xds, b * 2)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) - np.float32(128.0) * (s[1] + s[3])


@njit(inline="always")
def _row_iq4_xs(row, base, nsb, xq, xds, xs16):
    a16 = acc16()
    am = acc16()
    for b in range(nsb):
        iq4_xs_block(a16, am, row, base + b * 136, xq, b * 512, xds, b * 16)
    return _hsum(a16, 16) - _hsum(am, 8)


@njit(inline="always")
def _row_q3_k(row, base, nsb, xq, xds, xs16):
    a16 = acc16()
    ab = acc16()
    for b in range(nsb):
        q3_k_block(a16, ab, row, base + b * 110, xq, b * 512, xds, b * 16, xs16, b * 16)
    return _hsum(a16, 16) - _hsum(ab, 4)


@njit(inline="always")
def _row_q2_k(row, base, nsb, xq, xds, xs16):
    a16 = acc16()
    ab = acc16()
    for b in range(nsb):
        q2_k_block(a16, ab, row, base + b * 84, xq, b * 512, xds, b * 16, xs16, b * 16)
    return _hsum(a16, 16) - _hsum(ab, 4)


@njit(inline="always")
def _k8_block(kind, a, m, row, off, xb, xo, xsb, xp, s, bs):
    """A K-quant super-block on quantize_x_sb8's activations (kind a literal)."""
    if kind == KIND_Q4_K:
        q4_k_block8(a, m, row, off, xb, xo, xsb, xp, s)
    elif kind == KIND_Q5_K:
        q5_k_block8(a, m, row, off, xb, xo, xsb, xp, s)
    else:
        q6_k_block8(a, m, row, off, xb, xo, xsb, xp, s, bs)


@njit(inline="always")
def _k8_bytes(kind):
    if kind == KIND_Q4_K:
        return 144
    return 176 if kind == KIND_Q5_K else 210


@njit(inline="always")
def _row_k8(kind, row, base, nsb, xb, xsb, xp, bs):
    """One row of a Q4_K, Q5_K or Q6_K matrix on quantize_x_sb8's activations."""
    a = acc16()
    m = acc16()
    nbytes = _k8_bytes(kind)
    for s in range(nsb):
        _k8_block(kind, a, m, row, base + s * nbytes, xb, s * 256, xsb, xp, s, bs)
    return _hsum(a, 8) - _hsum(m, 8)


@njit(inline="always")
def _row_q2_g64(row, base, nblk, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for b in range(nblk):
        q2_g64_block(a16, a4, row, base + b * 20, xq, b * 64, xds, b * 4)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) + (s[1] + s[3])


@njit(inline="always")
def _row_q3_g64(row, base, nblk, xq, xds, xs16):
    a16 = acc16()
    a4 = acc4()
    for b in range(nblk):
        q3_g64_block(a16, a4, row, base + b * 28, xq, b * 64, xds, b * 4)
    s = numba.carray(a4, 4)
    return _hsum(a16, 16) + (s[1] + s[3])


# Every matvec kernel takes up to three matrices that share x (Q/K/V, gate/up): one
# x quantization and one parallel launch for all of them; unused slots get 0-row arrays.


@njit(inline="always")
def _set_row(i, o0, o1, o2, r, v):
    """Row r of the output that loop row i belongs to (_batch_row's) = v. The store names
    o0, o1, o2 themselves: a prange body that assigns into the array _batch_row returned
    loses the write (Numba 0.68's parfor pass, silently; a nested loop or a call hides it,
    as in _mvb)."""
    if i < o0.shape[0]:
        o0[r] = v
    elif i < o0.shape[0] + o1.shape[0]:
        o1[r] = v
    else:
        o2[r] = v


@njit(inline="always")
def _mv(row_fn, kind, d0, d1, d2, x, o0, o1, o2):
    """o_k = W_k @ x for up to three matrices of one format (d0, d1, d2) on one quantized
    x (quantize_x, or quantize_x1 for X1's formats), their rows in one parallel loop.

    The format's row loop comes in as a function (row_fn = _row_<fmt>), not chosen by a
    branch on kind: an inlined branch over every format copies all their row loops into
    each kernel's IR before the dead ones are pruned, which costs the first run's compile
    of mv_q8_0 12.8 s of CPU where this form takes 7.3 s (same bits)."""
    cols = x.shape[0]
    unit, nib2 = row_layout(kind)
    n = cols // unit
    xq, xds, xs16 = _scratch(cols)
    quantize_xn(x, x1_span(kind), nib2, xq, xds, xs16)
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    for i in prange(d0.shape[0] + d1.shape[0] + d2.shape[0]):
        flat, base, _, r = _batch_row(i, f0, f1, f2, d0, d1, d2, o0, o1, o2)
        _set_row(i, o0, o1, o2, r, row_fn(flat, base, n, xq, xds, xs16))


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_1(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_q4_1, KIND_Q4_1, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_0(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_q4_0, KIND_Q4_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q5_0(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_q5_0, KIND_Q5_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q8_0(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_q8_0, KIND_Q8_0, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q4_k(d0, d1, d2, x, o0, o1, o2):
    _mv_k8(KIND_Q4_K, d0, d1, d2, x, o0, o1, o2)


@njit(inline="always")
def _mv_k8(kind, d0, d1, d2, x, o0, o1, o2):
    """mv_q4_k / mv_q5_k / mv_q6_k on quantize_x_sb8's single-level activations."""
    cols = x.shape[0]
    n = cols // 256
    xb, xsb, xp, bs = x_k8(kind, x)
    f0, f1, f2 = d0.reshape(-1), d1.reshape(-1), d2.reshape(-1)
    for i in prange(d0.shape[0] + d1.shape[0] + d2.shape[0]):
        flat, base, _, r = _batch_row(i, f0, f1, f2, d0, d1, d2, o0, o1, o2)
        _set_row(i, o0, o1, o2, r, _row_k8(kind, flat, base, n, xb, xsb, xp, bs))


@njit(parallel=True, cache=True, nogil=True)
def mv_q6_k(d0, d1, d2, x, o0, o1, o2):
    _mv_k8(KIND_Q6_K, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q5_1(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_q5_1, KIND_Q5_1, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_iq4_nl(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_iq4_nl, KIND_IQ4_NL, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q5_k(d0, d1, d2, x, o0, o1, o2):
    _mv_k8(KIND_Q5_K, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_iq4_xs(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_iq4_xs, KIND_IQ4_XS, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q3_k(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_q3_k, KIND_Q3_K, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q2_k(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_q2_k, KIND_Q2_K, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q2_g64(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_q2_g64, KIND_Q2_G64, d0, d1, d2, x, o0, o1, o2)


@njit(parallel=True, cache=True, nogil=True)
def mv_q3_g64(d0, d1, d2, x, o0, o1, o2):
    _mv(_row_q3_g64, KIND_Q3_G64, d0, d1, d2, x, o0, o1, o2)


@njit(inline="always")
def _batch_row(row, f0, f1, f2, d0, d1, d2, o0, o1, o2):
    """Row `row` of the batched kernels' parallel loop over the rows of up to three
    matrices -> (its matrix's flat bytes, the row's byte offset, the output, its row)."""
    i = np.int64(row)  # one integer type for r in every branch
    n0, n01 = d0.shape[0], d0.shape[0] + d1.shape[0]
    if i < n0:
        return f0, i * d0.shape[1], o0, i
    if i < n01:
        return f1, (i - n0) * d1.shape[1], o1, i - n0
    return f2, (i - n01) * d2.shape[1], o2, i - n01
