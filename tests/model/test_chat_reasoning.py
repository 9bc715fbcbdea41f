"""Reasoning through Model.chat on a tiny qwen3 model given DeepSeek-R1's template (which
opens the <think> block in the prompt): on, off, and a budget that closes the block by
injecting the tag and answers after it on the same KV cache (the batching scheduler)."""

from __future__ import annotations

from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1] / "data"
MSGS = [{"role": "user", "content": "2+2?"}]


@pytest.fixture(scope="module")
def thinker():
    import edgerun

    m = edgerun.load(DATA / "families" / "qwen3" / "q8_0.gguf", threads=1)
    template = DATA / "chat_templates" / "deepseek-r1-distill-qwen.jinja"
    m.tokenizer.chat_template = template.read_text()
    yield m
    m.close()


def test_budget_cuts_the_reasoning_and_the_answer_follows(thinker):
    free = thinker.chat(MSGS, reasoning="on", message=True, max_tokens=20, temperature=0)
    assert free["finish_reason"] == "length" and free["content"] == ""  # it never stops
    capped = thinker.chat(MSGS, reasoning=8, message=True, max_tokens=20, temperature=0)
    assert capped["finish_reason"] == "length"
    # the same first 8 tokens, then the block closed by the budget and an answer
    assert free["reasoning_content"].startswith(capped["reasoning_content"])
    assert len(capped["reasoning_content"]) < len(free["reasoning_content"])
    assert capped["content"]
    # the model's stats are this turn's: both parts and the injected tag, max_tokens in all
    st = thinker.stats
    assert st.finish_reason == "length" and st.generated_tokens == 20


def test_budget_streams_deltas_and_counts_the_tag(thinker):
    deltas = list(thinker.chat(MSGS, reasoning=4, message=True, stream=True, max_tokens=24))
    kinds = [next(iter(d)) for d in deltas]
    assert kinds[-1] == "finish_reason"
    first_content = kinds.index("content")
    assert set(kinds[:first_content]) == {"reasoning_content"}


def test_off_closes_the_block_the_template_opened(thinker):
    off = thinker.chat(MSGS, reasoning="off", message=True, max_tokens=6, temperature=0)
    assert "reasoning_content" not in off and off["content"]
    assert thinker.chat(MSGS, reasoning="off", max_tokens=6, temperature=0) == off["content"]


def test_cli_shows_reasoning_dimmed_or_hides_it():
    from edgerun.cli import _build_parser, _shown_reasoning

    deltas = [{"reasoning_content": "hmm"}, {"content": "4"}, {"finish_reason": "stop"}]
    assert "".join(_shown_reasoning(iter(deltas), False, True)) == "\x1b[2mhmm\x1b[0m\n\n4"
    assert "".join(_shown_reasoning(iter(deltas), False, False)) == "hmm\n\n4"
    assert "".join(_shown_reasoning(iter(deltas), True, True)) == "4"
    args = _build_parser().parse_args(["generate", "hi", "--reasoning", "budget", "64"])
    assert args.reasoning == ["budget", "64"]
