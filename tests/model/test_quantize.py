"""Quantizers: bit-compatibility with gguf-py, round trips through our dequantizer,
error bounds per format, low-bit formats and their kernels, imatrix weighting, recipes."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as G

from edgerun.errors import InvalidArgumentError
from edgerun.ops.portable import lowbit as K
from edgerun.quant import lowbit
from edgerun.quant.formats import QuantType, row_bytes
from edgerun.quant.quantize import make_qkx2_quants, parse_qtype, quantize, quantize_tensor
from edgerun.quant.recipes import plan_types, recipe_names, use_more_bits
from edgerun.quant.reference import dequantize

Q = QuantType
LOWBIT = [q for q in ("Q3_G64", "Q2_G64") if hasattr(QuantType, q)]

# relative RMS error bounds on Gaussian weights (measured values are ~0.6-0.8x these)
REL_RMSE = {
    Q.F32: 0.0,
    Q.F16: 1e-3,
    Q.BF16: 5e-3,
    Q.Q8_0: 0.01,
    Q.Q6_K: 0.03,
    Q.Q5_K: 0.05,
    Q.Q5_0: 0.06,
    Q.Q5_1: 0.06,
    Q.Q4_K: 0.1,
    Q.Q4_1: 0.12,
    Q.Q4_0: 0.13,
}


def _weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    x[1, 3] = 0.4  # an outlier
    x[2] = 0.0  # an all-zero row
    x[3, :64] = 0.01  # a constant block
    return x


def _rel_rmse(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.sqrt(((a - b) ** 2).mean()) / np.sqrt((b**2).mean()))


@pytest.mark.parametrize("q", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16])
def test_bit_exact_with_gguf(q):
    x = _weights(24, 512)
    ours = quantize(x, q)
    ref = np.asarray(gguf.quants.quantize(x, G[q.name])).view(np.uint8).reshape(ours.shape)
    assert ours.shape == (24, row_bytes(q, 512))
    np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("q", list(REL_RMSE))
def test_round_trip_error_bounds(q):
    x = _weights(32, 768, seed=1)
    raw = quantize(x, q)
    back = dequantize(q, raw)
    assert back.shape == x.shape
    assert _rel_rmse(back, x) <= REL_RMSE[q]
    # zero rows stay exactly zero
    assert np.all(back[2] == 0)


@pytest.mark.parametrize("q", [Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_kquants_decode_with_gguf(q):
    """Our K-quant bytes are valid GGML blocks: gguf-py decodes them as our reference does."""
    x = _weights(8, 512, seed=2)
    raw = quantize(x, q)
    ours = dequantize(q, raw)
    theirs = gguf.quants.dequantize(raw, G[q.name]).reshape(ours.shape)
    np.testing.assert_array_equal(ours, theirs)


def test_formats_without_a_quantizer_say_so():
    """Q2_K, Q3_K and the IQ4 formats load from llama.cpp's files; asking to quantize to
    one is a clear error, not a NotImplementedError from inside numpy code."""
    for q in (Q.Q2_K, Q.Q3_K, Q.IQ4_NL, Q.IQ4_XS):
        with pytest.raises(InvalidArgumentError, match=q.name):
            quantize(_weights(4, 256), q)


def test_q5k_has_half_the_error_of_q4k():
    x = _weights(32, 768, seed=4)
    e4 = _rel_rmse(dequantize(Q.Q4_K, quantize(x, Q.Q4_K)), x)
    e5 = _rel_rmse(dequantize(Q.Q5_K, quantize(x, Q.Q5_K)), x)
    assert e5 < 0.6 * e4


def test_q4k_scale_search_beats_minmax():
    """The 20-step scale search of make_qkx2_quants lowers the error of min/max rounding."""
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((500, 32))).astype(np.float32)
    w = np.ones_like(x)
    s, m = make_qkx2_quants(x, w, 15, nstep=20)
    L = np.clip(np.rint((x - m[:, None]) / s[:, None]), 0, 15)
    err_search = ((s[:, None] * L + m[:, None] - x) ** 2).mean()
    mn = np.minimum(x.min(1), 0)
    s0 = (x.max(1) - mn) / 15
    L0 = np.clip(np.rint((x - mn[:, None]) / s0[:, None]), 0, 15)
    err_minmax = ((s0[:, None] * L0 + mn[:, None] - x) ** 2).mean()
    assert err_search < 0.95 * err_minmax


@pytest.mark.parametrize("bits", [3, 2])
def test_lowbit_round_trip_and_layout(bits):
    rng = np.random.default_rng(4)
    x = (rng.standard_normal((40, 64)) * 0.03).astype(np.float32)
    for method, bound in (("rtn", {3: 0.25, 2: 0.55}), ("search", {3: 0.2, 2: 0.42})):
        raw = lowbit.quantize_blocks(x, bits, None, method)
        assert raw.shape == (40, lowbit.BYTES[bits])
        back = lowbit.dequantize_blocks(raw, bits)
        assert _rel_rmse(back, x) < bound[bits]
    # layout: a block of 0..nmax ramps decodes to its values
    nmax = (1 << bits) - 1
    vals = (np.arange(64) % (nmax + 1)).astype(np.float32)[None]
    raw = lowbit.quantize_blocks(vals, bits, None, "rtn")
    np.testing.assert_array_equal(lowbit.dequantize_blocks(raw, bits), vals)


@pytest.mark.parametrize("bits", [3, 2])
def test_lowbit_kernels_match_reference(bits):
    rng = np.random.default_rng(5)
    rows, cols = 37, 320
    w = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
    raw = lowbit.quantize_blocks(w.reshape(-1, 64), bits).reshape(rows, -1)
    deq = lowbit.dequantize_blocks(raw.reshape(-1, lowbit.BYTES[bits]), bits).reshape(rows, cols)
    x = rng.standard_normal(cols).astype(np.float32)
    out = np.empty(rows, np.float32)
    (K.mv_q3_g64 if bits == 3 else K.mv_q2_g64)(raw, x, out)
    ref = deq.astype(np.float64) @ x
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    X = rng.standard_normal((5, cols)).astype(np.float32)
    Y = np.empty((5, rows), np.float32)
    K.mm_lowbit(bits, raw, X, Y, 16)
    np.testing.assert_allclose(Y, X.astype(np.float64) @ deq.T, rtol=1e-4, atol=1e-4)
    ids = np.array([0, 36, 5, 5], np.int64)
    E = np.empty((4, cols), np.float32)
    K.embedding_rows_lowbit(bits, raw, ids, E)
    np.testing.assert_array_equal(E, deq[ids])


@pytest.mark.parametrize("name", LOWBIT)
def test_lowbit_registered_formats(name):
    """Once registered as QuantTypes: quantize / reference dequantize / qmatvec agree."""
    from edgerun.ops import qmatvec

    q = QuantType[name]
    x = _weights(16, 192, seed=6)
    t = quantize_tensor("w", x, q)
    deq = dequantize(q, t.data)
    assert _rel_rmse(deq, x) < (0.25 if name == "Q3_G64" else 0.5)
    v = np.random.default_rng(0).standard_normal(192).astype(np.float32)
    X = np.random.default_rng(1).standard_normal((3, 192)).astype(np.float32)
    for xs, got, ref in (
        (v, qmatvec.matvec(t, v), qmatvec.matvec_reference),
        (X, qmatvec.matmul(t, X), qmatvec.matmul_reference),
    ):
        n = 1 if xs.ndim == 1 else xs.shape[0]
        if qmatvec.quantizes_activations(q, n, 192):  # the x the int8 kernels multiply
            xs = qmatvec.quantize_x_reference(
                xs, qmatvec.activation_block(q, n), qmatvec.activation_levels(q, n)
            )
        np.testing.assert_allclose(got, ref(t, xs), rtol=1e-3, atol=1e-4)
    np.testing.assert_array_equal(qmatvec.embedding_rows(t, np.array([4, 0])), deq[[4, 0]])


def test_imatrix_weighting_lowers_weighted_error():
    """With column importances, the error that matters (activation-weighted) goes down."""
    rng = np.random.default_rng(7)
    rows, cols = 64, 256
    w = (rng.standard_normal((rows, cols)) * 0.02).astype(np.float32)
    imp = np.exp(rng.standard_normal(cols) * 1.5).astype(np.float32)  # skewed importances
    qtypes = [Q.Q4_K] + [QuantType[n] for n in LOWBIT]
    for q in qtypes:
        plain = dequantize(q, quantize(w, q))
        weighted = dequantize(q, quantize(w, q, imatrix=imp))
        e_plain = (((plain - w) ** 2) * imp).sum()
        e_weighted = (((weighted - w) ** 2) * imp).sum()
        assert e_weighted < 0.97 * e_plain, q.name
    # the raw low-bit path too, independent of registration
    for bits in (3, 2):
        blocks = w.reshape(-1, 64)
        wi = np.broadcast_to(imp.reshape(1, 4, 64), (rows, 4, 64)).reshape(-1, 64)
        a = lowbit.dequantize_blocks(lowbit.quantize_blocks(blocks, bits, None), bits)
        b = lowbit.dequantize_blocks(lowbit.quantize_blocks(blocks, bits, wi), bits)
        assert (((b - blocks) ** 2) * wi).sum() < (((a - blocks) ** 2) * wi).sum()


def test_quantize_errors():
    with pytest.raises(InvalidArgumentError, match="multiple of 256"):
        quantize(np.zeros((2, 320), np.float32), Q.Q4_K)
    with pytest.raises(InvalidArgumentError, match="NaN"):
        quantize(np.full((1, 32), np.nan, np.float32), Q.Q8_0)
    with pytest.raises(InvalidArgumentError, match="unknown quantization type"):
        parse_qtype("q9_9")
    with pytest.raises(InvalidArgumentError, match="imatrix"):
        quantize(np.zeros((1, 256), np.float32), Q.Q4_K, imatrix=np.ones(10))
    assert parse_qtype("q4_k") is Q.Q4_K


def test_recipes():
    shapes = {
        "token_embd.weight": (1000, 576),
        "output_norm.weight": (1, 576),
        **{f"blk.{i}.attn_v.weight": (192, 576) for i in range(8)},
        **{f"blk.{i}.ffn_down.weight": (576, 1536) for i in range(8)},
        **{f"blk.{i}.attn_norm.weight": (1, 576) for i in range(8)},
    }
    p = plan_types("q4_k_m", shapes, 8)
    assert p.types["output_norm.weight"] == Q.F32
    # 576 columns cannot take 256-blocks: Q4_K -> Q5_0, Q6_K -> Q8_0
    assert p.types["blk.1.attn_v.weight"] == Q.Q5_0
    assert p.types["token_embd.weight"] == Q.Q8_0  # tied output head: Q6_K -> Q8_0
    assert p.types["blk.0.ffn_down.weight"] == Q.Q6_K  # more bits (first eighth)
    assert p.types["blk.1.ffn_down.weight"] == Q.Q4_K
    assert "blk.1.attn_v.weight" in p.fallbacks
    assert plan_types("q8_0", shapes, 8).types["blk.3.ffn_down.weight"] == Q.Q8_0
    pure = plan_types("q4_0", shapes, 8, pure=True)
    assert pure.types["token_embd.weight"] == Q.Q4_0
    assert plan_types("q4_0", shapes, 8).types["token_embd.weight"] == Q.Q8_0
    assert [use_more_bits(i, 24) for i in range(6)] == [True, True, True, False, False, True]
    # Q5_K_M (llama.cpp's most downloaded level): Q5_K, Q6_K on the more-bits layers'
    # attn_v / ffn_down and the head; 576 columns fall back Q5_K -> Q5_1, Q6_K -> Q8_0
    q5 = plan_types("q5_k_m", shapes, 8)
    assert q5.types["blk.0.ffn_down.weight"] == Q.Q6_K
    assert q5.types["blk.1.ffn_down.weight"] == Q.Q5_K
    assert q5.types["blk.1.attn_v.weight"] == Q.Q5_1
    assert q5.fallbacks["blk.1.attn_v.weight"] == ("Q5_K", "Q5_1")
    assert q5.types["token_embd.weight"] == Q.Q8_0
    assert plan_types("q5_k_s", shapes, 8).types["blk.0.ffn_down.weight"] == Q.Q5_K
    from edgerun.cli import _build_parser

    convert = _build_parser()._subparsers._group_actions[0].choices["convert"]
    quant = next(a for a in convert._actions if a.dest == "quant")
    assert set(quant.help.replace(",", " ").split()) >= set(recipe_names())  # help lists all
    with pytest.raises(InvalidArgumentError, match="not a GGUF"):
        plan_types("keep", shapes, 8)
    with pytest.raises(InvalidArgumentError, match="unknown quantization"):
        plan_types("q7", shapes, 8)


def test_imatrix_collector_sees_every_projection(smollm2):
    """Calibration records the inputs of all 7 matrices of every layer, in prefill (matmul)
    and in one-token decode (matvec / matvec_many), as mean squares per column."""
    from edgerun.tools.calibrate import collect_imatrix

    tr = smollm2.transformer
    ids = smollm2.tokenize("def main():\n    return 0\n" * 8)
    imat = collect_imatrix(tr, ids, n_ctx=len(ids), chunk=len(ids) - 1)
    names = {
        f"blk.{i}.{r}.weight"
        for i in range(smollm2.spec.n_layers)
        for r in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    }
    assert names <= set(imat)
    assert imat["blk.0.ffn_down.weight"].shape == (smollm2.spec.d_ff,)
    assert all(np.isfinite(v).all() and (v >= 0).all() for v in imat.values())
    # decode steps are counted too: one token more than the prefill for each matrix
    from edgerun.tools.calibrate import ImatrixCollector

    col = ImatrixCollector()
    from edgerun.model.kvcache import KVCache

    cache = KVCache(smollm2.spec, 8)
    with col.hooked():
        tr.forward(ids[:3], cache)
        tr.forward(ids[3:4], cache)
    assert col.counts["blk.0.attn_q.weight"] == 4 and col.counts["blk.5.ffn_up.weight"] == 4
