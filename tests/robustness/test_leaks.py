"""Long-running use does not leak: RSS after 100 calls on one loaded model (real SmolLM2)."""

from __future__ import annotations

import gc

import pytest

from edgerun.runtime.sysinfo import current_rss_bytes


@pytest.fixture(scope="module")
def model(smollm2_path):
    import edgerun

    m = edgerun.load(smollm2_path, n_ctx=512, threads=2)
    yield m
    m.close()


def _rss_after(fn, n: int) -> int:
    for _ in range(n):
        fn()
    gc.collect()
    return current_rss_bytes()


@pytest.mark.slow
def test_100_generate_calls_grow_rss_under_5_percent(model):
    prompts = ["Hi", "Tell me a story", "What is 2+2?", "Name a colour"]
    i = iter(range(10**6))

    def call():
        p = prompts[next(i) % len(prompts)]
        "".join(model.generate(p, max_tokens=8, temperature=0.7, seed=1))

    base = _rss_after(call, 10)  # warm: kernels, caches, allocator pools
    after = _rss_after(call, 100)
    assert after < base * 1.05, (base >> 20, after >> 20)


@pytest.mark.slow
def test_100_sessions_grow_rss_under_5_percent(model):
    def call():
        s = model.session(system="Be brief.")
        s.send("Hi", max_tokens=6, temperature=0.0)

    base = _rss_after(call, 10)
    after = _rss_after(call, 100)
    assert after < base * 1.05, (base >> 20, after >> 20)
    assert len(model.engine.prefix_cache) == 1  # one shared system prefix, not one per session


def test_kv_cache_has_a_hard_cap(model):
    from edgerun.errors import ContextOverflowError

    s = model.session(n_ctx=64)
    with pytest.raises(ContextOverflowError, match="context window is 64"):
        s.send("word " * 80, max_tokens=4)
    r = s.complete(list(range(1, 60)), max_tokens=50, temperature=0.0)
    r.wait()
    assert s.cache.length <= 64 and r.stats.finish_reason in ("length", "stop")
    assert s.cache.k.shape[2] == 64  # the cache never grows past its size
