"""Key scales of q8_0 / q4_0 caches (model/kvcache.key_scale): the cache stores k / s and
every query is multiplied by s, powers of two per channel that balance the queries' and
the keys' energies, so q . k is unchanged and the blocks' error lands where queries are
small."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgerun.model.kvcache import KVCache, group_scales, key_scale
from edgerun.ops.attention import BatchAttention, attention, cache_values
from edgerun.ops.kv_blocks import rotate_rows

FAMILIES = Path(__file__).resolve().parents[1] / "data" / "families"


@pytest.mark.parametrize("neox", [True, False])
def test_scales_are_powers_of_two_one_per_rope_pair_balancing_the_energies(neox):
    rng = np.random.default_rng(0)
    hkv, hd = 2, 64
    eq = rng.uniform(0.01, 100, (hkv, hd))
    ek = rng.uniform(0.01, 100, (hkv, hd))
    ek[0, :4] = 0.0  # a dead channel takes scale 1
    s = key_scale(eq, ek, neox)
    assert s.dtype == np.float32 and s.shape == (hkv, hd)
    np.testing.assert_array_equal(np.exp2(np.round(np.log2(s))), s)
    half = hd // 2
    pair = (
        (np.arange(half), np.arange(half) + half)
        if neox
        else (np.arange(0, hd, 2), np.arange(1, hd, 2))
    )
    np.testing.assert_array_equal(s[:, pair[0]], s[:, pair[1]])
    pq = (eq[:, pair[0]] + eq[:, pair[1]]) / 2
    pk = (ek[:, pair[0]] + ek[:, pair[1]]) / 2
    live = (pq > 0) & (pk > 0)
    # the scaled sides' energies within a factor 2^2 of each other (log2 s rounded)
    sp = s[:, pair[0]].astype(np.float64)
    balance = np.log2(pk[live] / sp[live] ** 2) - np.log2(pq[live] * sp[live] ** 2)
    assert np.abs(balance).max() <= 2.0 + 1e-9
    if not neox:  # channels 0..3 are two whole pairs without energy: scale 1
        np.testing.assert_array_equal(s[0, :4], 1.0)


def test_scaled_and_rotated_scores_equal_the_plain_ones():
    """(q s) . (k / s) equals q . k product by product (powers of two), and the rotation
    the blocks hold (kv_blocks: R q . R k) keeps it to float rounding."""
    rng = np.random.default_rng(1)
    n, hd = 64, 128
    q = (rng.standard_normal((n, hd)) * rng.uniform(0.1, 30, hd)).astype(np.float32)
    k = (rng.standard_normal((n, hd)) * rng.uniform(0.1, 30, hd)).astype(np.float32)
    s = np.exp2(rng.integers(-6, 7, hd)).astype(np.float32)
    np.testing.assert_array_equal((q * s)[:, None, :] * (k / s)[None], q[:, None, :] * k[None])
    rq, rk = q * s, k / s
    rotate_rows(rq)
    rotate_rows(rk)
    exact = q.astype(np.float64) @ k.T.astype(np.float64)
    got = rq.astype(np.float64) @ rk.T.astype(np.float64)
    # float32 butterflies round each product to about eps * log2(hd) of |q s| |k / s|
    norms = np.linalg.norm(q * s, axis=1)[:, None] * np.linalg.norm(k / s, axis=1)[None]
    assert (np.abs(got - exact) <= 1e-6 * norms).all()


def _skewed(rng, n, heads, hd, big):
    """Rows [n, heads, hd] of unit noise times 30 on the channels `big`, 1 elsewhere."""
    w = np.ones(hd, np.float32)
    w[big] = 30.0
    return (rng.standard_normal((n, heads, hd)) * w).astype(np.float32)


@pytest.mark.parametrize("kv", ["q8_0", "q4_0"])
def test_a_scaled_quantised_cache_attends_closer_to_the_exact_keys(kv):
    """Keys large on channels where queries are small and the reverse (Gemma 3's q and k
    norm weights): blocks of k / s, queries times s, attend several times closer to the
    exact attention than blocks of k, in BatchAttention's kernel and one by one."""
    rng = np.random.default_rng(2)
    hq, hkv, hd, length = 4, 2, 64, 48
    pairs = lambda c: np.r_[c, c + hd // 2]  # noqa: E731  (NeoX RoPE pairs)
    k = _skewed(rng, length, hkv, hd, pairs(np.arange(0, 8)))
    q = _skewed(rng, 2, hq, hd, pairs(np.arange(8, 16))) * np.float32(0.1)
    v = rng.standard_normal((length, hkv, hd)).astype(np.float32)
    eq = (q.astype(np.float64).reshape(2, hkv, hq // hkv, hd) ** 2).mean((0, 2))
    scale = key_scale(eq, (k.astype(np.float64) ** 2).mean(0), neox=True)[None]  # a layer
    assert scale.max() > 1 > scale.min()
    np.testing.assert_array_equal(group_scales(scale[0], hq)[::2], scale[0])
    exact = attention(q[:1], k.transpose(1, 0, 2), v.transpose(1, 0, 2), length - 1)
    dtype = {"q8_0": np.int8, "q4_0": np.uint8}[kv]
    width = hd // 32 * {"q8_0": 34, "q4_0": 18}[kv]
    errs = {}
    for name, s in (("plain", None), ("scaled", scale)):
        got = []
        for n_seq in (2, 1):  # the batched kernel, then one sequence's own call
            ks = [np.zeros((1, hkv, length, width), dtype) for _ in range(n_seq)]
            vs = [np.zeros((1, hkv, length, hd), np.float32) for _ in range(n_seq)]
            stored = k[:-1] if s is None else k[:-1] / s[0]
            for a, b in zip(ks, vs):
                a[0, :, : length - 1] = cache_values(stored.transpose(1, 0, 2), dtype)
                b[0, :, : length - 1] = v[:-1].transpose(1, 0, 2)
            batch = BatchAttention(ks, vs, [length - 1] * n_seq, None, [s] * n_seq)
            assert batch.batched == (n_seq > 1)
            out = np.zeros((n_seq, hq * hd), np.float32)
            k_new, v_new = (np.repeat(a[-1:], n_seq, axis=0) for a in (k, v))
            batch(0, np.repeat(q[:1], n_seq, axis=0), k_new, v_new, 0, out)
            np.testing.assert_array_equal(out[1:], out[:1].repeat(n_seq - 1, 0))
            got.append(out[:1])
        np.testing.assert_allclose(got[0], got[1], rtol=0, atol=1e-5)
        errs[name] = float(np.abs(got[0] - exact).max())
    assert errs["scaled"] < errs["plain"] / 3, errs


@pytest.fixture(scope="module")
def qwen2():
    """The tiny Qwen2 reference model (k bias: keys centred and scaled)."""
    import edgerun

    m = edgerun.load(FAMILIES / "qwen2" / "f32.gguf", n_ctx=64, threads=1)
    yield m
    m.close()


def test_a_model_scales_only_its_quantised_keys_and_its_caches_share_them(qwen2):
    tr = qwen2.transformer
    s = tr.spec
    scales = tr.key_scales
    assert scales is not None and scales.shape == (s.n_layers, s.n_kv_heads, s.head_dim)
    assert tr.key_scales is scales  # computed once
    for kv_type in ("f32", "f16", "f16/q8_0"):
        assert tr.new_cache(8, kv_type).key_scale is None
    assert KVCache(s, 8, "q8_0").key_scale is None  # a cache not made by the model
    q4 = tr.new_cache(8, "q4_0")
    assert q4.key_scale is scales and q4.key_scale_exponents == np.log2(scales).tolist()
    q = np.ones((3, s.n_heads, s.head_dim), np.float32)
    np.testing.assert_array_equal(q4.scaled_queries(1, q), q * group_scales(scales[1], s.n_heads))
    assert tr.new_cache(8, "f16").scaled_queries(1, q) is q


def test_a_q8_0_cache_follows_the_f16_logits_prompt_and_decode(qwen2):
    """Teacher-forced logits of the tiny model on a q8_0 cache (centred, scaled, rotated
    keys; rotated values) stay near the f16 cache's, in the prefill kernels and the bound
    decode step: a query left unscaled or unrotated would score every key wrong. (q4_0 on
    this random model's flat logits flips near-ties; the BatchAttention test above checks
    q4_0's scores.)"""
    kv = "q8_0"
    tr = qwen2.transformer
    ids = qwen2.tokenize("def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n")[:24]
    out = {}
    for t in ("f16", kv):
        c = tr.new_cache(32, t)
        rows = [np.asarray(tr.forward(ids[:16], c, all_logits=True))]
        rows += [np.asarray(tr.forward([i], c)).reshape(1, -1) for i in ids[16:]]
        out[t] = np.concatenate(rows)
    ref, got = out["f16"], out[kv]
    spread = ref.std()
    assert np.abs(got - ref).max() < 0.5 * spread, (np.abs(got - ref).max(), spread)
    assert (got.argmax(1) == ref.argmax(1)).mean() >= 0.9
