"""Fused matrices (Phi-3's attn_qkv, a gate+up ffn_up in Phi-3 and GLM-4) on tiny random
models (tiny_families.py): the GGUF reader splits them by rows into the usual roles
(formats/gguf.split_fused), so a file with the fused tensors gives the same logits, bit
for bit, as one with the same rows stored as separate tensors, resident and under a RAM
budget (dense offloading streams the parts' rows from their places inside the fused
tensor). Every path of these families (generate, sessions, the scheduler, packs, the
server) is test_family_paths.py's; agreement with transformers, tests/reference's."""

from __future__ import annotations

import numpy as np
import pytest
from hostile import F32, STR, U32, GGUFBuilder, Tensor
from tiny_families import family_gguf

import edgerun
from edgerun.errors import ModelFormatError
from edgerun.formats.gguf import read_gguf
from edgerun.model.kvcache import KVCache

PROMPT = "the theme of the day is the test of the fused rows"


def _load(path, **kw):
    return edgerun.load(path, n_ctx=96, threads=1, kv_type="f32", interleave=False, **kw)


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_a_fused_file_runs_as_its_split_twin(tmp_path, family, qtype):
    fused = family_gguf(tmp_path / "fused.gguf", family, qtype)
    split = family_gguf(tmp_path / "split.gguf", family, qtype, fused=False)
    stored = set(read_gguf(split).tensor_names())
    names = read_gguf(fused).tensor_names()
    assert set(names) == stored and "blk.0.attn_qkv.weight" not in names
    assert read_gguf(fused).infos["blk.0.ffn_up.weight"].offset > 0
    a, b = _load(fused), _load(split)
    ids = a.tokenize(PROMPT)
    la, lb = a.logits(ids), b.logits(ids)
    assert np.isfinite(la).all() and np.array_equal(la, lb)
    a.close()
    b.close()


def test_a_fused_tensor_of_the_wrong_size_is_a_clear_error(tmp_path):
    kvs = {
        "general.architecture": (STR, "phi3"),
        "phi3.block_count": (U32, 1),
        "phi3.embedding_length": (U32, 64),
        "phi3.feed_forward_length": (U32, 128),
        "phi3.attention.head_count": (U32, 4),
        "phi3.attention.layer_norm_rms_epsilon": (F32, 1e-6),
        "phi3.vocab_size": (U32, 300),
    }
    qkv = Tensor("blk.0.attn_qkv.weight", (64, 65), bytes(64 * 65 * 4))
    path = GGUFBuilder(kvs=kvs, tensors=[qkv]).write(tmp_path / "bad.gguf")
    with pytest.raises(ModelFormatError, match=r"attn_qkv.weight' has 65 rows, expected 192"):
        read_gguf(path)


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_a_fused_family_offloaded_under_a_ram_budget_equals_resident(tmp_path, family):
    path = family_gguf(tmp_path / "m.gguf", family)
    resident = _load(path)
    ids = resident.tokenize(PROMPT)
    want = resident.logits(ids)
    text = "".join(resident.generate(ids, max_tokens=6, temperature=0.0, repeat_penalty=1.0))
    resident.close()
    off = _load(path, ram_budget="4G", offload="dense")
    assert off.plan.mode == "dense" and off.loader.offload_stats() is not None
    assert np.array_equal(off.logits(ids), want)
    assert "".join(off.generate(ids, max_tokens=6, temperature=0.0, repeat_penalty=1.0)) == text
    off.close()


def test_longrope_takes_the_short_factors_within_the_trained_context(tmp_path):
    """As llama.cpp: a KV cache of at most rope.scaling.original_context_length positions
    rotates with rope_factors_short, a longer one with rope_factors_long; both scaled by
    the attention factor."""
    from edgerun.ops.rope import rope_tables

    m = _load(family_gguf(tmp_path / "m.gguf", "phi3"))
    s, tr = m.spec, m.transformer
    short, long = tr.rope_factors
    assert s.rope_orig_context == 16 and s.rope_attn_factor == np.float32(1.2)
    assert not np.array_equal(short, long)
    for n_ctx, factors in ((16, short), (17, long), (96, long)):
        cos, sin = tr._rope(n_ctx, s.rope_base)
        want = rope_tables(n_ctx, s.rope_dim, s.rope_base, factors, s.rope_attn_factor)
        assert np.array_equal(cos[:n_ctx], want[0]) and np.array_equal(sin[:n_ctx], want[1])
    ids = m.tokenize("the theme")  # 16-position caches and longer ones rotate differently
    assert not np.array_equal(m.logits(ids), tr.forward(ids, KVCache(s, 96, "f32"), True))
    m.close()
