"""model/moe.py: routing, the MoE FFN against a float reference, batched decode rows equal to
one-row calls bit for bit, prompt rows equal to them within float rounding, and the
per-expert views of a GGUF's 3-D expert tensors (model/reference checks against
transformers: tests/reference/test_families.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgerun.arch import spec_from_gguf
from edgerun.errors import ModelFormatError
from edgerun.formats.gguf import read_gguf
from edgerun.model.ffn import DenseFFN
from edgerun.model.moe import MoEFFN, ResidentExperts, expert_footprint, route
from edgerun.model.transformer import Transformer
from edgerun.model.weights import ResidentStore
from edgerun.quant.formats import QuantTensor, QuantType
from edgerun.quant.reference import dequantize, random_blocks

TINY = Path(__file__).resolve().parents[1] / "data" / "families" / "qwen3moe" / "f32.gguf"


def _softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def test_route_picks_the_top_k_by_probability_and_renormalises():
    logits = np.array([[0.0, 3.0, 1.0, 2.0], [5.0, -1.0, 4.0, 4.5]], np.float32)
    sel, w = route(logits, 2, norm=False)
    assert sel.tolist() == [[1, 3], [0, 3]]
    p = _softmax(logits.astype(np.float64))
    np.testing.assert_allclose(w, np.take_along_axis(p, sel, 1), rtol=1e-6)
    sel_n, w_n = route(logits, 2, norm=True, scale=2.0)
    assert sel_n.tolist() == sel.tolist()
    np.testing.assert_allclose(w_n.sum(1), [2.0, 2.0], rtol=1e-6)
    np.testing.assert_allclose(w_n[:, 0] / w_n[:, 1], w[:, 0] / w[:, 1], rtol=1e-6)
    # a tie goes to the lower expert id
    assert route(np.zeros((1, 4), np.float32), 3, norm=True)[0].tolist() == [[0, 1, 2]]


def _tensor(name: str, qtype: QuantType, rows: int, cols: int, rng) -> QuantTensor:
    return QuantTensor(name, qtype, (rows, cols), random_blocks(qtype, rows, cols, rng, 0.05))


def _moe(qtype: QuantType, d: int, ff: int, n_expert: int, k: int, shared: bool, norm: bool):
    rng = np.random.default_rng(7)
    t = lambda name, r, c: _tensor(name, qtype, r, c, rng)  # noqa: E731
    experts = ResidentExperts(
        [t(f"gate[{e}]", ff, d) for e in range(n_expert)],
        [t(f"up[{e}]", ff, d) for e in range(n_expert)],
        [t(f"down[{e}]", d, ff) for e in range(n_expert)],
    )
    router = _tensor("router", QuantType.F32, n_expert, d, rng)
    sh = gate = None
    if shared:
        sh = DenseFFN(t("sg", 2 * ff, d), t("su", 2 * ff, d), t("sd", d, 2 * ff), "silu")
        gate = rng.standard_normal(d).astype(np.float32) * 0.1
    return MoEFFN(router, experts, k, ff, norm, 1.0, "silu", sh, gate)


def _reference(moe: MoEFFN, x: np.ndarray) -> np.ndarray:
    """The MoE FFN in float64 on dequantized weights, one row at a time."""

    def deq(t: QuantTensor) -> np.ndarray:
        return dequantize(t.qtype, t.data).reshape(t.shape).astype(np.float64)

    def glu_ffn(g, u, dn, v):
        a, b = deq(g) @ v, deq(u) @ v
        return deq(dn) @ (a / (1 + np.exp(-a)) * b)

    out = np.zeros(x.shape, np.float64)
    for r, v in enumerate(x.astype(np.float64)):
        p = _softmax(deq(moe.router) @ v)
        top = np.argsort(-p, kind="stable")[: moe.n_used]
        w = p[top] / (p[top].sum() if moe.norm else 1.0)
        for e, we in zip(top, w):
            m = moe.source.matrices(int(e))
            out[r] += we * glu_ffn(m.gate, m.up, m.down, v)
        if moe.shared is not None:
            s = moe.shared
            z = float(v @ moe.shared_gate)
            out[r] += glu_ffn(s.gate, s.up, s.down, v) / (1 + np.exp(-z))
    return out


CASES = [
    (QuantType.F32, 64, 64, 8, 2, False, True),
    (QuantType.Q8_0, 64, 96, 8, 2, True, False),
    (QuantType.Q4_K, 256, 256, 16, 4, False, True),
]


def test_sigmoid_routing_picks_by_probability_plus_bias_and_weights_by_probability():
    """LFM2-MoE: sigmoid probabilities; the bias (exp_probs_b) changes which experts are
    picked, never their weights."""
    logits = np.array([[2.0, 1.0, 0.0, -1.0]], np.float32)
    p = 1 / (1 + np.exp(-logits.astype(np.float64)))
    sel, w = route(logits, 2, norm=False, gating="sigmoid")
    assert sel.tolist() == [[0, 1]]
    np.testing.assert_allclose(w, p[:, :2], rtol=1e-6)
    bias = np.array([0.0, 0.0, 0.0, 1.0], np.float32)  # lifts the least likely expert
    sel_b, w_b = route(logits, 2, norm=True, gating="sigmoid", bias=bias)
    assert sel_b.tolist() == [[3, 0]]
    np.testing.assert_allclose(w_b, p[:, [3, 0]] / p[:, [3, 0]].sum(), rtol=1e-6)


@pytest.mark.parametrize("qtype,d,ff,n_expert,k,shared,norm", CASES)
def test_moe_matches_float_reference_and_decode_rows_equal_one_row_calls(
    qtype, d, ff, n_expert, k, shared, norm
):
    moe = _moe(qtype, d, ff, n_expert, k, shared, norm)
    x = np.random.default_rng(3).standard_normal((9, d)).astype(np.float32)
    alone = np.concatenate([moe(x[i : i + 1]) for i in range(len(x))])
    ref = _reference(moe, x)
    # activations are rounded to 8 bits on the int8 paths: a few 1e-3 of the output's size
    tol = 1e-5 if qtype == QuantType.F32 else 2e-2
    np.testing.assert_allclose(alone, ref, atol=tol * np.abs(ref).max(), rtol=0)
    # decode rows of several sequences: each row bit for bit the one-row call
    batched = moe.decode_batch(x)
    assert np.array_equal(batched, alone)
    # the rows of one prompt take the prefill kernels: equal within rounding
    prompt = moe(x)
    np.testing.assert_allclose(prompt, alone, atol=tol * np.abs(ref).max(), rtol=0)
    # every expert the rows chose is asked for once, however many rows chose it
    asked = []
    source = moe.source
    moe.source = type("Spy", (), {"n_expert": n_expert, "experts": lambda s, ids: (
        asked.append(list(ids)) or source.experts(ids))})()  # fmt: skip
    moe.decode_batch(x)
    chosen = sorted(set(moe.routing(x, decode=True)[0].ravel().tolist()))
    assert asked == [chosen]


def test_gguf_expert_tensors_are_viewed_per_expert_without_copies():
    f = read_gguf(TINY)
    spec = spec_from_gguf(f.metadata, str(TINY))
    assert (spec.n_expert, spec.n_expert_used, spec.expert_ff, spec.expert_norm) == (
        8,
        2,
        64,
        True,
    )
    name = "blk.1.ffn_down_exps.weight"
    whole = f.tensor(name)
    views = f.expert_matrices(name, 8, (64, 64))
    assert [v.shape for v in views] == [(64, 64)] * 8
    for e, v in enumerate(views):
        assert np.shares_memory(v.data, whole.data)
        assert np.array_equal(v.data, whole.data[e * 64 : (e + 1) * 64])
    with pytest.raises(ModelFormatError, match=r"ffn_down_exps.*\[8, 64, 64\].*\[4, 64, 64\]"):
        f.expert_matrices(name, 4, (64, 64))


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("qwen3moe.expert_count", 4, r"ffn_gate_inp.*\(8, 64\).*\(4, 64\)"),
        ("qwen3moe.expert_feed_forward_length", 32, r"ffn_gate_exps.*\[8, 64, 64\].*\[8, 32, 64\]"),
        ("qwen3moe.expert_used_count", 9, r"expert_used_count.*1\.\.8, found 9"),
    ],
)
def test_expert_metadata_that_disagrees_with_the_tensors_is_refused(key, value, match):
    f = read_gguf(TINY)
    meta = dict(f.metadata)
    meta[key] = value
    with pytest.raises(ModelFormatError, match=match):
        Transformer(spec_from_gguf(meta, "tiny"), ResidentStore(f, "tiny"), "tiny")


def test_footprint_counts_the_routed_experts():
    f = read_gguf(TINY)
    spec = spec_from_gguf(f.metadata, str(TINY))
    tr = Transformer(spec, ResidentStore(f, "tiny"), "tiny")
    fp = expert_footprint([layer.ffn for layer in tr.layers])
    assert fp.layers == 2
    assert fp.per_expert == 3 * 64 * 64 * 4  # three f32 64 x 64 matrices
    exps = [n for n in f.tensor_names() if "_exps." in n]
    assert fp.total == sum(f.tensor(n).nbytes for n in exps)
    # the warm-up finds the experts' formats through weight_matrices (generate/engine.py)
    names = {t.name for t in tr.layers[1].ffn.weight_matrices()}
    assert {"blk.1.ffn_gate_inp.weight", "blk.1.ffn_down_exps.weight[0]"} <= names
