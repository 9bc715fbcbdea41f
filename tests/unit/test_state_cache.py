"""The recurrent-state cache beside the KV cache (model/state_cache.py), independent of
any family: which layers hold KV rows, the states' layout, how far a cache can go back,
snapshots, and the chained states of a verification pass."""

from __future__ import annotations

import numpy as np
import pytest

from edgerun.arch.spec import ModelSpec, validate_spec
from edgerun.errors import InvalidArgumentError, ModelFormatError
from edgerun.model import state_cache
from edgerun.model.kvcache import KVCache
from edgerun.model.state_cache import MAX_SNAPSHOTS, PassStates, StateCache

SPEC = ModelSpec(
    arch="lfm2",
    name="tiny-hybrid",
    n_layers=4,
    d_model=8,
    d_ff=16,
    n_heads=2,
    n_kv_heads=1,
    head_dim=4,
    vocab_size=32,
    context_length=32,
    norm_eps=1e-5,
    rope_base=10000.0,
    rope_dim=4,
    layer_mixers=("shortconv", "attention", "shortconv", "attention"),
    shortconv_l_cache=3,
)


def _fill(st: StateCache, value: float) -> None:
    for named in st.layers.values():
        for a in named.values():
            a[...] = value


def _value(st: StateCache) -> float:
    vals = {float(a[0, 0]) for named in st.layers.values() for a in named.values()}
    assert len(vals) == 1
    return vals.pop()


def test_kv_rows_only_for_attention_layers():
    assert SPEC.attention_layers == (1, 3) and SPEC.recurrent_layers == (0, 2)
    assert [SPEC.kv_slot(i) for i in (1, 3)] == [0, 1]
    c = KVCache(SPEC, 8)
    assert c.k.shape[0] == 2 and c.v.shape[0] == 2
    attn_only = ModelSpec(**{**SPEC.__dict__, "layer_mixers": ()})
    assert KVCache.bytes_for(SPEC, 8) * 2 == KVCache.bytes_for(attn_only, 8)
    assert not KVCache(attn_only, 8).state.recurrent and KVCache.state_bytes(attn_only) == 0


def test_state_layout_and_bytes():
    st = KVCache(SPEC, 8).state
    assert set(st.layers) == {0, 2}
    assert st.layers[0]["conv"].shape == (2, 8) and st.layers[0]["conv"].dtype == np.float32
    one = 2 * 2 * 8 * 4  # two layers of [L - 1, d_model] float32
    assert StateCache.bytes_for(SPEC) == one * (1 + MAX_SNAPSHOTS)
    assert st.nbytes == one


def test_spec_validation_of_mixers():
    bad = ModelSpec(**{**SPEC.__dict__, "layer_mixers": ("shortconv", "attention")})
    with pytest.raises(ModelFormatError, match="layer_mixers"):
        validate_spec(bad, "x")
    bad = ModelSpec(**{**SPEC.__dict__, "layer_mixers": ("conv",) * 4})
    with pytest.raises(ModelFormatError, match="layer_mixers"):
        validate_spec(bad, "x")
    bad = ModelSpec(**{**SPEC.__dict__, "shortconv_l_cache": 1})
    with pytest.raises(ModelFormatError, match="shortconv_l_cache"):
        validate_spec(bad, "x")
    validate_spec(SPEC, "x")


def test_truncate_goes_back_only_to_kept_states():
    c = KVCache(SPEC, 16)
    c.tokens.extend(range(5))
    _fill(c.state, 5.0)
    c.state.snapshot(5)
    c.tokens.extend(range(5, 9))
    _fill(c.state, 9.0)
    assert c.reusable(9) == 9 and c.reusable(12) == 9
    assert c.reusable(7) == 5 and c.reusable(4) == 0
    with pytest.raises(InvalidArgumentError, match="position 7"):
        c.truncate(7)
    c.truncate(c.reusable(7))
    assert c.length == 5 and _value(c.state) == 5.0
    c.tokens.extend([1, 2])
    _fill(c.state, 7.0)
    c.truncate(0)
    assert c.length == 0 and _value(c.state) == 0.0 and not c.state.snapshots


def test_truncate_drops_later_snapshots_and_clear_resets():
    c = KVCache(SPEC, 16)
    c.tokens.extend(range(6))
    for p in (2, 4, 6):
        _fill(c.state, float(p))
        c.state.snapshot(p)
    c.truncate(4)
    assert c.state.positions() == [2, 4] and _value(c.state) == 4.0
    c.clear()
    assert _value(c.state) == 0.0 and not c.state.snapshots


def test_snapshots_are_bounded():
    st = StateCache(SPEC)
    for p in range(1, MAX_SNAPSHOTS + 3):
        st.snapshot(p)
    assert st.positions() == list(range(3, MAX_SNAPSHOTS + 3))


def test_large_states_keep_fewer_snapshots_and_cap_verification_rows(monkeypatch):
    """A Mamba-2 model's states take tens of MiB a sequence: one snapshot, not four, and
    a verification pass (a state copy a row) of a few rows, not sixteen."""
    small = StateCache(SPEC)
    assert small.max_snapshots == MAX_SNAPSHOTS and small.max_verify_rows >= 16
    one = StateCache.state_bytes(SPEC)  # 128 bytes here: allowances of that scale
    monkeypatch.setattr(state_cache, "SNAPSHOT_BYTES", one)
    monkeypatch.setattr(state_cache, "VERIFY_STATE_BYTES", 3 * one)
    big = StateCache(SPEC)
    assert big.max_snapshots == 2 and big.max_verify_rows == 3
    assert StateCache.bytes_for(SPEC) == one * 3
    for p in range(1, 6):
        big.snapshot(p)
    assert big.positions() == [4, 5]
    monkeypatch.setattr(state_cache, "SNAPSHOT_BYTES", one // 2)
    monkeypatch.setattr(state_cache, "VERIFY_STATE_BYTES", one // 2)
    huge = StateCache(SPEC)
    assert huge.max_snapshots == 1 and huge.max_verify_rows == 2  # one drafted token
    attn_only = StateCache(ModelSpec(**{**SPEC.__dict__, "layer_mixers": ()}))
    assert attn_only.max_verify_rows is None


def test_save_and_load_arrays():
    a, b = StateCache(SPEC), StateCache(SPEC)
    _fill(a, 3.0)
    b.load({k: v.copy() for k, v in a.arrays().items()})
    assert _value(b) == 3.0
    with pytest.raises(ModelFormatError, match="shape"):
        b.load({k: np.zeros((1, 1), np.float32) for k in a.arrays()})
    with pytest.raises(ModelFormatError, match="do not match"):
        b.load({"0.conv": np.zeros((2, 8), np.float32)})


def test_pass_states_prompt_and_independent_rows():
    x, y = StateCache(SPEC), StateCache(SPEC)
    ins, outs = PassStates([x], [0], decode=False)(2)
    assert ins == outs and ins[0] is x.layers[2]
    ins, outs = PassStates([x, y], [3, 7], decode=True)(0)
    assert ins[0] is outs[0] is x.layers[0] and ins[1] is outs[1] is y.layers[0]


def test_pass_states_chain_one_sequence_and_keep_each_position():
    x, y = StateCache(SPEC), StateCache(SPEC)
    _fill(x, 1.0)
    p = PassStates([x, y, x, x], [10, 4, 11, 12], decode=True)
    for layer in (0, 2):
        ins, outs = p(layer)
        assert ins[0] is x.layers[layer] and ins[1] is outs[1] is y.layers[layer]
        assert ins[2] is outs[0] and ins[3] is outs[2]
        assert len({id(o) for o in (outs[0], outs[2], outs[3])}) == 3
        for k, o in zip((0, 2, 3), (2.0, 3.0, 4.0)):
            outs[k]["conv"][...] = o
    assert _value(x) == 1.0  # the live states change only when the pass finishes
    p.finish()
    assert _value(x) == 4.0 and x.positions() == [11, 12, 13]
    c = KVCache(SPEC, 32)
    c.state = x
    c.tokens.extend(range(13))
    c.truncate(c.reusable(12))
    assert c.length == 12 and _value(c.state) == 3.0


def test_a_verification_pass_keeps_its_states_apart_until_the_next():
    x = StateCache(SPEC)
    for p in range(1, MAX_SNAPSHOTS + 1):  # prompt ends
        x.snapshot(p)
    for start in (20, 30):
        p = PassStates([x] * 6, list(range(start, start + 6)), decode=True)
        for layer in (0, 2):
            p(layer)
        p.finish()
        # the prompt ends stay; only this pass's rows are kept beside them
        want = list(range(1, MAX_SNAPSHOTS + 1)) + list(range(start + 1, start + 7))
        assert x.positions() == want
    x.snapshot(40)  # a prompt end evicts the oldest prompt end, not a verified row
    assert x.positions()[0] == 2 and 31 in x.positions() and 40 in x.positions()
