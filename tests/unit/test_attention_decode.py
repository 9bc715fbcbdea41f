"""The split-position decode attention kernel against the float64 reference, and batched
rows against single ones bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.ops import attention as A
from edgerun.ops import attention_decode as D
from edgerun.ops._simd import SOFTMAX_FLUSH


def _caches(rng, hkv, nctx, hd, kv):
    k = rng.standard_normal((hkv, nctx, hd)).astype(np.float32)
    v = rng.standard_normal((hkv, nctx, hd)).astype(np.float32)
    if kv == "f16":
        return k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
    return k, v


def _f32(a):
    return a.view(np.float16).astype(np.float32) if a.dtype == np.uint16 else a


@pytest.mark.parametrize("kv", ["f32", "f16"])
@pytest.mark.parametrize(
    "hq,hkv,hd,pos,window",
    [
        (9, 3, 64, 0, 0),  # one key
        (9, 3, 64, 15, 0),  # one full 16-key block
        (9, 3, 64, 16, 0),  # a block of one
        (14, 2, 64, D.MIN_CHUNK - 1, 0),  # one chunk of MIN_CHUNK
        (14, 2, 64, D.MIN_CHUNK, 0),  # a second chunk of one key
        (14, 2, 64, 8 * D.CHUNK - 1, 0),  # the largest chunks
        (12, 2, 128, 3 * D.CHUNK + 40, 0),  # several chunks, GQA group of 6
        (4, 1, 256, 700, 512),  # sliding window, one KV head
        (8, 8, 64, 300, 0),  # no grouping
    ],
)
def test_attend_one_matches_reference(kv, hq, hkv, hd, pos, window):
    rng = np.random.default_rng(pos + hd)
    k, v = _caches(rng, hkv, pos + 20, hd, kv)
    q = (3 * rng.standard_normal((hq, hd))).astype(np.float32)
    out = np.empty((hq, hd), np.float32)
    D.attend_one(q, k, v, np.int64(pos), np.int64(window), np.float32(1 / np.sqrt(hd)), out)
    ref = A.attention_reference(q[None], _f32(k), _f32(v), pos, window)
    np.testing.assert_allclose(out.reshape(1, -1), ref, rtol=2e-5, atol=2e-5)


def test_attention_takes_it_for_one_token_and_the_old_kernel_elsewhere():
    rng = np.random.default_rng(0)
    for hd in (64, 80):  # 80: no copy of the split kernel, the one-row kernel answers
        k, v = _caches(rng, 2, 300, hd, "f32")
        q = rng.standard_normal((1, 6, hd)).astype(np.float32)
        got = A.attention(q, k, v, 250, 0)
        ref = A.attention_reference(q, k, v, 250, 0)
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    assert D.supports(64) and D.supports(128) and D.supports(256) and not D.supports(80)


def test_a_sharp_head_gets_exact_zero_weights_not_denormals():
    """Scores 10^4 below the maximum (Qwen2's large activations make such heads) give
    weight 0: the result is the top key's value exactly."""
    rng = np.random.default_rng(1)
    k, v = _caches(rng, 1, 64, 64, "f32")
    q = np.zeros((1, 64), np.float32)
    q[0, 0] = 1.0
    k[0, :, 0] = -1e4
    k[0, 7, 0] = 1e4  # key 7 dominates by 2e4 * 0.125 >> -SOFTMAX_FLUSH
    assert 2e4 / 8 > -SOFTMAX_FLUSH
    out = np.empty((1, 64), np.float32)
    D.attend_one(q, k, v, np.int64(40), np.int64(0), np.float32(0.125), out)
    assert np.array_equal(out[0], v[0, 7])


@pytest.mark.parametrize("kv", ["f32", "f16"])
def test_batched_rows_equal_single_rows_bit_for_bit(kv):
    """Sequences of unequal lengths (one chunk, several, a partial block) in one batched
    call give each exactly what it gets alone."""
    rng = np.random.default_rng(2)
    hq, hkv, hd, layers = 14, 2, 64, 2
    starts = np.array([5, 3 * D.CHUNK + 17, D.CHUNK, 100], np.int64)
    nctx = int(starts.max()) + 8
    ks, vs = [], []
    for _ in starts:
        k, v = _caches(rng, layers * hkv, nctx, hd, kv)
        ks.append(k.reshape(layers, hkv, nctx, hd))
        vs.append(v.reshape(layers, hkv, nctx, hd))
    q = rng.standard_normal((len(starts), hq, hd)).astype(np.float32)
    kn = np.zeros((len(starts), hkv, hd), ks[0].dtype)
    for b, s in enumerate(starts):  # the batched call stores these at each position
        kn[b] = ks[b][1, :, s]
    vn = np.stack([vs[b][1, :, s] for b, s in enumerate(starts)])
    batch = A.BatchAttention(ks, vs, list(starts))
    out = np.empty((len(starts), hq * hd), np.float32)
    batch(1, q, _f32(kn), _f32(vn), 0, out)
    for b, s in enumerate(starts):
        one = np.empty((hq, hd), np.float32)
        D.attend_one(q[b], ks[b][1], vs[b][1], np.int64(s), np.int64(0),
                     np.float32(1 / np.sqrt(hd)), one)  # fmt: skip
        assert np.array_equal(out[b], one.reshape(-1)), b


def test_batched_rows_of_another_head_size_take_the_one_row_kernel():
    """Head size 80 (no split-kernel copy): BatchAttention's rows equal `attention` on
    each cache alone, as the bound and general decode paths need."""
    rng = np.random.default_rng(3)
    hq, hkv, hd = 4, 2, 80
    starts = [3, 40]
    ks = [rng.standard_normal((1, hkv, 64, hd)).astype(np.float32) for _ in starts]
    vs = [rng.standard_normal((1, hkv, 64, hd)).astype(np.float32) for _ in starts]
    q = rng.standard_normal((2, hq, hd)).astype(np.float32)
    kn = np.stack([ks[b][0, :, s] for b, s in enumerate(starts)])
    vn = np.stack([vs[b][0, :, s] for b, s in enumerate(starts)])
    out = np.empty((2, hq * hd), np.float32)
    A.BatchAttention(ks, vs, starts)(0, q, kn, vn, 0, out)
    for b, s in enumerate(starts):
        one = A.attention(q[b : b + 1], ks[b][0], vs[b][0], s, 0)
        assert np.array_equal(out[b], one[0]), b
