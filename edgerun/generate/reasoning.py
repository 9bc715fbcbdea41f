"""Reasoning models: the ``<think>...</think>`` span split from the answer, thinking turned on
or off, and a token budget for it.

:class:`ReasoningSplitter` reads the model's text piece by piece (a tag may arrive split
across tokens) and tells reasoning from content. A template that opens the block itself
(DeepSeek-R1 distills end the generation prompt with ``<think>\\n``) starts it inside the
reasoning (:func:`prompt_opens_reasoning`).

:class:`ReasoningMode` says what the caller asked: thinking on, off, or on within a budget of
N tokens. Off is asked of the template the way it takes it (``enable_thinking=False``; a
``/no_think`` switch in the system prompt for templates that read one) and, where the prompt
still opens a block, the block is closed in the prompt. The budget is kept by
:class:`BudgetedGeneration`: the reasoning runs for at most N tokens, then, if it has not
ended, the closing tag's tokens are put after it and the answer is generated from there
(the KV cache keeps what was computed, so only the tag is new work).
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from edgerun.errors import InvalidArgumentError
from edgerun.generate.sequence import GenerationStats

__all__ = [
    "CLOSE",
    "OPEN",
    "BudgetedGeneration",
    "ReasoningMode",
    "ReasoningSplitter",
    "prompt_opens_reasoning",
    "reasoning_mode",
    "thinking_template_args",
]

OPEN = "<think>"
CLOSE = "</think>"
# The text put after a reasoning cut short by its budget (Qwen3 writes "</think>\n\n").
CLOSE_AFTER_BUDGET = "\n</think>\n\n"


@dataclass(frozen=True)
class ReasoningMode:
    """``enabled`` None: the template's default; ``budget``: most reasoning tokens."""

    enabled: bool | None = None
    budget: int | None = None


def reasoning_mode(value: Any) -> ReasoningMode:
    """A mode from what a caller gives: None, "on"/True, "off"/False, an int budget (tokens,
    >= 0; 0 is off), "budget N", or a ReasoningMode."""
    if value is None or isinstance(value, ReasoningMode):
        return value or ReasoningMode()
    if value is True or value == "on":
        return ReasoningMode(True)
    if value is False or value == "off":
        return ReasoningMode(False)
    if isinstance(value, str):
        m = re.fullmatch(r"\s*(?:budget\s+)?(\d+)\s*", value)
        if m:
            value = int(m.group(1))
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise InvalidArgumentError(f"a reasoning budget must be >= 0 tokens, got {value}")
        return ReasoningMode(False) if value == 0 else ReasoningMode(True, value)
    raise InvalidArgumentError(
        f"reasoning must be 'on', 'off', a token budget (an integer) or 'budget N', got {value!r}"
    )


def thinking_template_args(
    template: str | None, mode: ReasoningMode, messages: list[dict]
) -> tuple[dict[str, Any], list[dict]]:
    """The template variables and messages that ask for ``mode``: ``enable_thinking`` for
    templates that read it (Qwen3, SmolLM3); for templates that only know the ``/no_think``
    and ``/think`` switches, the switch at the end of the system message."""
    if mode.enabled is None:
        return {}, messages
    text = template or ""
    if "enable_thinking" in text:
        return {"enable_thinking": mode.enabled}, messages
    switch = "/think" if mode.enabled else "/no_think"
    if "/no_think" not in text:
        return {}, messages
    msgs = [dict(m) for m in messages]
    if msgs and msgs[0].get("role") == "system":
        msgs[0]["content"] = f"{msgs[0].get('content') or ''} {switch}".strip()
    else:
        msgs.insert(0, {"role": "system", "content": switch})
    return {}, msgs


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt ends inside an open ``<think>`` block."""
    at = prompt.rfind(OPEN)
    return at >= 0 and prompt.find(CLOSE, at) < 0


def _partial_suffix(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningSplitter:
    """Tells reasoning from content in a streamed answer.

    ``feed(piece)`` returns ``[(kind, text), ...]`` with kind "reasoning" or "content";
    ``finish()`` the text held back. Only a block at the start of the answer (blank text
    before it allowed) is reasoning: a ``<think>`` later in an answer is content. The newlines
    around the tags are dropped, as the templates write them."""

    def __init__(self, in_reasoning: bool = False) -> None:
        self.state = "reasoning" if in_reasoning else "start"
        self.closed = False  # the block ended (a closing tag came)
        self._buf = ""
        self._lead = in_reasoning  # strip the newlines that follow a tag

    @property
    def in_reasoning(self) -> bool:
        return self.state == "reasoning"

    def feed(self, piece: str) -> list[tuple[str, str]]:
        self._buf += piece
        return self._drain(final=False)

    def finish(self) -> list[tuple[str, str]]:
        return self._drain(final=True)

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if self._lead:
            text = text.lstrip("\n")
            if text:
                self._lead = False
        if not text:
            return
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self._buf:
            if self.state == "start":
                stripped = self._buf.lstrip()
                if not stripped:
                    if final:
                        self._emit(out, "content", self._buf)
                        self._buf = ""
                    break
                if stripped.startswith(OPEN):
                    self._buf = stripped[len(OPEN) :]
                    self.state, self._lead = "reasoning", True
                    continue
                if OPEN.startswith(stripped) and not final:
                    break  # maybe the tag, not yet whole
                self.state = "content"
                continue
            if self.state == "reasoning":
                at = self._buf.find(CLOSE)
                if at < 0:
                    keep = 0
                    if not final:  # a tag's start, and the newlines that may precede it
                        keep = _partial_suffix(self._buf, CLOSE)
                        head = self._buf[: len(self._buf) - keep]
                        keep += len(head) - len(head.rstrip("\n"))
                    text = self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep :]
                    self._emit(out, "reasoning", text.rstrip("\n") if final else text)
                    break
                self._emit(out, "reasoning", self._buf[:at].rstrip("\n"))
                self._buf = self._buf[at + len(CLOSE) :]
                self.state, self._lead, self.closed = "content", True, True
                continue
            self._emit(out, "content", self._buf)
            self._buf = ""
        return out


class BudgetedGeneration:
    """A generation whose reasoning takes at most ``budget`` tokens.

    ``submit(ids, max_tokens, cache)`` starts a generation (a scheduler request: iterable,
    async-iterable, with ``history``, ``stats``, ``cache`` and ``cancel()``). The first part
    runs ``budget`` tokens; if the reasoning is still open then, ``close_ids`` (the closing
    tag's tokens) follow it and the rest of ``max_tokens`` (the tag counted) is generated
    from there, on the same KV cache. Iterating yields the text pieces of both parts and
    the tag between them; ``stats`` adds them up."""

    def __init__(
        self,
        submit: Callable[[list[int], int, Any], Any],
        prompt_ids: list[int],
        max_tokens: int,
        budget: int,
        close_ids: list[int],
        in_reasoning: bool = False,
    ) -> None:
        self._submit = submit
        self.max_tokens = max_tokens
        self.close_ids = list(close_ids)
        self.splitter = ReasoningSplitter(in_reasoning)
        self.first = submit(list(prompt_ids), min(budget, max_tokens), None)
        self.second: Any = None
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        self.injected = False  # the closing tag was put in

    def _watch(self, piece: str) -> str:
        self.splitter.feed(piece)
        return piece

    def _next(self) -> str | None:
        """After the first part: start the second, returning the text put between them."""
        first = self.first
        st = first.stats
        used = st.generated_tokens
        if st.finish_reason != "length" or used >= self.max_tokens:
            return None
        ids = list(first.history)
        between = None
        if self.splitter.in_reasoning:
            ids += self.close_ids
            between = CLOSE_AFTER_BUDGET
            self.injected = True
            self.splitter.feed(between)
        # the injected tag counts toward max_tokens, as the generated tokens do
        left = self.max_tokens - used - (len(self.close_ids) if self.injected else 0)
        if left > 0:
            self.second = self._submit(ids, left, first.cache)
        return between

    def _total(self) -> None:
        parts = [p for p in (self.first, self.second) if p is not None]
        st = self.stats
        st.generated_tokens = sum(p.stats.generated_tokens for p in parts)
        st.generated_tokens += len(self.close_ids) if self.injected else 0
        st.cached_tokens = self.first.stats.cached_tokens
        st.prompt_seconds = self.first.stats.prompt_seconds
        st.generate_seconds = sum(p.stats.generate_seconds for p in parts)
        st.ttft_seconds = self.first.stats.ttft_seconds
        st.finish_reason = parts[-1].stats.finish_reason

    def __iter__(self) -> Iterator[str]:
        try:
            for piece in self.first:
                yield self._watch(piece)
            between = self._next()
            if between:
                yield between
            if self.second is not None:
                yield from self.second
        finally:
            self._total()

    async def __aiter__(self) -> AsyncIterator[str]:
        try:
            async for piece in self.first:
                yield self._watch(piece)
            between = self._next()
            if between:
                yield between
            if self.second is not None:
                async for piece in self.second:
                    yield piece
        finally:
            self._total()

    def cancel(self) -> None:
        self.first.cancel()
        if self.second is not None:
            self.second.cancel()
