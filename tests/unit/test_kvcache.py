"""KV cache: storage semantics and resident memory proportional to the tokens held."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import psutil
import pytest

from edgerun.errors import ContextOverflowError, InvalidArgumentError
from edgerun.model.kvcache import KVCache, lazy_zeros


def _spec(n_layers: int = 4, n_kv_heads: int = 2, head_dim: int = 64) -> SimpleNamespace:
    """The three ModelSpec fields a cache is sized by."""
    return SimpleNamespace(n_layers=n_layers, n_kv_heads=n_kv_heads, head_dim=head_dim)


def test_lazy_zeros_is_zeroed_and_writable() -> None:
    a = lazy_zeros((3, 5, 7), np.float32)
    assert a.shape == (3, 5, 7) and a.dtype == np.float32
    assert a.flags.writeable and a.flags.c_contiguous
    assert not a.any()
    a[1, 2, 3] = 4.5
    assert a.sum() == pytest.approx(4.5)


def test_store_and_read_back() -> None:
    cache = KVCache(_spec(), 16)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((3, 2, 64)).astype(np.float32)
    v = rng.standard_normal((3, 2, 64)).astype(np.float32)
    cache.store(1, 4, k, v)
    np.testing.assert_array_equal(cache.k[1, :, 4:7], k.transpose(1, 0, 2))
    np.testing.assert_array_equal(cache.v[1, :, 4:7], v.transpose(1, 0, 2))
    assert not cache.k[0].any() and not cache.k[1, :, :4].any()


def test_f16_cache_stores_rounded_half_bits() -> None:
    cache = KVCache(_spec(), 16, "f16")
    assert cache.k.dtype == np.uint16 and cache.nbytes == KVCache.bytes_for(_spec(), 16, "f16")
    assert KVCache.bytes_for(_spec(), 16, "f16") * 2 == KVCache.bytes_for(_spec(), 16)
    rng = np.random.default_rng(2)
    k = (rng.standard_normal((2, 2, 64)) * 100).astype(np.float32)
    v = rng.standard_normal((2, 2, 64)).astype(np.float32)
    cache.store(0, 3, k, v)
    got = cache.k[0, :, 3:5].view(np.float16)
    np.testing.assert_array_equal(got, k.astype(np.float16).transpose(1, 0, 2))
    np.testing.assert_allclose(got.astype(np.float32), k.transpose(1, 0, 2), rtol=1e-3)


def test_unknown_kv_type_is_named() -> None:
    with pytest.raises(InvalidArgumentError, match="'q8'.*f32, f16"):
        KVCache(_spec(), 16, "q8")


def test_overflow_names_the_numbers() -> None:
    cache = KVCache(_spec(), 8)
    cache.tokens.extend(range(6))
    with pytest.raises(ContextOverflowError, match="8"):
        cache.check_fits(3)


@pytest.mark.parametrize("kv_type", ["f32", "f16"])
def test_resident_memory_follows_tokens_not_window(kv_type) -> None:
    """A window of hundreds of MiB holding 16 tokens must not make the whole window resident."""
    spec = _spec(n_layers=32, n_kv_heads=8, head_dim=128)  # 0.5-1 MiB per (layer, head) slab
    proc = psutil.Process()
    before = proc.memory_info().rss
    cache = KVCache(spec, 2048, kv_type)
    assert cache.nbytes == 2 * 32 * 8 * 2048 * 128 * cache.k.itemsize
    rng = np.random.default_rng(1)
    for layer in range(spec.n_layers):
        k = rng.standard_normal((16, 8, 128)).astype(np.float32)
        cache.store(layer, 0, k, k)
    grown = proc.memory_info().rss - before
    # 16 tokens x 2 x 32 layers x 8 heads x 512 B = 4 MiB of data; allow page rounding.
    assert grown < 64 * 2**20, f"RSS grew {grown / 2**20:.0f} MiB for 16 cached tokens"
