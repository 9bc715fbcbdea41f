"""Context policy: "error" (the default) refuses a prompt longer than the window and stops
a generation that fills it; "slide" keeps attention sinks + the newest tokens (real SmolLM2)."""

from __future__ import annotations

import pytest

from edgerun.errors import ContextOverflowError, InvalidArgumentError


@pytest.fixture(scope="module")
def sliding(smollm2_path):
    import edgerun

    return edgerun.load(smollm2_path, n_ctx=64, threads=2, context_policy="slide")


def test_error_policy(smollm2_path):
    import edgerun

    m = edgerun.load(smollm2_path, n_ctx=64, threads=2)
    with pytest.raises(ContextOverflowError, match="context window is 64"):
        list(m.generate("word " * 100, max_tokens=4))
    text = "".join(
        m.generate("Once upon a time", max_tokens=200, temperature=0.8, seed=1, repeat_penalty=1.0)
    )
    st = m.stats
    assert text and st.finish_reason in ("length", "stop") and m.generator.cache.length <= 64
    if st.finish_reason == "length":
        assert st.generated_tokens < 64
    assert "".join(m.generate("Hi", max_tokens=4))  # still usable


def test_slide_takes_a_long_prompt(sliding):
    text = "".join(sliding.generate("word " * 100 + "The end.", max_tokens=8, temperature=0.0))
    st = sliding.stats
    assert st.prompt_tokens > 64 and st.finish_reason in ("length", "stop") and text is not None


def test_slide_generates_past_the_window(sliding):
    from edgerun.generate.sampling import SamplingParams

    g = sliding.generator
    ids = sliding.tokenize("Once upon a time")
    text = "".join(g.stream(ids, SamplingParams(temperature=0.8, seed=3), 150, stop_ids=[]))
    assert g.stats.generated_tokens == 150 and g.stats.slides >= 2
    assert g.cache.length <= 64 and g.cache.tokens[:4] == ids[:4]  # the sinks stay
    assert len(text) > 100


def test_unknown_policy(smollm2_path):
    import edgerun

    with pytest.raises(InvalidArgumentError, match="context_policy"):
        edgerun.load(smollm2_path, n_ctx=64, context_policy="wrap")
