"""Key centring of q8_0 / q4_0 caches (model/kvcache.key_centre): a fixed vector taken
from every key of a layer and head moves each query's scores by one constant, which the
softmax removes; the centre is the k bias on the pairs RoPE barely turns."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgerun.model.kvcache import KVCache, key_centre
from edgerun.ops.attention import attention, cache_floats, cache_values
from edgerun.ops.rope import rope_reference, rope_tables

FAMILIES = Path(__file__).resolve().parents[1] / "data" / "families"


@pytest.mark.parametrize("neox", [True, False])
def test_the_centre_holds_the_slow_pairs_and_never_adds_an_offset(neox):
    """Slow pairs keep the bias, fast ones 0, dims RoPE does not turn the bias; at every
    trained position each pair of RoPE_p(bias) - c is no longer than the bias's pair."""
    rng = np.random.default_rng(1)
    hd, rope_dim, n = 64, 48, 2048
    bias = rng.normal(0, 30, (2, hd)).astype(np.float32)
    cos, sin = rope_tables(n, rope_dim, 1e5)
    c = key_centre(bias, cos, sin, n, neox)
    half = rope_dim // 2
    i0 = np.arange(half) if neox else np.arange(0, rope_dim, 2)
    i1 = i0 + half if neox else i0 + 1
    slow = np.arctan2(sin[1], cos[1]) * n < np.pi / 3
    assert 0 < slow.sum() < half  # both kinds of pair occur
    for i in (i0, i1):
        np.testing.assert_array_equal(c[:, i[slow]], bias[:, i[slow]])
        assert not c[:, i[~slow]].any()
    np.testing.assert_array_equal(c[:, rope_dim:], bias[:, rope_dim:])
    turned = rope_reference(np.broadcast_to(bias, (n, 2, hd)), np.arange(n), cos, sin, neox).astype(
        np.float64
    )
    off = turned - c
    pair = np.hypot(off[..., i0], off[..., i1])
    assert (pair <= np.hypot(bias[:, i0], bias[:, i1]) * (1 + 1e-5) + 1e-4).all()


def _keys(rng, n, hkv, hd, offset):
    """Keys [n, hkv, hd] of unit noise around a large constant offset on some columns."""
    k = rng.standard_normal((n, hkv, hd)).astype(np.float32)
    return k + offset


@pytest.mark.parametrize("n", [1, 24])  # decode kernel, tiled prefill
def test_centred_keys_give_the_same_attention(n):
    """f32 rows of k - c attend as the rows of k (scores shift by q . c per query)."""
    rng = np.random.default_rng(2)
    hq, hkv, hd, length = 4, 2, 64, 40
    offset = np.zeros((hkv, hd), np.float32)
    offset[:, 50:] = rng.normal(0, 20, (hkv, 14))
    k = _keys(rng, length, hkv, hd, offset).transpose(1, 0, 2).copy()
    v = rng.standard_normal((hkv, length, hd)).astype(np.float32)
    q = rng.standard_normal((n, hq, hd)).astype(np.float32)
    start = length - n
    plain = attention(q, k, v, start)
    centred = attention(q, k - offset[:, None, :], v, start)
    np.testing.assert_allclose(centred, plain, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_a_quantised_cache_of_centred_keys_keeps_the_rest(kv):
    """With a constant offset of 300 on a few columns (Qwen2.5's k bias), blocks of the
    keys keep little of the noise around it; blocks of k - c keep it as blocks of noise
    alone do, and attention on them is as close to the exact one."""
    rng = np.random.default_rng(3)
    hq, hkv, hd, length = 4, 2, 64, 48
    offset = np.zeros((hkv, hd), np.float32)
    offset[:, 60:] = 300.0
    k = _keys(rng, length, hkv, hd, offset).transpose(1, 0, 2).copy()
    v = rng.standard_normal((hkv, length, hd)).astype(np.float32)
    q = rng.standard_normal((1, hq, hd)).astype(np.float32)
    dtype = {"q8_0": np.int8, "q4_0": np.uint8}[kv]
    exact = attention(q, k, v, length - 1)
    plain = attention(q, cache_values(k, dtype), v, length - 1)
    centred = attention(q, cache_values(k - offset[:, None, :], dtype), v, length - 1)
    noise = k - offset[:, None, :]
    want = cache_floats(cache_values(noise, dtype), hd)
    np.testing.assert_array_equal(
        cache_floats(cache_values(k - offset[:, None, :], dtype), hd), want
    )
    err_plain, err_centred = np.abs(plain - exact).max(), np.abs(centred - exact).max()
    assert err_centred < err_plain / 4, (err_plain, err_centred)


@pytest.fixture(scope="module")
def qwen2():
    """The tiny Qwen2 reference model (k bias, RoPE base 1e6, 128-token context)."""
    import edgerun

    m = edgerun.load(FAMILIES / "qwen2" / "f32.gguf", n_ctx=64, threads=1)
    yield m
    m.close()


def test_a_model_with_a_k_bias_centres_only_its_quantised_keys(qwen2):
    tr = qwen2.transformer
    s = tr.spec
    centres = tr.key_centres
    assert centres is not None and centres.shape == (s.n_layers, s.n_kv_heads, s.head_dim)
    assert np.abs(centres).max() > 0
    assert tr.key_centres is centres  # computed once: every cache shares the array
    for kv_type in ("f32", "f16", "f16/q8_0"):
        assert tr.new_cache(8, kv_type).key_centre is None
    assert KVCache(s, 8, "q8_0").key_centre is None  # a cache not made by the model
    ids = qwen2.tokenize("def add(a, b):\n    return a + b\n")[:12]
    ref, q8 = tr.new_cache(16, "f32"), tr.new_cache(16, "q8_0/f16")
    assert q8.key_centre is centres and q8.key_centre_name == "k-bias-slow-rope/1"
    tr.forward(ids[:-2], ref)
    tr.forward(ids[:-2], q8)
    for t in ids[-2:]:  # the bound decode step's store
        tr.forward([t], ref)
        tr.forward([t], q8)
    n = len(ids)
    # layer 0's keys come from the embeddings alone, so both caches computed the same
    # ones: the q8_0 rows are the blocks of keys less the centre, prompt and decode rows
    scale = q8.key_scale[0][:, None, :]  # and over the key scale (test_key_scale.py)
    want = cache_values((ref.k[0, :, :n] - centres[0][:, None, :]) / scale, np.int8)
    np.testing.assert_array_equal(q8.k[0, :, :n], want)
    for li in range(s.n_layers):  # the centre added back gives the keys
        keys = ref.k[li, :, :n]
        err = np.abs(q8.key_floats(q8.k[li, :, :n], li) - keys).max()
        assert err < 0.02 * max(1.0, np.abs(keys).max()), (li, err)
