"""The attention scores' tanh softcap (Gemma 2) in every attention kernel:
prefill in register tiles, the one-row kernel, one token's split-position decode and
batched decode all agree with the float64 reference, and the cap changes the result."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.ops.attention import BatchAttention, attention, attention_reference

HQ, HKV, HD, N = 4, 2, 64, 40


def _qkv(seed: int = 0):
    rng = np.random.default_rng(seed)
    # large scores, so that a cap of 2 bends most of them
    q = rng.normal(0, 1.0, (N, HQ, HD)).astype(np.float32)
    k = rng.normal(0, 1.0, (HKV, N, HD)).astype(np.float32)
    v = rng.normal(0, 1.0, (HKV, N, HD)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize("window", [0, 7])
@pytest.mark.parametrize("softcap", [0.0, 0.5, 2.0])
def test_every_kernel_caps_the_scores(softcap, window):
    q, k, v = _qkv()
    ref = attention_reference(q, k, v, 0, window, softcap)
    # a prompt of N rows: the tiled kernel (head_dim 64)
    tiled = attention(q, k, v, 0, window, softcap=softcap)
    assert np.abs(tiled - ref).max() < 2e-5
    # one decode token at each position: the split-position kernel
    for pos in (0, 5, N - 1):
        one = attention(q[pos : pos + 1], k, v, pos, window, softcap=softcap)
        assert np.abs(one - ref[pos]).max() < 2e-5
    # a head size the decode kernel does not take: the one-row kernel
    q48, k48, v48 = q[..., :48].copy(), k[..., :48].copy(), v[..., :48].copy()
    ref48 = attention_reference(q48, k48, v48, 0, window, softcap)
    row = attention(q48[N - 1 : N], k48, v48, N - 1, window, softcap=softcap)
    assert np.abs(row - ref48[N - 1]).max() < 2e-5
    # three sequences' decode rows in one batched call, each against its own cache
    starts = [N - 1, 20, 3]
    ks, vs = [], []
    for _ in starts:
        kc, vc = np.zeros((1, HKV, N, HD), np.float32), np.zeros((1, HKV, N, HD), np.float32)
        kc[0], vc[0] = k, v
        ks.append(kc)
        vs.append(vc)
    batch = BatchAttention(ks, vs, starts)
    qb = np.stack([q[p] for p in starts])
    kb = np.stack([k[:, p] for p in starts])
    vb = np.stack([v[:, p] for p in starts])
    out = np.empty((3, HQ * HD), np.float32)
    batch(0, qb, kb, vb, window, out, softcap)
    for b, p in enumerate(starts):
        assert np.abs(out[b] - ref[p]).max() < 2e-5


def test_the_cap_changes_the_result():
    q, k, v = _qkv(1)
    plain = attention(q, k, v, 0)
    capped = attention(q, k, v, 0, softcap=1.0)
    assert np.abs(plain - capped).max() > 1e-2
