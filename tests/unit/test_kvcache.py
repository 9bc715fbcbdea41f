"""KV cache: storage semantics and resident memory proportional to the tokens held."""

from __future__ import annotations

from fractions import Fraction
from types import SimpleNamespace

import numpy as np
import psutil
import pytest

from edgerun.errors import ContextOverflowError, InvalidArgumentError
from edgerun.model.kvcache import KVCache, lazy_zeros


def _spec(n_layers: int = 4, n_kv_heads: int = 2, head_dim: int = 64) -> SimpleNamespace:
    """The ModelSpec fields a cache is sized by (every layer attends: no recurrent state)."""
    return SimpleNamespace(
        n_layers=n_layers,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        attention_layers=tuple(range(n_layers)),
        recurrent_layers=(),
    )


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


@pytest.mark.parametrize("kv_type, ratio", [("q8_0", Fraction(34, 64)), ("q4_0", Fraction(18, 64))])
def test_quantised_cache_bytes_are_exact_fractions_of_f16(kv_type, ratio) -> None:
    """q8_0 stores 34 bytes per 32 values, q4_0 18, f16 64: 0.53x and 0.28x of f16's."""
    for head_dim in (64, 128, 256):
        spec = _spec(n_layers=3, n_kv_heads=2, head_dim=head_dim)
        f16, q = KVCache(spec, 40, "f16"), KVCache(spec, 40, kv_type)
        assert Fraction(q.nbytes, f16.nbytes) == ratio
        assert q.nbytes == KVCache.bytes_for(spec, 40, kv_type)
        assert Fraction(q.position_bytes, f16.position_bytes) == ratio
    mixed = KVCache(_spec(), 40, f"{kv_type}/f16")
    assert mixed.k_type == kv_type and mixed.v_type == "f16"
    half = KVCache.bytes_for(_spec(), 40, "f16") // 2
    assert mixed.nbytes == KVCache.bytes_for(_spec(), 40, mixed.kv_type) == half * (1 + ratio)


@pytest.mark.parametrize("kv_type", ["q8_0", "q4_0"])
def test_quantised_cache_stores_ggml_blocks(kv_type) -> None:
    """Rows are ggml's blocks of the rotated values R x (quant/legacy's reference
    quantiser; ops/kv_blocks.rotate_rows applies R): q8_0's byte for byte, q4_0's in
    ggml's layout with a scale no worse than ggml's in any block."""
    from edgerun.ops.kv_blocks import rotate_rows
    from edgerun.quant.legacy import Q4_0, Q8_0

    fmt = {"q8_0": Q8_0, "q4_0": Q4_0}[kv_type]
    cache = KVCache(_spec(), 16, kv_type)
    rng = np.random.default_rng(3)
    k = (rng.standard_normal((3, 2, 64)) * 10).astype(np.float32)
    v = rng.standard_normal((3, 2, 64)).astype(np.float32)
    v[1, 0] = 0  # an all-zero row: scale 0
    cache.store(2, 5, k, v)
    for got, x in ((cache.k, k), (cache.v, v)):
        rx = x.transpose(1, 0, 2).reshape(-1, 64).copy()
        rotate_rows(rx)
        want = fmt.quantize_blocks(rx.reshape(-1, 32)).reshape(2, 3, -1)
        rows = got[2, :, 5:8].view(np.uint8)
        if kv_type == "q8_0":
            assert np.array_equal(rows, want)
        else:
            err = ((fmt.dequantize_blocks(rows.reshape(-1, 18)) - rx.reshape(-1, 32)) ** 2).sum(1)
            ggml = ((fmt.dequantize_blocks(want.reshape(-1, 18)) - rx.reshape(-1, 32)) ** 2).sum(1)
            assert np.all(err <= ggml * 1.0001 + 1e-30)
        assert not got[2, :, :5].any() and not got[1].any()


def test_quantised_types_refuse_head_dims_their_blocks_do_not_divide() -> None:
    from edgerun.errors import UnsupportedError

    with pytest.raises(UnsupportedError, match="K cache type q8_0.*head_dim=48"):
        KVCache(_spec(head_dim=48), 16, "q8_0")
    with pytest.raises(UnsupportedError, match="V cache type q4_0.*head_dim=80"):
        KVCache(_spec(head_dim=80), 16, "f16/q4_0")
    KVCache(_spec(head_dim=48), 16, "f16")  # f16 / f32 take any head_dim


def test_kv_type_asked_spells_keys_and_values_apart() -> None:
    from edgerun.model.kvcache import kv_type_asked

    assert kv_type_asked(None) is None
    assert kv_type_asked("q8_0") == "q8_0"
    assert kv_type_asked(None, "q8_0") == "q8_0/f16"  # llama.cpp's default for the other
    assert kv_type_asked("f32", None, "q4_0") == "f32/q4_0"
    assert kv_type_asked("f16", "q8_0", "q8_0") == "q8_0"
    with pytest.raises(InvalidArgumentError, match="'q5_0'"):
        kv_type_asked(None, "q5_0")
