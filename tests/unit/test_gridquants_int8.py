"""int8 decode kernels of the grid formats (ops.int8.gridquants) held to the numpy
reference on the activations they quantize, and batched rows equal to single ones."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.ops import qmatvec as qm
from edgerun.ops.int8 import gridquants as ig
from edgerun.quant.formats import QuantType
from edgerun.quant.reference import dequantize, random_blocks

KERNELS = {
    QuantType.IQ2_XXS: (ig.mv_iq2_xxs, ig.mvb_iq2_xxs),
    QuantType.IQ2_XS: (ig.mv_iq2_xs, ig.mvb_iq2_xs),
    QuantType.IQ3_XXS: (ig.mv_iq3_xxs, ig.mvb_iq3_xxs),
    QuantType.IQ3_S: (ig.mv_iq3_s, ig.mvb_iq3_s),
}
# as tests/model/test_qmatvec.py: within float rounding of the product on the quantized
# x, and within single-level int8's error of the exact product
TOL_QX = 2e-5
TOL_Q8 = 2e-2

pytestmark = pytest.mark.skipif(
    not set(qm.available_paths()) - {"portable"}, reason="this CPU has no int8 kernel path"
)


def _relerr(y, r):
    return float(np.linalg.norm(y.astype(np.float64) - r) / np.linalg.norm(r))


def _none(cols_bytes):
    return np.zeros((0, cols_bytes), np.uint8)


@pytest.mark.parametrize("q", list(KERNELS), ids=lambda q: q.name)
def test_three_slots_match_reference(q):
    rng = np.random.default_rng(int(q))
    cols = 512
    mats = [random_blocks(q, rows, cols, rng) for rows in (37, 5, 16)]
    x = (rng.standard_normal(cols) * np.linspace(0.01, 3, cols)).astype(np.float32)
    outs = [np.zeros(m.shape[0], np.float32) for m in mats]
    KERNELS[q][0](*mats, x, *outs)
    xq = qm.quantize_x_reference(x, 256, 1).astype(np.float64)
    for m, y in zip(mats, outs):
        w = dequantize(q, m).astype(np.float64)
        assert _relerr(y, w @ xq) < TOL_QX
        assert _relerr(y, w @ x.astype(np.float64)) < TOL_Q8
    # an unused slot (0 rows) changes nothing
    y1 = np.zeros(37, np.float32)
    none = np.zeros(0, np.float32)
    KERNELS[q][0](mats[0], _none(mats[0].shape[1]), _none(mats[0].shape[1]), x, y1, none, none)
    np.testing.assert_array_equal(y1, outs[0])


@pytest.mark.parametrize("q", list(KERNELS), ids=lambda q: q.name)
@pytest.mark.parametrize("n", [2, 3, 9, 17])  # one vector group (8) and past it
def test_batched_rows_equal_single_bit_for_bit(q, n):
    rng = np.random.default_rng(n)
    cols = 768
    a, b = random_blocks(q, 11, cols, rng), random_blocks(q, 6, cols, rng)
    X = rng.standard_normal((n, cols)).astype(np.float32)
    X[1] *= 1e-3  # one small vector: its own activation scales
    mv, mvb = KERNELS[q]
    Ya, Yb = np.zeros((n, 11), np.float32), np.zeros((n, 6), np.float32)
    mvb(a, b, _none(a.shape[1]), X, Ya, Yb, np.zeros((0, 0), np.float32))
    none = np.zeros(0, np.float32)
    for v in range(n):
        ya, yb = np.zeros(11, np.float32), np.zeros(6, np.float32)
        mv(a, b, _none(a.shape[1]), X[v], ya, yb, none)
        np.testing.assert_array_equal(Ya[v], ya)
        np.testing.assert_array_equal(Yb[v], yb)
