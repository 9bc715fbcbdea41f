"""Idle KV caches moved to disk under a RAM budget (serving/kv_spill.py) and read back:
the file round trip on a cache of random rows, and sessions of the real SmolLM2 whose
idle caches the scheduler spills to admit another request, then resumes unchanged."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from edgerun.errors import InvalidArgumentError
from edgerun.model.kvcache import KVCache
from edgerun.serving import kv_spill

GREEDY = dict(temperature=0.0, repeat_penalty=1.0)


class _Spec:
    n_layers, n_kv_heads, head_dim = 3, 2, 64
    attention_layers, recurrent_layers = (0, 1, 2), ()  # every layer attends


def _filled(kv_type: str, n: int) -> KVCache:
    c = KVCache(_Spec, 256, kv_type)
    rng = np.random.default_rng(1)
    for layer in range(_Spec.n_layers):
        k = rng.standard_normal((n, 2, 64)).astype(np.float32)
        v = rng.standard_normal((n, 2, 64)).astype(np.float32)
        c.store(layer, 0, k, v)
    c.tokens[:] = list(range(n))
    return c


@pytest.mark.parametrize("kv_type", ["f32", "f16", "q4_0", "q8_0/f16"])
def test_spill_and_restore_round_trip(tmp_path, kv_type):
    c = _filled(kv_type, 100)
    k, v = c.k[:, :, :100].copy(), c.v[:, :, :100].copy()
    held = c.resident_bytes
    assert held == c.pages_for(100) * c.position_bytes > 0
    assert kv_spill.spill(c, tmp_path) == held
    assert c.spilled is not None and c.resident_bytes == 0
    assert not np.any(c.k[:, :, :100]) and not np.any(c.v[:, :, :100])  # pages given back
    assert os.listdir(tmp_path) == []  # the file is unlinked: nothing left if we die
    assert c.tokens == list(range(100))  # prefix matching still works while on disk
    with pytest.raises(InvalidArgumentError, match="on disk"):
        c.check_fits(1)  # no forward pass on rows that are not there
    out = io.BytesIO()  # Session.save's rows: straight from the file, a piece at a time
    assert kv_spill.write_rows(c, out) == k.nbytes + v.nbytes
    assert out.getvalue() == k.tobytes() + v.tobytes()
    assert c.spilled is not None and c.resident_bytes == 0  # and it stays on disk
    del c.tokens[60:]  # forgotten while on disk (a shorter prompt matched it)
    out = io.BytesIO()
    kv_spill.write_rows(c, out)
    assert out.getvalue() == k[:, :, :60].tobytes() + v[:, :, :60].tobytes()
    c.tokens[:] = list(range(100))
    assert kv_spill.restore(c) == 100
    assert c.spilled is None and c.resident_bytes == held
    np.testing.assert_array_equal(c.k[:, :, :100], k)
    np.testing.assert_array_equal(c.v[:, :, :100], v)
    out = io.BytesIO()  # a resident cache's rows: the same bytes
    kv_spill.write_rows(c, out)
    assert out.getvalue() == k.tobytes() + v.tobytes()


def test_partial_restore_and_clear(tmp_path):
    c = _filled("f16", 90)
    k = c.k[:, :, :40].copy()
    kv_spill.spill(c, tmp_path)
    assert kv_spill.restore(c, 40) == 40  # a prompt that shares only 40 positions
    assert c.length == 40
    np.testing.assert_array_equal(c.k[:, :, :40], k)
    kv_spill.spill(c, tmp_path)
    c.clear()  # a new chat: the file goes, nothing to restore
    assert c.spilled is None and c.length == 0 and c.resident_bytes == 0
    assert kv_spill.restore(c) == 0
    assert kv_spill.spill(KVCache(_Spec, 16), tmp_path) == 0  # empty: nothing to free


def test_an_unreadable_spill_is_recomputed_not_lost(tmp_path):
    c = _filled("f32", 50)
    kv_spill.spill(c, tmp_path)
    c.spilled.file.truncate(100)  # the file lost its rows
    with pytest.warns(RuntimeWarning, match="computed again"):
        assert kv_spill.restore(c) == 0
    assert c.length == 0 and c.spilled is None


@pytest.fixture(scope="module")
def model(smollm2_path):
    import edgerun

    m = edgerun.load(smollm2_path, n_ctx=512, threads=2, kv_type="f16")
    yield m
    m.close()


def test_idle_sessions_spill_to_admit_a_request_and_resume_unchanged(model, tmp_path):
    """Under a RAM budget idle sessions' caches count in the KV window; to admit a new
    request the scheduler moves the least recently used to disk, and a spilled session's
    next turn reads its rows back (no recompute) and answers as if never moved."""
    ref = model.session()
    ref.send("Name three fruits.", max_tokens=24, **GREEDY)
    want = ref.send("Which one is red?", max_tokens=24, **GREEDY)
    ref.reset()  # its pages given back: not an idle cache any more
    assert ref.cache.resident_bytes == 0

    sched = model.scheduler
    saved = model.engine.kv_budget_tokens, sched.spill_dir
    model.engine.prefix_cache.clear()
    try:
        sched.spill_dir = tmp_path
        a, b = model.session(), model.session()
        a.send("Name three fruits.", max_tokens=24, **GREEDY)
        b.send("Name three colours.", max_tokens=24, **GREEDY)
        n = a.cache.length
        page = a.cache.pages_for(1)
        model.engine.kv_budget_tokens = 2 * a.cache.pages_for(n) + page  # a, b and one page
        other = model.session()
        spills = sched.counters.kv_spills
        other.send("Say hi.", max_tokens=page + 1, **GREEDY)  # does not fit beside a and b
        assert sched.counters.kv_spills == spills + 1
        assert a.cache.spilled is not None and b.cache.spilled is None  # least recent
        assert a.cache.resident_bytes == 0 and os.listdir(tmp_path) == []
        restores = sched.counters.kv_restores
        got = a.send("Which one is red?", max_tokens=24, **GREEDY)
        assert sched.counters.kv_restores == restores + 1
        assert a.stats.cached_tokens >= n - 2  # read back, not recomputed
        assert got == want
        # saving a spilled session reads its rows from the file and leaves it on disk
        b_tokens = list(b.cache.tokens)
        model.engine.kv_budget_tokens = a.cache.pages_for(a.cache.length) + page
        model.session().send("Say hi.", max_tokens=page + 1, **GREEDY)
        assert b.cache.spilled is not None
        path = b.save(tmp_path / "b.safetensors")
        assert b.cache.spilled is not None and b.cache.resident_bytes == 0
        from edgerun.serving.session import Session

        back = Session.load(model, path)
        assert back.cache.tokens == b_tokens
        kv_spill.restore(b.cache)
        n = len(b_tokens)
        np.testing.assert_array_equal(back.cache.k[:, :, :n], b.cache.k[:, :, :n])
        np.testing.assert_array_equal(back.cache.v[:, :, :n], b.cache.v[:, :, :n])
    finally:
        model.engine.kv_budget_tokens, sched.spill_dir = saved
        model.engine.prefix_cache.clear()


def test_without_a_spill_directory_idle_caches_are_counted_and_kept(model):
    import gc

    gc.collect()  # earlier tests' caches: none may be freed between the two rooms below
    sched = model.scheduler
    saved = model.engine.kv_budget_tokens, sched.spill_dir
    like = KVCache(model.spec, 16, "f16")
    try:
        sched.spill_dir = None
        model.engine.kv_budget_tokens = 400
        before = sched._kv_room(like)
        a = model.session()
        a.send("Name a colour.", max_tokens=8, **GREEDY)
        assert a.cache.resident_bytes > 0
        assert sched._kv_room(like) == before - a.cache.resident_bytes  # a idle, counted
        model.engine.kv_budget_tokens = a.cache.pages_for(a.cache.length)
        model.session().send("Say hi.", max_tokens=4, **GREEDY)  # alone: runs anyway
        assert a.cache.spilled is None and a.cache.resident_bytes > 0
    finally:
        model.engine.kv_budget_tokens, sched.spill_dir = saved
