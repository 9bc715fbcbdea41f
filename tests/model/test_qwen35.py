"""Qwen3.5 (gated DeltaNet + gated attention) through the recurrent-state machinery, on the
tiny reference models of tests/data/families/qwen35 and qwen35moe (agreement with
transformers is tests/reference/test_families.py's): a prompt equals its tokens one at a
time, four sequences decoded together equal each alone bit for bit, a verification pass
equals the one-token steps and rolls back exactly, and a sequence's states saved and
loaded continue identically."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import edgerun
from edgerun.model.kvcache import KVCache

DATA = Path(__file__).resolve().parents[1] / "data" / "families"
PROMPTS = [[5, 9, 13, 40, 77, 2, 3, 11], [4, 8], [150, 1, 2, 3, 5], [60, 61]]
STEPS = [[7, 11, 19, 23], [42, 159, 0, 3], [5, 99, 98, 97], [1, 2, 3, 4]]


@pytest.fixture(scope="module", params=["qwen35", "qwen35moe"])
def model(request):
    m = edgerun.load(DATA / request.param / "f32.gguf", n_ctx=64, threads=1, kv_type="f32")
    yield m
    m.close()


def _cache(m) -> KVCache:
    return KVCache(m.spec, 64, "f32")


def test_layers_mix_deltanet_and_gated_attention(model):
    s = model.spec
    assert s.layer_mixers == ("deltanet", "attention", "deltanet", "attention")
    assert s.attn_output_gate and s.rope_dim == 16 and s.head_dim == 32
    assert (s.ssm_k_heads, s.ssm_v_heads, s.ssm_head_dim, s.ssm_conv_kernel) == (2, 4, 16, 4)
    st = _cache(model).state
    assert set(st.layers) == {0, 2}
    assert st.layers[0]["ssm"].shape == (4, 16, 16)
    assert st.layers[0]["conv"].shape == (3, (2 * 2 + 4) * 16)


def test_prompt_equals_tokens_one_at_a_time(model):
    tr, ids = model.transformer, PROMPTS[0] + STEPS[0]
    whole = _cache(model)
    full = tr.forward(ids, whole, all_logits=True)
    steps = _cache(model)
    one = np.stack([tr.forward([t], steps) for t in ids])
    np.testing.assert_allclose(one, full, rtol=0, atol=2e-4 * np.ptp(full))
    for i, named in whole.state.layers.items():
        for name, a in named.items():
            np.testing.assert_allclose(steps.state.layers[i][name], a, rtol=1e-4, atol=1e-5)
    # the recurrent state carries the prompt: a fresh state gives other logits
    assert np.abs(tr.forward([STEPS[0][0]], _cache(model)) - one[len(PROMPTS[0])]).max() > 1e-2


def test_batched_decode_equals_each_alone(model):
    tr = model.transformer
    alone, together = [_cache(model) for _ in PROMPTS], [_cache(model) for _ in PROMPTS]
    for p, a, b in zip(PROMPTS, alone, together):
        tr.forward(p, a)
        tr.forward(p, b)
    for tokens in STEPS:
        rows = tr.forward_batch(tokens, together)
        ones = np.stack([tr.forward([t], c) for t, c in zip(tokens, alone)])
        np.testing.assert_array_equal(rows, ones)
    for a, b in zip(alone, together):
        for i, named in a.state.layers.items():
            for name, arr in named.items():
                np.testing.assert_array_equal(b.state.layers[i][name], arr)


def test_verify_equals_steps_and_rolls_back(model):
    tr, prompt, draft = model.transformer, PROMPTS[2], STEPS[0]
    ref = _cache(model)
    tr.forward(prompt, ref)
    steps = np.stack([tr.forward([t], ref) for t in draft])
    c = _cache(model)
    tr.forward(prompt, c)
    rows = tr.verify(draft, c)
    np.testing.assert_array_equal(rows, steps)
    # two drafts accepted: back to after them, and on as if never further
    keep = len(prompt) + 2
    assert c.reusable(keep) == keep
    c.truncate(keep)
    again = _cache(model)
    tr.forward(prompt, again)
    for t in draft[:2]:
        tr.forward([t], again)
    for t in (99, 98):
        np.testing.assert_array_equal(tr.forward([t], c), tr.forward([t], again))


def test_saved_states_continue_identically(model):
    tr = model.transformer
    a = _cache(model)
    tr.forward(PROMPTS[0], a)
    saved = {k: v.copy() for k, v in a.state.arrays().items()}
    b = _cache(model)
    tr.forward(PROMPTS[0], b)  # the same KV rows, then the states loaded over zeros
    b.state.reset()
    b.state.load(saved)
    for t in STEPS[1]:
        np.testing.assert_array_equal(tr.forward([t], b), tr.forward([t], a))


def _meta(**over):
    a = "qwen35"
    meta = {
        "general.architecture": a,
        f"{a}.block_count": 4,
        f"{a}.embedding_length": 64,
        f"{a}.feed_forward_length": 128,
        f"{a}.attention.head_count": 2,
        f"{a}.attention.head_count_kv": 1,
        f"{a}.attention.key_length": 32,
        f"{a}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{a}.rope.dimension_count": 16,
        f"{a}.ssm.conv_kernel": 4,
        f"{a}.ssm.state_size": 16,
        f"{a}.ssm.group_count": 2,
        f"{a}.ssm.time_step_rank": 4,
        f"{a}.ssm.inner_size": 64,
        f"{a}.vocab_size": 100,
    }
    return {**meta, **{f"{a}.{k}": v for k, v in over.items()}}


def test_qwen35_metadata():
    from edgerun.arch import spec_from_gguf
    from edgerun.errors import ModelFormatError

    # without the per-layer array: every full_attention_interval-th layer attends (default 4)
    s = spec_from_gguf(_meta())
    assert s.layer_mixers == ("deltanet",) * 3 + ("attention",)
    s = spec_from_gguf(_meta(full_attention_interval=2))
    assert s.layer_mixers == ("deltanet", "attention") * 2
    s = spec_from_gguf(_meta(**{"attention.recurrent_layers": [True, False, False, True]}))
    assert s.layer_mixers == ("deltanet", "attention", "attention", "deltanet")
    assert s.attn_output_gate and s.rope_style == "neox" and s.qk_norm
    assert s.layer_tensor("ffn_norm", 2) == "blk.2.post_attention_norm.weight"
    for bad in ([True, False], "x", [1, 0, 1, 0]):
        with pytest.raises(ModelFormatError, match="recurrent_layers"):
            spec_from_gguf(_meta(**{"attention.recurrent_layers": bad}), "f.gguf")
    with pytest.raises(ModelFormatError, match="inner_size"):
        spec_from_gguf(_meta(**{"ssm.inner_size": 48}), "f.gguf")
    with pytest.raises(ModelFormatError, match="ssm_head_dim"):  # the kernels' 16 lanes
        spec_from_gguf(_meta(**{"ssm.state_size": 12, "ssm.inner_size": 48}), "f.gguf")
    with pytest.raises(ModelFormatError, match="ssm_v_heads"):
        spec_from_gguf(_meta(**{"ssm.time_step_rank": 3, "ssm.inner_size": 48}), "f.gguf")
