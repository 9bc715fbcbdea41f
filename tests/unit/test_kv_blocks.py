"""KV caches of q8_0 / q4_0 blocks (ops/kv_blocks.py): rows rotated (R x) then quantised
into ggml's blocks (q4_0's scale searched for the least error), every attention kernel
reading them in place against the float64 reference on the same dequantised values;
batched decode rows equal single ones bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.ops import attention as A
from edgerun.ops import attention_decode as D
from edgerun.ops import attention_tiled as T
from edgerun.ops.attention import cache_floats, cache_values
from edgerun.ops.kv_blocks import (
    dequantize_rows,
    quantize_rows,
    rotate_rows,
    rotation,
    row_width,
    unrotate_rows,
)
from edgerun.quant.legacy import Q4_0, Q8_0

TYPES = {"q8_0": np.dtype(np.int8), "q4_0": np.dtype(np.uint8)}


@pytest.mark.parametrize("hd", [256, 96])
def test_rotation_is_orthogonal_and_the_kernels_apply_it(hd):
    r = rotation(hd)
    assert np.allclose(r @ r.T, np.eye(hd), atol=1e-12)
    assert len(np.unique(np.abs(r[r != 0]))) == 1  # +-1/sqrt(G), G = 32 for 96
    x = np.random.default_rng(1).standard_normal((5, hd)).astype(np.float32)
    y = x.copy()
    rotate_rows(y)
    np.testing.assert_allclose(y, x @ r.T, rtol=1e-5, atol=1e-5)
    unrotate_rows(y)
    np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-5)


def test_rotation_spreads_a_channel_outlier():
    """A key channel far larger than the rest in every row (Qwen2.5's, from its k bias)
    sets its block's q4_0 scale; rotated, the other channels keep their resolution."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    x[:, 5] += 60.0
    rows = np.empty((64, row_width(TYPES["q4_0"], 128)), TYPES["q4_0"])
    quantize_rows(x, rows)
    back = cache_floats(rows, 128)
    plain = Q4_0.dequantize_blocks(Q4_0.quantize_blocks(x.reshape(-1, 32))).reshape(64, 128)
    rest = np.arange(32) != 5  # the outlier's block
    err = np.abs(back - x)[:, :32][:, rest].mean()
    assert err < 0.3 * np.abs(plain - x)[:, :32][:, rest].mean()


@pytest.mark.parametrize("kind", sorted(TYPES))
def test_rows_are_ggml_blocks_of_rotated_rows(kind):
    fmt = {"q8_0": Q8_0, "q4_0": Q4_0}[kind]
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((40, 128)) * 5).astype(np.float32)
    x[2, :32] = 0  # scale 0
    x[3, 32:64] = 1e-30  # a scale below f16's range
    rows = np.empty((40, row_width(TYPES[kind], 128)), TYPES[kind])
    quantize_rows(x, rows)
    rx = x.copy()
    rotate_rows(rx)
    ggml = fmt.quantize_blocks(rx.reshape(-1, 32))
    blocks = rows.view(np.uint8).reshape(ggml.shape)
    if kind == "q8_0":  # ggml's blocks byte for byte
        assert np.array_equal(blocks, ggml)
    else:  # ggml's layout; a scale of least squared error, no block worse than ggml's
        err = ((fmt.dequantize_blocks(blocks) - rx.reshape(-1, 32)) ** 2).sum(axis=1)
        err_ggml = ((fmt.dequantize_blocks(ggml) - rx.reshape(-1, 32)) ** 2).sum(axis=1)
        assert np.all(err <= err_ggml * 1.0001 + 1e-30)
        assert err.sum() < 0.95 * err_ggml.sum()
    back = np.empty((40, 128), np.float32)
    dequantize_rows(rows, back)
    stored = fmt.dequantize_blocks(blocks).reshape(40, 128)
    unrotate_rows(stored)
    assert np.array_equal(back, stored)
    err = np.abs(back - x).max(axis=1) / np.abs(x).max(axis=1).clip(1e-30)
    assert err.max() < {"q8_0": 0.01, "q4_0": 0.15}[kind]


def _cache(rng, hkv, nctx, hd, kv):
    x = rng.standard_normal((hkv, nctx, hd)).astype(np.float32)
    dtypes = {**TYPES, "f16": np.dtype(np.uint16)}
    return cache_values(x, dtypes[kv]) if kv in dtypes else x


@pytest.mark.parametrize("kv", ["q8_0", "q4_0", "q8_0/f16"])
@pytest.mark.parametrize(
    "n,hq,hkv,hd,start,window",
    [
        (1, 9, 3, 64, 0, 0),  # decode: one key
        (1, 14, 2, 64, 3 * D.CHUNK + 17, 0),  # decode: several chunks, a partial block
        (1, 4, 1, 256, 700, 512),  # decode: sliding window
        (1, 4, 2, 32, 50, 0),  # the one-row kernel (no split-kernel copy of 32)
        (37, 6, 2, 128, 60, 0),  # tiled prefill
        (9, 4, 1, 64, 100, 16),  # tiled prefill, sliding window
        (5, 4, 2, 96, 20, 0),  # prefill on the one-row kernel
    ],
)
def test_attention_on_quantised_caches_matches_reference(kv, n, hq, hkv, hd, start, window):
    k_type, v_type = (kv.split("/") * 2)[:2]
    rng = np.random.default_rng(start + hd + n)
    k = _cache(rng, hkv, start + n + 5, hd, k_type)
    v = _cache(rng, hkv, start + n + 5, hd, v_type)
    q = (2 * rng.standard_normal((n, hq, hd))).astype(np.float32)
    assert T.supports(n, hd) == (n > 1 and hd % 64 == 0)
    got = A.attention(q, k, v, start, window)
    ref = A.attention_reference(q, cache_floats(k, hd), cache_floats(v, hd), start, window)
    np.testing.assert_allclose(got, ref, rtol=3e-5, atol=3e-5)


@pytest.mark.parametrize("hd", [64, 32])
@pytest.mark.parametrize("kv", ["q4_0", "q8_0/f16"])
def test_batched_rows_equal_single_rows_bit_for_bit(kv, hd):
    """The batched call stores each sequence's new row and attends; each row equals the
    single-sequence kernel on that cache afterwards (hd 32: the one-row kernels)."""
    k_type, v_type = (kv.split("/") * 2)[:2]
    dtypes = {**TYPES, "f16": np.dtype(np.uint16)}
    rng = np.random.default_rng(4)
    hq, hkv, layers = 6, 2, 2
    starts = [5, 3 * D.CHUNK + 17, D.CHUNK, 100]
    nctx = max(starts) + 8
    ks, vs = [], []
    for _ in starts:
        x = rng.standard_normal((2, layers, hkv, nctx, hd)).astype(np.float32)
        ks.append(cache_values(x[0], dtypes[k_type]))
        vs.append(cache_values(x[1], dtypes[v_type]))
    q = rng.standard_normal((len(starts), hq, hd)).astype(np.float32)
    kn, vn = rng.standard_normal((2, len(starts), hkv, hd)).astype(np.float32)
    out = np.empty((len(starts), hq * hd), np.float32)
    batch = A.BatchAttention(ks, vs, starts)
    assert batch.batched
    batch(1, q, kn, vn, 0, out)
    for b, s in enumerate(starts):
        assert np.array_equal(ks[b][1, :, s], cache_values(kn[b], ks[b].dtype))
        assert np.array_equal(vs[b][1, :, s], cache_values(vn[b], vs[b].dtype))
        one = A.attention(q[b : b + 1], ks[b][1], vs[b][1], s, 0)
        assert np.array_equal(out[b], one[0]), b
