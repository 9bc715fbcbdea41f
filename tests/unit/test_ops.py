"""Small kernels held to their numpy references on random and edge shapes."""

import numpy as np
import pytest

from edgerun.ops.activations import glu, glu_reference
from edgerun.ops.attention import attention, attention_reference
from edgerun.ops.norm import rmsnorm, rmsnorm_reference
from edgerun.ops.rope import rope_inplace, rope_reference, rope_tables

rng = np.random.default_rng(0)


@pytest.mark.parametrize("shape", [(1, 8), (3, 576), (17, 64), (5,)])
def test_rmsnorm(shape):
    x = rng.standard_normal(shape).astype(np.float32) * 3
    w = rng.standard_normal(shape[-1]).astype(np.float32)
    np.testing.assert_allclose(
        rmsnorm(x, w, 1e-5), rmsnorm_reference(x, w, 1e-5), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize("neox", [False, True])
@pytest.mark.parametrize("n,heads,hd,rope_dim", [(1, 1, 2, 2), (5, 3, 64, 64), (4, 2, 64, 32)])
def test_rope(neox, n, heads, hd, rope_dim):
    cos, sin = rope_tables(64, rope_dim, 10000.0)
    x = rng.standard_normal((n, heads, hd)).astype(np.float32)
    pos = rng.integers(0, 64, n).astype(np.int64)
    ref = rope_reference(x, pos, cos, sin, neox)
    rope_inplace(x, pos, cos, sin, neox)
    np.testing.assert_allclose(x, ref, rtol=1e-5, atol=1e-5)


def test_rope_position_zero_is_identity():
    cos, sin = rope_tables(8, 16, 10000.0)
    x = rng.standard_normal((1, 2, 16)).astype(np.float32)
    y = x.copy()
    rope_inplace(y, np.zeros(1, np.int64), cos, sin, False)
    np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_glu(kind):
    g = rng.standard_normal((3, 100)).astype(np.float32) * 4
    u = rng.standard_normal((3, 100)).astype(np.float32)
    np.testing.assert_allclose(glu(g, u, kind), glu_reference(g, u, kind), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_glu_saturates_without_overflow(kind):
    """Large |g| (exp overflows in float32) must give x * u or 0, never nan/inf: on the
    16-lane vector path (the first 16 columns) and on the scalar tail (the last 8)."""
    row = [-1e4, -200.0, -89.0, -88.0, -60.0, -0.0, 0.0, 60.0, 87.5, 88.5, 200.0, 1e4]
    g = np.array([row * 2], dtype=np.float32)
    u = np.full_like(g, 0.5)
    out = glu(g, u, kind)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, glu_reference(g, u, kind), rtol=1e-6, atol=1e-6)
    # the parallel kernel (large inputs) agrees with the serial one
    big_g = np.tile(g, (8192, 1))
    np.testing.assert_allclose(glu(big_g, np.tile(u, (8192, 1)), kind)[-1], out[0])


@pytest.mark.parametrize(
    "n,start,hq,hkv,hd,window",
    [
        (1, 0, 1, 1, 8, 0),
        (1, 9, 9, 3, 64, 0),
        (7, 0, 4, 1, 16, 0),
        (5, 3, 4, 2, 32, 0),
        (6, 10, 4, 2, 16, 4),
    ],
)
def test_attention(n, start, hq, hkv, hd, window):
    L = start + n
    q = rng.standard_normal((n, hq, hd)).astype(np.float32)
    k = rng.standard_normal((hkv, L + 3, hd)).astype(np.float32)
    v = rng.standard_normal((hkv, L + 3, hd)).astype(np.float32)
    out = attention(q, k, v, start, window)
    np.testing.assert_allclose(
        out, attention_reference(q, k, v, start, window), rtol=1e-4, atol=1e-5
    )


@pytest.mark.parametrize("hd", [8, 64, 72])
def test_attention_reads_an_f16_cache(hd):
    """f16 caches hold raw float16 bits (uint16); the kernel widens them exactly."""
    n, start, hq, hkv = 4, 6, 6, 2
    L = start + n
    q = rng.standard_normal((n, hq, hd)).astype(np.float32)
    k = rng.standard_normal((hkv, L, hd)).astype(np.float16)
    v = rng.standard_normal((hkv, L, hd)).astype(np.float16)
    out = attention(q, k.view(np.uint16), v.view(np.uint16), start)
    want = attention_reference(q, k.astype(np.float32), v.astype(np.float32), start)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(
        attention_reference(q, k.view(np.uint16), v.view(np.uint16), start), want, rtol=1e-6
    )


def test_attention_is_causal():
    q = rng.standard_normal((3, 2, 8)).astype(np.float32)
    k = rng.standard_normal((1, 3, 8)).astype(np.float32)
    v = rng.standard_normal((1, 3, 8)).astype(np.float32)
    a = attention(q, k, v, 0)
    k2, v2 = k.copy(), v.copy()
    k2[:, 2] += 5.0
    v2[:, 2] += 5.0
    b = attention(q, k2, v2, 0)
    np.testing.assert_array_equal(a[:2], b[:2])  # earlier queries never see a later key
    assert not np.allclose(a[2], b[2])


@pytest.mark.parametrize("hd,dtype", [(128, np.float32), (256, np.float16), (80, np.float16)])
def test_attention_vector_loads_on_strided_inputs_and_long_rows(hd, dtype):
    """The kernel loads 16 lanes at a time from flat offsets: views that are not
    C-contiguous (a query slice, a cache with padding) still give the reference result,
    and rows of 4-position blocks plus a remainder (start 37: 38 positions) are complete."""
    n, start, hq, hkv = 2, 37, 4, 2
    L = start + n
    q = rng.standard_normal((n, 2 * hq, hd)).astype(np.float32)[:, ::2]
    k = rng.standard_normal((hkv, L + 5, hd + 16)).astype(dtype)[:, :, :hd]
    v = rng.standard_normal((hkv, L + 5, hd + 16)).astype(dtype)[:, :, :hd]
    assert not (q.flags.c_contiguous or k.flags.c_contiguous)
    if dtype == np.float16:
        out = attention(q, k.view(np.uint16), v.view(np.uint16), start)
    else:
        out = attention(q, k, v, start)
    want = attention_reference(q, k.astype(np.float32), v.astype(np.float32), start)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize(
    "n,start,hq,hkv,hd,window,f16",
    [
        (2, 0, 4, 2, 64, 0, False),  # the smallest prefill: one tile, padding rows
        (5, 3, 9, 3, 64, 0, False),  # SmolLM2's group of 3: tiles span tokens
        (13, 70, 14, 2, 64, 0, True),  # Qwen2.5-0.5B's group of 7, f16 cache, > 64 keys
        (9, 130, 12, 2, 128, 0, False),  # Qwen2.5-1.5B's group of 6
        (6, 20, 4, 1, 256, 5, False),  # Gemma's 256-wide heads, a sliding window
        (33, 0, 6, 2, 64, 16, True),  # a window shorter than the prompt, from position 0
    ],
)
def test_tiled_prefill_attention(n, start, hq, hkv, hd, window, f16):
    """Several queries take the tiled kernel (4 query rows x 64 keys, vector softmax);
    every row matches the float64 reference over its own causal / window range."""
    from edgerun.ops import attention_tiled

    assert attention_tiled.supports(n, hd)
    L = start + n + 9  # cache rows past the prompt must not leak in
    q = rng.standard_normal((n, hq, hd)).astype(np.float32)
    k = (2 * rng.standard_normal((hkv, L, hd))).astype(np.float32)
    v = rng.standard_normal((hkv, L, hd)).astype(np.float32)
    if f16:
        k, v = k.astype(np.float16).view(np.uint16), v.astype(np.float16).view(np.uint16)
    out = attention(q, k, v, start, window)
    want = attention_reference(q, k, v, start, window)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=2e-5)


def test_tiled_prefill_attention_ignores_later_keys_and_extreme_scores():
    """Causality within a tile (rows of two tokens share it) and a score range past
    exp's float32 limits: large logits must not overflow, tiny weights not go NaN."""
    n, hq, hkv, hd = 3, 6, 2, 64
    q = (30 * rng.standard_normal((n, hq, hd))).astype(np.float32)
    k = (30 * rng.standard_normal((hkv, n, hd))).astype(np.float32)
    v = rng.standard_normal((hkv, n, hd)).astype(np.float32)
    a = attention(q, k, v, 0)
    assert np.isfinite(a).all()
    # scores of ~1e4 carry float32 rounding of ~1e-3 into the weights where two are close
    np.testing.assert_allclose(a, attention_reference(q, k, v, 0), rtol=1e-3, atol=1e-3)
    k2, v2 = k.copy(), v.copy()
    group = hq // hkv  # key 2 along its query heads' sum: it takes all of token 2's weight
    k2[:, 2] = 100 * q[2].reshape(hkv, group, hd).sum(axis=1)
    v2[:, 2] += 5.0
    b = attention(q, k2, v2, 0)
    assert np.isfinite(b).all()
    np.testing.assert_array_equal(a[:2], b[:2])  # earlier queries never see a later key
    want = np.repeat(v2[:, 2], group, axis=0).reshape(b[2].shape)  # outputs: [n, hq * hd]
    np.testing.assert_allclose(b[2], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(a[2], b[2])
