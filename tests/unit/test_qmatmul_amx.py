"""The K-quant prefill GEMM on AMX tiles, held to the AVX-512 super-block GEMM (the same
integers) and to the numpy reference, on random, extreme and real Qwen2.5 weights.

Runs where the CPU has AMX (Intel Xeon 4th gen and newer); elsewhere each test says so
and skips. `qmatvec.matmul` routes prefill there from MIN_TOKENS tokens on, so
test_qmatvec's matmul tests cover it too on such a CPU.
"""

from __future__ import annotations

import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from edgerun import registry
from edgerun.ops import qmatvec as qm
from edgerun.quant.formats import QuantTensor, QuantType
from edgerun.quant.reference import dequantize, random_blocks

if "vnni" not in qm.available_paths():
    pytest.skip("CPU without AVX-512 VNNI, so without AMX", allow_module_level=True)

from edgerun.ops import amx as amx  # noqa: E402
from edgerun.ops.int8 import superblock as sb  # noqa: E402

needs_amx = pytest.mark.skipif(not amx.available(), reason="CPU or kernel without AMX int8")


@pytest.fixture(autouse=True)
def vnni_path():
    """The routes tested here are the vnni path's: other tests (a device profile's load)
    may leave another path selected."""
    old = qm.kernel_path()
    qm.set_kernel_path("vnni")
    yield
    qm.set_kernel_path(old)


KIND = {QuantType.Q4_K: sb.KIND_Q4_K, QuantType.Q6_K: sb.KIND_Q6_K}


def _relerr(y, r) -> float:
    return float(np.linalg.norm(y.astype(np.float64) - r) / max(np.linalg.norm(r), 1e-30))


def _both(q, data, X, parts=3):
    rows = data.shape[0]
    a = np.full((X.shape[0], rows), np.nan, np.float32)
    b = np.full((X.shape[0], rows), np.nan, np.float32)
    amx.mm_superblock_amx(KIND[q], data, X, a, parts)
    sb.mm_superblock(KIND[q], data, X, b)
    return a, b


def _ref_q(q, data, X):
    """float64 product of the dequantized weights with the quantized activations the
    GEMM really uses (quantize_x's two levels per 256 elements)."""
    w = dequantize(q, data).astype(np.float64)
    return qm.quantize_x_reference(X, 256).astype(np.float64) @ w.T


@needs_amx
@pytest.mark.parametrize("q", [QuantType.Q4_K, QuantType.Q6_K], ids=lambda q: q.name)
@pytest.mark.parametrize(
    "rows,nsb,n,parts",
    [(16, 1, 16, 1), (33, 3, 13, 3), (40, 2, 40, 8), (7, 6, 17, 1), (50, 4, 64, 2), (16, 1, 1, 1)],
)
def test_amx_matches_superblock_gemm_and_reference(q, rows, nsb, n, parts):
    """Partial row tiles, partial token groups, more parts than tiles, one super-block
    and one token (the pipelined epilogue's first and last steps): every output is
    written, equal to the AVX-512 GEMM up to float rounding and to the reference on the
    quantized activations."""
    rng = np.random.default_rng(rows * 100 + n)
    data = random_blocks(q, rows, 256 * nsb, rng)
    X = rng.standard_normal((n, 256 * nsb)).astype(np.float32)
    X[n // 2] *= 50.0  # tokens of very different scales share a tile
    a, b = _both(q, data, X, parts)
    assert np.isfinite(a).all()
    assert _relerr(a, b.astype(np.float64)) < 1e-6
    assert _relerr(a, _ref_q(q, data, X)) < 2e-6


@needs_amx
@pytest.mark.parametrize("q", [QuantType.Q4_K, QuantType.Q6_K], ids=lambda q: q.name)
def test_amx_int32_limits(q):
    """Largest folded weights (945 / 4096) times the largest words (16320): the tile sums
    and their combination in the epilogue must not wrap."""
    from test_qmatvec import _extreme_kquant

    w = _extreme_kquant(q, 20, 3)
    X = np.full((18, 768), 3.0, np.float32)
    X[:, ::7] = -3.0
    X[2] *= 1e3
    a, b = _both(q, w.data, X)
    ref = _ref_q(q, w.data, X)
    assert _relerr(a, ref) < 2e-6
    assert np.allclose(a, b, rtol=1e-5, atol=1e-3 * np.abs(ref).max())


def _real_tensor(model: str, name: str):
    try:
        path = registry.resolve_path(registry.find(model))
    except Exception as e:  # noqa: BLE001 - the test says which model is missing
        pytest.fail(f"{model} is not installed ({e}); run `edgerun pull --all`")
    return next(t for t in gguf.GGUFReader(path).tensors if t.name == name)


@needs_amx
@pytest.mark.parametrize(
    "model,name",
    [("gemma3-270m", "blk.0.attn_output.weight"), ("qwen2.5-coder-0.5b", "blk.2.ffn_down.weight")],
)
def test_amx_on_real_weights_through_matmul(model, name):
    """Real Q4_K (Gemma 3) and Q6_K (Qwen2.5-Coder-0.5B) matrices through
    `qmatvec.matmul`, the route prefill takes, against the AVX-512 GEMM and the
    reference."""
    t = _real_tensor(model, name)
    cols, rows = (int(v) for v in t.shape[:2])
    q = QuantType(int(t.tensor_type))
    assert q in KIND
    raw = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
    w = QuantTensor(name, q, (rows, cols), raw)
    X = np.random.default_rng(1).standard_normal((40, cols)).astype(np.float32)
    assert qm.uses_amx()
    y = qm.matmul(w, X)
    b = np.empty_like(y)
    sb.mm_superblock(KIND[q], raw, X, b)
    assert _relerr(y, b.astype(np.float64)) < 1e-6
    assert _relerr(y, _ref_q(q, raw, X)) < 2e-6


def test_amx_off_switch():
    """EDGERUN_AMX=0 keeps the AVX-512 GEMM (and so does a CPU without AMX)."""
    code = "from edgerun.ops import qmatvec as q; print(q.uses_amx())"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, EDGERUN_AMX="0")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
    env["EDGERUN_AMX"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == str(amx.available())


BF16_FORMATS = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q5_0, QuantType.Q8_0]


@needs_amx
@pytest.mark.parametrize("q", BF16_FORMATS + [QuantType.Q3_G64, QuantType.Q2_G64], ids=str)
@pytest.mark.parametrize("rows,cols,n", [(16, 64, 24), (33, 96, 30), (40, 640, 40), (7, 896, 25)])
def test_bf16_gemm_matches_the_exact_product(q, rows, cols, n):
    """Block formats through `qmatvec.matmul` on bf16 tiles: no int8 rounding of x, so
    within 2e-5 of the float64 product of the dequantized weights (split bf16 halves:
    16 significant bits a side), columns not a multiple of 64 and partial tiles
    included."""
    rng = np.random.default_rng(rows + cols + n)
    if q in (QuantType.Q3_G64, QuantType.Q2_G64):
        cols = max(64, cols // 64 * 64)
    w = QuantTensor("w", q, (rows, cols), random_blocks(q, rows, cols, rng))
    X = rng.standard_normal((n, cols)).astype(np.float32)
    X[n - 1] *= 1e-3  # a small token next to large ones keeps its own precision
    assert not qm.quantizes_activations(q, n, cols)
    y = qm.matmul(w, X)
    ref = X.astype(np.float64) @ dequantize(q, w.data).astype(np.float64).T
    assert _relerr(y, ref) < 2e-5
    assert _relerr(y[n - 1], ref[n - 1]) < 2e-5


@needs_amx
@pytest.mark.parametrize(
    "model,name",
    [
        ("smollm2-135m", "blk.3.ffn_gate.weight"),
        ("qwen2.5-coder-0.5b", "blk.0.ffn_up.weight"),
        ("qwen2.5-coder-0.5b", "blk.0.attn_v.weight"),
    ],
)
def test_bf16_gemm_on_real_weights(model, name):
    """Real Q4_1 (SmolLM2), Q5_0 and Q8_0 (Qwen2.5-Coder-0.5B) matrices at prefill:
    closer to the exact product than the int8 GEMM they replace."""
    t = _real_tensor(model, name)
    cols, rows = (int(v) for v in t.shape[:2])
    q = QuantType(int(t.tensor_type))
    raw = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
    w = QuantTensor(name, q, (rows, cols), raw)
    X = np.random.default_rng(2).standard_normal((24, cols)).astype(np.float32)
    ref = X.astype(np.float64) @ dequantize(q, raw).astype(np.float64).T
    y = qm.matmul(w, X)
    old = np.empty_like(y)
    from edgerun.ops import int8 as v

    v.mm_int8(qm._MM_INT8[q], raw, X, old)
    assert _relerr(y, ref) < 2e-5
    assert _relerr(y, ref) < _relerr(old, ref)


@needs_amx
@pytest.mark.parametrize("q", BF16_FORMATS, ids=str)
def test_bf16_gemm_partial_last_tile_after_full_ones(q):
    """One part runs every row tile (40 rows: 16, 16, 8), so the last, partial tile is
    unpacked into buffers the full tiles filled: its 8 rows come out right."""
    rng = np.random.default_rng(5)
    rows, cols, n = 40, 96, 24
    data = random_blocks(q, rows, cols, rng)
    X = rng.standard_normal((n, cols)).astype(np.float32)
    out = np.full((n, rows), np.nan, np.float32)
    amx.mm_bf16_amx(qm._MM_INT8[q], data, X, out, 1)
    ref = X.astype(np.float64) @ dequantize(q, data).astype(np.float64).T
    assert np.isfinite(out).all()
    assert _relerr(out, ref) < 2e-5
