"""Batched decode (matvec_batch) equals matvec row for row, bit for bit.

Concurrent sessions must decode the same tokens as a session alone, so the batched
kernels are held to exact equality with the single-vector kernels, not to a tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.errors import InvalidArgumentError
from edgerun.ops import qmatvec as qm
from edgerun.quant.formats import BLOCK_LAYOUT, QuantTensor, QuantType
from edgerun.quant.reference import random_blocks


def _tensor(q: QuantType, rows: int, nblocks: int, seed: int) -> QuantTensor:
    elems = BLOCK_LAYOUT[q][0]
    cols = 256 * nblocks if elems == 1 else elems * nblocks
    rng = np.random.default_rng(seed)
    return QuantTensor(f"t{q.name}", q, (rows, cols), random_blocks(q, rows, cols, rng))


@pytest.fixture(params=qm.available_paths())
def path(request):
    old = qm.kernel_path()
    qm.set_kernel_path(request.param)
    yield request.param
    qm.set_kernel_path(old)


@pytest.mark.parametrize("q", list(QuantType), ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_batch_equals_matvec_bitwise(q, n, path):
    w = _tensor(q, 37, 3, seed=n)
    x = np.random.default_rng(100 + n).standard_normal((n, w.shape[1])).astype(np.float32)
    single = np.stack([qm.matvec(w, x[i]) for i in range(n)])
    batched = qm.matvec_batch(w, x)
    assert batched.shape == (n, 37) and batched.dtype == np.float32
    np.testing.assert_array_equal(batched, single)


def test_batch_close_to_reference():
    w = _tensor(QuantType.Q4_K, 16, 2, seed=1)
    x = np.random.default_rng(2).standard_normal((4, w.shape[1])).astype(np.float32)
    ref = qm.matmul_reference(w, x)
    y = qm.matvec_batch(w, x)
    # the int8 paths quantize x: two-level int8 blocks (~15 bits), or single-level int8
    # for Q4_K off the vnni path (activation_levels), which is then W @ xq
    tol = 2e-4 if qm.quantizes_activations(w.qtype) else 2e-5
    if qm.activation_levels(w.qtype, 4) == 1:
        assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 2e-2
        xq = qm.quantize_x_reference(x, qm.activation_block(w.qtype, 4), 1)
        ref = qm.matmul_reference(w, xq)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < tol


def test_batch_shape_error_names_tensor():
    w = _tensor(QuantType.Q8_0, 4, 2, seed=0)
    with pytest.raises(InvalidArgumentError, match="tQ8_0"):
        qm.matvec_batch(w, np.zeros((2, 7), np.float32))


@pytest.mark.parametrize(
    "qs",
    [
        (QuantType.Q4_1, QuantType.Q4_1, QuantType.Q4_1),
        (QuantType.Q4_K, QuantType.Q4_K),
        (QuantType.Q4_K, QuantType.Q6_K, QuantType.Q4_K),  # Qwen's mixed q, k, v
        (QuantType.Q8_0, QuantType.Q8_0, QuantType.Q8_0, QuantType.Q8_0),  # 3 + 1
    ],
    ids=lambda qs: "-".join(q.name for q in qs),
)
@pytest.mark.parametrize("n", [1, 3, 4, 6])
def test_batch_many_equals_matvec_bitwise(qs, n, path):
    """Matrices sharing x in one kernel call (Q/K/V, gate/up): each output equals its
    own single-vector matvec, whatever the mix of formats and row counts."""
    ws = [_tensor(q, 21 + 8 * i, 2, seed=i) for i, q in enumerate(qs)]
    x = np.random.default_rng(n).standard_normal((n, ws[0].shape[1])).astype(np.float32)
    got = qm.matvec_batch_many(ws, x)
    assert len(got) == len(ws)
    for w, y in zip(ws, got):
        want = np.stack([qm.matvec(w, x[i]) for i in range(n)])
        np.testing.assert_array_equal(y, want)


def test_batch_many_names_the_matrix_that_does_not_fit():
    a = _tensor(QuantType.Q8_0, 4, 2, seed=0)
    b = _tensor(QuantType.Q8_0, 4, 3, seed=1)
    with pytest.raises(InvalidArgumentError, match="tQ8_0 has 96 columns"):
        qm.matvec_batch_many([a, b], np.zeros((2, 64), np.float32))
