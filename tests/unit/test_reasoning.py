"""Reasoning: the <think> splitter on token streams (tags split across pieces, templates that
open the block in the prompt), modes, and the budget that closes a block by injecting the tag."""

from __future__ import annotations

import asyncio

import pytest

from edgerun.errors import InvalidArgumentError
from edgerun.generate.reasoning import (
    CLOSE_AFTER_BUDGET,
    BudgetedGeneration,
    ReasoningMode,
    ReasoningSplitter,
    prompt_opens_reasoning,
    reasoning_mode,
    thinking_template_args,
)
from edgerun.generate.sequence import GenerationStats


def _split(pieces: list[str], in_reasoning: bool = False) -> tuple[str, str]:
    s = ReasoningSplitter(in_reasoning)
    out = [e for p in pieces for e in s.feed(p)] + s.finish()
    reasoning = "".join(t for k, t in out if k == "reasoning")
    content = "".join(t for k, t in out if k == "content")
    return reasoning, content


ANSWER = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello!"


@pytest.mark.parametrize("step", [1, 2, 3, 5, len(ANSWER)])
def test_tags_split_across_pieces(step):
    pieces = [ANSWER[i : i + step] for i in range(0, len(ANSWER), step)]
    assert _split(pieces) == ("The user greets me.\nI greet back.", "Hello!")


def test_tokens_as_a_qwen3_tokenizer_cuts_them():
    # <think> and </think> are single tokens in Qwen3; the text between comes in word pieces
    pieces = ["<think>", "\n", "Let", " me", " add", ".", "\n", "</think>", "\n\n", "4", "."]
    assert _split(pieces) == ("Let me add.", "4.")


def test_a_template_that_opens_the_block():
    prompt = "<｜User｜>hi<｜Assistant｜><think>\n"
    assert prompt_opens_reasoning(prompt)
    assert not prompt_opens_reasoning(prompt + "</think>")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")
    assert _split(["Hmm", ", easy.", "</th", "ink>", "\n\nYes."], in_reasoning=True) == (
        "Hmm, easy.",
        "Yes.",
    )


def test_no_block_is_all_content_and_a_late_tag_stays_content():
    assert _split(["Hello", " there"]) == ("", "Hello there")
    assert _split(["Use <think>", " tags"]) == ("", "Use <think> tags")
    assert _split(["<thi"]) == ("", "<thi")  # a tag's start that never completes


def test_an_unclosed_block_ends_as_reasoning():
    assert _split(["<think>", "still going"]) == ("still going", "")


def test_modes():
    assert reasoning_mode(None) == ReasoningMode()
    assert reasoning_mode("on") == ReasoningMode(True)
    assert reasoning_mode("off") == ReasoningMode(False)
    assert reasoning_mode(256) == ReasoningMode(True, 256)
    assert reasoning_mode("budget 64") == ReasoningMode(True, 64)
    assert reasoning_mode(0) == ReasoningMode(False)
    with pytest.raises(InvalidArgumentError, match="budget"):
        reasoning_mode(-1)
    with pytest.raises(InvalidArgumentError, match="'on', 'off'"):
        reasoning_mode("maybe")


def test_thinking_args_per_template():
    msgs = [{"role": "user", "content": "hi"}]
    qwen3 = "{% if enable_thinking is defined and enable_thinking is false %}{% endif %}"
    assert thinking_template_args(qwen3, ReasoningMode(False), msgs) == (
        {"enable_thinking": False},
        msgs,
    )
    switch = "{% if '/no_think' in system_message %}{% endif %}"
    extra, out = thinking_template_args(switch, ReasoningMode(False), msgs)
    assert extra == {} and out[0] == {"role": "system", "content": "/no_think"}
    assert thinking_template_args("plain", ReasoningMode(False), msgs) == ({}, msgs)
    assert thinking_template_args(qwen3, ReasoningMode(), msgs) == ({}, msgs)


# -- the budget ------------------------------------------------------------------------


class FakeRequest:
    """A scheduler request replaying a scripted model: the tokens it would sample next,
    given the ids so far (its history), up to max_tokens."""

    def __init__(self, script, ids, max_tokens, cache):
        self.cache = cache if cache is not None else object()
        self.history = list(ids)
        self.stats = GenerationStats(prompt_tokens=len(ids))
        self.pieces = []
        for _ in range(max_tokens):
            tok = script(self.history)
            if tok is None:  # EOS
                self.stats.finish_reason = "stop"
                break
            self.history.append(tok)
            self.pieces.append(tok)
        else:
            self.stats.finish_reason = "length"
        self.stats.generated_tokens = len(self.pieces)
        self.cancelled = False

    def __iter__(self):
        return iter(self.pieces)

    async def __aiter__(self):
        for p in self.pieces:
            yield p

    def cancel(self):
        self.cancelled = True


def _thinker(history):
    """Thinks forever ("hmm " tokens) unless the block was closed: then answers and stops."""
    if CLOSE_AFTER_BUDGET in history:
        tail = history[history.index(CLOSE_AFTER_BUDGET) + 1 :]
        return "42" if not tail else None
    return "<think>" if history == ["P"] else "hmm "


def test_budget_injects_the_closing_tag_and_continues():
    calls = []

    def submit(ids, n, cache):
        calls.append((list(ids), n, cache))
        return FakeRequest(_thinker, ids, n, cache)

    g = BudgetedGeneration(submit, ["P"], max_tokens=20, budget=5, close_ids=[CLOSE_AFTER_BUDGET])
    text = list(g)
    assert text == ["<think>", "hmm ", "hmm ", "hmm ", "hmm ", CLOSE_AFTER_BUDGET, "42"]
    assert _split(text) == ("hmm hmm hmm hmm ", "42")
    assert g.injected
    (ids1, n1, c1), (ids2, n2, c2) = calls
    assert n1 == 5 and n2 == 14 and c1 is None  # 20 less the 5 and the tag
    assert ids2 == ["P", "<think>", "hmm ", "hmm ", "hmm ", "hmm ", CLOSE_AFTER_BUDGET]
    assert c2 is g.first.cache  # the second part continues on the first part's KV cache
    assert g.stats.generated_tokens == 5 + 1 + 1 and g.stats.finish_reason == "stop"


def test_budget_not_reached_runs_once():
    def short(history):
        seq = ["<think>", "ok", "</think>", "hi"]
        n = len(history) - 1
        return seq[n] if n < len(seq) else None

    g = BudgetedGeneration(lambda i, n, c: FakeRequest(short, i, n, c), ["P"], 50, 10, ["X"])
    assert asyncio.run(_collect(g)) == ["<think>", "ok", "</think>", "hi"]
    assert g.second is None and not g.injected and g.stats.finish_reason == "stop"


def test_budget_after_the_block_closed_continues_without_a_tag():
    def chatty(history):
        seq = ["<think>", "ok", "</think>"]
        n = len(history) - 1
        return seq[n] if n < len(seq) else "word "

    g = BudgetedGeneration(lambda i, n, c: FakeRequest(chatty, i, n, c), ["P"], 8, 4, ["X"])
    out = list(g)
    assert "X" not in out and not g.injected
    assert len(out) == 8 and g.stats.finish_reason == "length"


async def _collect(g):
    return [p async for p in g]
