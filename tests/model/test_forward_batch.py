"""Batched decode (Transformer.forward_batch, ops.attention.BatchAttention): every row
must be the single-sequence result bit for bit, whatever the caches hold."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.model.kvcache import KVCache
from edgerun.ops.attention import BatchAttention, attention, attention_reference


def _caches(hkv: int, hd: int, lengths: list[int], dtypes: list[str], rng) -> list[tuple]:
    out = []
    for n, dt in zip(lengths, dtypes):
        k = rng.standard_normal((2, hkv, 40, hd)).astype(np.float32)
        v = rng.standard_normal((2, hkv, 40, hd)).astype(np.float32)
        if dt == "f16":
            k, v = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
        out.append((k, v, n))
    return out


@pytest.mark.parametrize("window", [0, 5])
@pytest.mark.parametrize("dtypes", [["f32"] * 4, ["f16"] * 4, ["f32", "f16", "f16", "f32"]])
def test_batch_attention_equals_one_sequence_at_a_time(window, dtypes):
    rng = np.random.default_rng(7)
    hq, hkv, hd = 6, 2, 40  # hd not a multiple of 16: the tail path too
    lengths = [0, 3, 17, 38]
    caches = _caches(hkv, hd, lengths, dtypes, rng)
    solo = [(k.copy(), v.copy(), n) for k, v, n in caches]
    q = rng.standard_normal((4, hq, hd)).astype(np.float32)
    kn = rng.standard_normal((4, hkv, hd)).astype(np.float32)
    vn = rng.standard_normal((4, hkv, hd)).astype(np.float32)
    attend = BatchAttention([c[0] for c in caches], [c[1] for c in caches], lengths)
    out = np.empty((4, hq * hd), np.float32)
    got = attend(1, q, kn, vn, window, out)
    for b, (k, v, n) in enumerate(solo):
        kb, vb = kn[b], vn[b]
        if k.dtype == np.uint16:
            kb, vb = kb.astype(np.float16).view(np.uint16), vb.astype(np.float16).view(np.uint16)
        k[1, :, n], v[1, :, n] = kb, vb
        assert np.array_equal(caches[b][0], k) and np.array_equal(caches[b][1], v)
        want = attention(q[b : b + 1], k[1], v[1], n, window)[0]
        assert np.array_equal(got[b], want), f"row {b} ({dtypes[b]}, {n} cached)"
        ref = attention_reference(q[b : b + 1], k[1], v[1], n, window)[0]
        np.testing.assert_allclose(got[b], ref, atol=2e-5, rtol=1e-4)


def test_one_sequence_takes_the_single_kernel_with_the_same_result():
    rng = np.random.default_rng(3)
    ((k, v, n),) = _caches(2, 32, [9], ["f16"], rng)
    k0, v0 = k.copy(), v.copy()
    q = rng.standard_normal((1, 4, 32)).astype(np.float32)
    kn = rng.standard_normal((1, 2, 32)).astype(np.float32)
    got = BatchAttention([k], [v], [n])(0, q, kn, kn, 0, np.empty((1, 128), np.float32))
    k0[0, :, n] = v0[0, :, n] = kn[0].astype(np.float16).view(np.uint16)
    assert np.array_equal(k, k0) and np.array_equal(v, v0)
    assert np.array_equal(got[0], attention(q, k0[0], v0[0], n)[0])


def test_batch_attention_rejects_caches_of_other_models():
    a = np.zeros((2, 2, 8, 16), np.float32)
    b = np.zeros((2, 4, 8, 16), np.float32)
    with pytest.raises(ValueError, match="head layout"):
        BatchAttention([a, b], [a, b], [0, 0])


def test_batch_attention_never_writes_outside_the_caches():
    """The kernel writes through the caches' addresses: a position or layer outside them
    is refused before it runs."""
    ks = [np.zeros((2, 2, 8, 16), np.float32) for _ in range(2)]
    vs = [np.zeros((2, 2, 8, 16), np.float32) for _ in range(2)]
    with pytest.raises(ValueError, match="positions"):
        BatchAttention(ks, vs, [3, 8])
    attend = BatchAttention(ks, vs, [3, 7])
    q, kv = np.zeros((2, 4, 16), np.float32), np.ones((2, 2, 16), np.float32)
    with pytest.raises(ValueError, match="layer 2"):
        attend(2, q, kv, kv, 0, np.empty((2, 64), np.float32))
    attend(1, q, kv, kv, 0, np.empty((2, 64), np.float32))
    assert ks[0][1, :, 3].all() and ks[1][1, :, 7].all() and ks[0][0].sum() == 0


@pytest.mark.parametrize(
    "kv_types",
    [("f32",) * 3, ("f16",) * 3, ("f16", "f32", "f16"), ("q8_0",) * 3, ("q4_0", "q8_0", "q4_0")],
)
def test_forward_batch_rows_equal_forward_on_the_real_model(smollm2, kv_types):
    tr = smollm2.transformer
    text = "The lighthouse keeper climbed the stairs every evening and watched the boats."
    ids = smollm2.tokenize(text)
    prefixes = [ids[:5], ids[2:11], ids[1:3]]
    nxt = [ids[5], ids[11], ids[3]]

    def prefilled() -> list[KVCache]:
        caches = [tr.new_cache(32, t) for t in kv_types]  # quantised keys centred, scaled
        for p, c in zip(prefixes, caches):
            tr.forward(p, c)
        return caches

    batched = prefilled()
    rows = tr.forward_batch(nxt, batched)
    alone = prefilled()
    for b, (t, c) in enumerate(zip(nxt, alone)):
        assert np.array_equal(rows[b], tr.forward([t], c)), f"row {b} ({kv_types[b]})"
        assert np.array_equal(batched[b].k, c.k) and np.array_equal(batched[b].v, c.v)
        assert batched[b].tokens == c.tokens
