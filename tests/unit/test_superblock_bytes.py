"""The vnni path's byte GEMM (int8.superblock_bytes) for Q5_K, IQ4_XS, Q3_K and Q2_K:
W @ xq exactly up to float rounding, xq the single-level activations per 32; what
qmatvec.matmul routes there; its int32 lanes at the weights' and activations' limits."""

from __future__ import annotations

import numpy as np
import pytest
from test_qmatvec import _extreme_kquant

from edgerun.ops import qmatvec as qm
from edgerun.quant.formats import QuantTensor, QuantType
from edgerun.quant.reference import dequantize, random_blocks

pytestmark = pytest.mark.skipif(
    "vnni" not in qm.available_paths(), reason="CPU without AVX-512 VNNI"
)

TYPES = [QuantType.Q5_K, QuantType.IQ4_XS, QuantType.Q3_K, QuantType.Q2_K]


@pytest.fixture
def vnni():
    old = qm.kernel_path()
    qm.set_kernel_path("vnni")
    yield
    qm.set_kernel_path(old)


def _kernel():
    from edgerun.ops.int8 import superblock_bytes as sbb

    return sbb


def _relerr(y, r):
    return float(np.linalg.norm(y.astype(np.float64) - r) / np.linalg.norm(r))


@pytest.mark.parametrize("q", TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,nsb,n", [(21, 3, 17), (16, 4, 32)])  # odd tiles, row rests
def test_equals_the_product_with_single_level_activations(q, rows, nsb, n):
    rng = np.random.default_rng(rows + nsb + n)
    cols = 256 * nsb
    data = random_blocks(q, rows, cols, rng).view(np.uint8).reshape(rows, -1)
    x = rng.standard_normal((n, cols)).astype(np.float32)
    x[:, 5] *= 40.0  # an outlier channel: its block's scale, not the others'
    out = np.full((n, rows), np.nan, np.float32)
    _kernel().mm_superblock_bytes(qm.TRAITS[q].superblock_kind, data, x, out)
    w = dequantize(q, data).astype(np.float64)
    xq = qm.quantize_x_reference(x, 32, 1).astype(np.float64)
    assert _relerr(out, xq @ w.T) < 1e-5


@pytest.mark.parametrize("q", TYPES, ids=lambda q: q.name)
def test_int32_lanes_at_the_limits(q):
    """Largest weight bytes times |q| = 127 in every element: no lane wraps."""
    w = _extreme_kquant(q, 5, 3)
    x = np.full((16, 768), 3.0, np.float32)
    x[:, ::7] = -3.0
    out = np.empty((16, 5), np.float32)
    _kernel().mm_superblock_bytes(qm.TRAITS[q].superblock_kind, w.data, x, out)
    ref = x.astype(np.float64) @ dequantize(q, w.data).astype(np.float64).T
    assert _relerr(out, ref) < 1e-6  # x is exact in int8 here (|x| = max of every block)


@pytest.mark.parametrize("q", TYPES, ids=lambda q: q.name)
def test_matmul_routes_long_prompts_here(q, vnni):
    n = qm.mvb_prefill_max(q) + 1
    rng = np.random.default_rng(1)
    data = random_blocks(q, 8, 512, rng).view(np.uint8).reshape(8, -1)
    x = rng.standard_normal((n, 512)).astype(np.float32)
    direct = np.empty((n, 8), np.float32)
    _kernel().mm_superblock_bytes(qm.TRAITS[q].superblock_kind, data, x, direct)
    np.testing.assert_array_equal(qm.matmul(QuantTensor("w", q, (8, 512), data), x), direct)
    assert qm.activation_block(q, n) == 32 and qm.activation_levels(q, n) == 1


def test_emits_vpdpbusd_on_zmm():
    from numba import njit

    sbb = _kernel()
    fresh = njit(sbb.mm_superblock_bytes.py_func)  # uncached and serial: inspect_asm compiles
    data = random_blocks(QuantType.Q3_K, 4, 256, np.random.default_rng(0)).view(np.uint8)
    fresh(
        qm.TRAITS[QuantType.Q3_K].superblock_kind,
        data.reshape(4, -1),
        np.ones((4, 256), np.float32),
        np.empty((4, 4), np.float32),
    )
    asm = "".join(fresh.inspect_asm().values())
    assert "vpdpbusd" in asm and "zmm" in asm
