"""YaRN RoPE tables and the Mistral 3 metadata that turns them (and the attention
temperature) on: llama.cpp's rules, and hostile values refused with the field named."""

from __future__ import annotations

import math

import numpy as np
import pytest

from edgerun.arch import spec_from_gguf
from edgerun.errors import ModelFormatError, UnsupportedError
from edgerun.ops.rope import rope_tables, yarn_ramp


def _meta(arch: str = "mistral3", **extra) -> dict:
    a = arch
    meta = {
        "general.architecture": a,
        f"{a}.block_count": 2,
        f"{a}.context_length": 64,
        f"{a}.embedding_length": 64,
        f"{a}.feed_forward_length": 128,
        f"{a}.attention.head_count": 2,
        f"{a}.attention.head_count_kv": 1,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-5,
        f"{a}.vocab_size": 100,
        f"{a}.rope.scaling.type": "yarn",
        f"{a}.rope.scaling.factor": 4.0,
        f"{a}.rope.scaling.original_context_length": 16,
    }
    meta.update({f"{a}.{k}": v for k, v in extra.items()})
    return meta


def test_yarn_keeps_fast_frequencies_and_interpolates_slow_ones():
    dim, base = 32, 10000.0
    mix = yarn_ramp(dim, base, 16, 32.0, 1.0)
    assert mix[0] == 1.0 and mix[-1] == 0.0 and np.all(np.diff(mix) <= 0)
    plain_cos, plain_sin = rope_tables(64, dim, base)
    cos, sin = rope_tables(64, dim, base, yarn=(0.25, 16, 32.0, 1.0))
    scaled_cos, scaled_sin = rope_tables(64, dim, base, np.full(dim // 2, 4.0))
    fast, slow = mix == 1.0, mix == 0.0
    assert fast.any() and slow.any() and not (fast | slow).all()
    np.testing.assert_array_equal(cos[:, fast], plain_cos[:, fast])
    np.testing.assert_array_equal(cos[:, slow], scaled_cos[:, slow])
    # the blended pairs turn (at position 1) strictly between the two frequencies
    mid = ~(fast | slow)
    ang = np.arctan2(sin[1, mid], cos[1, mid])
    plain = np.arctan2(plain_sin[1, mid], plain_cos[1, mid])
    scaled = np.arctan2(scaled_sin[1, mid], scaled_cos[1, mid])
    assert np.all(scaled < ang) and np.all(ang < plain)


@pytest.mark.parametrize(
    "extra, want",
    [
        ({"rope.scaling.yarn_log_multiplier": 1.0}, 1.0),  # Ministral 3: the ratio is 1
        ({}, 1.0 + 0.1 * math.log(4.0)),  # plain YaRN: 1 + 0.1 ln(factor)
        ({"rope.scaling.attn_factor": 2.0}, 2.0 * (1.0 + 0.1 * math.log(4.0))),
    ],
)
def test_mistral3_yarn_attention_factor_is_llama_cpps(extra, want):
    spec = spec_from_gguf(_meta(**extra))
    assert spec.rope_scale == 0.25 and spec.yarn_orig_context == 16
    assert spec.rope_attn_factor == pytest.approx(want, rel=1e-12)
    assert spec.attn_temp_scale == 0.0


def test_mistral3_attention_temperature_floor_is_the_original_context():
    spec = spec_from_gguf(_meta(**{"attention.temperature_scale": 0.1}))
    assert spec.attn_temp_floor == 16
    t = spec.attn_temperatures(np.array([0, 15, 16, 31, 32, 48]))
    want = [1.0, 1.0, 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(2), 1 + 0.1 * math.log(3)]
    np.testing.assert_allclose(t[:5], want, rtol=1e-6)
    assert t.dtype == np.float32 and t[5] > t[4]


@pytest.mark.parametrize(
    "key, value",
    [
        ("attention.temperature_scale", -0.1),
        ("attention.temperature_scale", math.inf),
        ("rope.scaling.yarn_beta_fast", 0.0),
        ("rope.scaling.yarn_beta_slow", math.nan),
        ("rope.scaling.factor", -4.0),
        ("rope.scaling.original_context_length", 0),
        ("rope.scaling.yarn_log_multiplier", "1"),
    ],
)
def test_hostile_mistral3_values_are_refused_by_name(key, value):
    with pytest.raises(ModelFormatError, match=key.replace(".", r"\.")):
        spec_from_gguf(_meta(**{"attention.temperature_scale": 0.1, key: value}))


def test_yarn_with_rope_base_1_is_refused_by_name():
    with pytest.raises(ModelFormatError, match="rope_base"):
        spec_from_gguf(_meta(**{"rope.freq_base": 1.0}))


def test_families_without_yarn_still_refuse_it():
    with pytest.raises(UnsupportedError, match="yarn"):
        spec_from_gguf(_meta("llama"))
