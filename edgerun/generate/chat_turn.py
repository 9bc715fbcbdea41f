"""One assistant turn: the prompt a chat request makes (tools and thinking passed to the
model's template) and the reading of the answer into reasoning, content and tool calls, as
whole messages or as OpenAI's streamed deltas."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgerun.errors import InvalidArgumentError, UnsupportedError
from edgerun.generate.chat_template import encode_chat
from edgerun.generate.constraint import Constraint, constraint_from
from edgerun.generate.reasoning import (
    CLOSE_AFTER_BUDGET,
    OPEN,
    ReasoningMode,
    ReasoningSplitter,
    prompt_opens_reasoning,
    reasoning_mode,
    thinking_template_args,
)
from edgerun.generate.tool_calls import (
    ToolCall,
    ToolCallParser,
    ToolMarkup,
    check_tool_choice,
    check_tools,
    markup_for,
    template_messages,
    tool_call_grammar,
)

__all__ = ["ChatTurn", "TurnReader", "prepare_turn"]

# template variables the caller may not set through chat_template_kwargs
_RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


@dataclass
class ChatTurn:
    """What a chat request asks the model for, and how to read its answer."""

    ids: list[int]
    tools: list[dict] = field(default_factory=list)
    tool_choice: str | dict = "none"
    markup: ToolMarkup | None = None
    reasoning: ReasoningMode = field(default_factory=ReasoningMode)
    thinks: bool = False  # the model writes <think> blocks (its template or vocabulary says so)
    opens_reasoning: bool = False  # the prompt ends inside an open <think> block
    grammar: str | None = None  # forces the call(s) tool_choice asks for (llguidance Lark)
    close_ids: list[int] = field(default_factory=list)  # the tokens that end a reasoning block
    prefix_len: int = 0  # leading tokens shared by requests with the same tools and system
    parallel: bool = True  # several calls in one answer (False: the first call only)

    @property
    def calls_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none" and self.markup is not None

    def reader(self) -> TurnReader:
        return TurnReader(self)

    def constraint(self, tokenizer: Any, asked: Constraint | None) -> Constraint | None:
        """What this turn decodes under: the grammar of the call tool_choice forces (its
        markup around valid arguments), else `asked` (response_format, json_schema, regex
        or grammar). Both at once are refused."""
        if self.grammar is None:
            return asked
        if asked is not None:
            raise InvalidArgumentError(
                "tool_choice 'required' or a named function cannot be combined with "
                "response_format, json_schema, regex or grammar"
            )
        return constraint_from(tokenizer, grammar=self.grammar)


def prepare_turn(
    tokenizer: Any,
    messages: list[dict],
    tools: Any = None,
    tool_choice: Any = None,
    reasoning: Any = None,
    template_kwargs: dict | None = None,
    parallel: bool = True,
) -> ChatTurn:
    """The prompt for ``messages`` with ``tools`` (OpenAI's shape, checked), ``tool_choice``,
    ``reasoning`` (see reasoning.reasoning_mode) and extra template variables; ``parallel``
    False (OpenAI's parallel_tool_calls) allows one call per answer.

    Raises InvalidArgumentError for malformed tools or choice, UnsupportedError when tools are
    asked of a model whose template writes no tool-call markup this package reads."""
    tools = check_tools(tools)
    choice = check_tool_choice(tool_choice, tools)
    mode = reasoning_mode(reasoning)
    template = tokenizer.chat_template
    specials = tokenizer.special_texts()
    markup = markup_for(specials, template)
    if tools and choice != "none" and markup is None:
        raise UnsupportedError(
            "this model's chat template has no tool-call format edgerun reads (Hermes "
            "<tool_call>, Llama 3 JSON, Mistral [TOOL_CALLS], Phi-4 <|tool_call|>); "
            "send the request without 'tools'"
        )
    extra: dict[str, Any] = {}
    if template_kwargs:
        if not isinstance(template_kwargs, dict):
            raise InvalidArgumentError("chat_template_kwargs must be an object")
        bad = sorted(set(template_kwargs) & _RESERVED)
        if bad:
            raise InvalidArgumentError(f"chat_template_kwargs may not set {', '.join(bad)}")
        extra.update(template_kwargs)
        if mode.enabled is None and isinstance(extra.get("enable_thinking"), bool):
            mode = ReasoningMode(extra["enable_thinking"], mode.budget)
    think_args, messages = thinking_template_args(template, mode, list(messages))
    extra.update(think_args)
    if tools and choice != "none":
        extra["tools"] = tools
    ids = encode_chat(tokenizer, template_messages(messages), template, True, **extra)
    thinks = OPEN in (template or "") or OPEN in specials
    tail = tokenizer.decode(ids[-16:])
    opens = prompt_opens_reasoning(tail)
    close_ids = tokenizer.encode(CLOSE_AFTER_BUDGET, add_bos=False, parse_special=True)
    if opens and mode.enabled is False:  # the template opened a block it was asked not to
        ids = ids + close_ids
        opens = False
    prefix = _shared_prefix(tokenizer, messages, template, extra, ids) if tools else 0
    grammar = None
    if tools and (choice == "required" or isinstance(choice, dict)):
        grammar = tool_call_grammar(tools, choice, markup, specials, parallel)
    return ChatTurn(
        ids=ids,
        tools=tools,
        tool_choice=choice,
        markup=markup,
        reasoning=mode,
        thinks=thinks or opens,
        opens_reasoning=opens,
        grammar=grammar,
        close_ids=close_ids,
        prefix_len=prefix,
        parallel=parallel,
    )


def _shared_prefix(tokenizer: Any, messages: list[dict], template: str, extra: dict, ids) -> int:
    """How many leading tokens of ``ids`` come before the first user message's text: the
    system turn with the tools, the same for every request that offers the same tools, so
    the scheduler computes it once (its prefix cache). 0 where it cannot be told."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "user"), None)
    if first is None:
        return 0
    heads = [
        encode_chat(
            tokenizer,
            template_messages([*messages[:first], {"role": "user", "content": text}]),
            template,
            False,
            **extra,
        )
        for text in ("a", "b")
    ]
    n = 0
    for x, y in zip(*heads, strict=False):
        if x != y:
            break
        n += 1
    return n if 0 < n < len(ids) and list(ids[:n]) == heads[0][:n] else 0


class TurnReader:
    """Reads an answer as it streams: ``feed(piece)`` and ``finish()`` return OpenAI delta
    dicts (``{"reasoning_content": ...}``, ``{"content": ...}``, ``{"tool_calls": [...]}``);
    ``message()`` is the whole assistant message once finished."""

    def __init__(self, turn: ChatTurn) -> None:
        self.turn = turn
        self.splitter = ReasoningSplitter(turn.opens_reasoning) if turn.thinks else None
        names = [t["function"]["name"] for t in turn.tools]
        self.tools = ToolCallParser(turn.markup, names) if turn.calls_tools else None
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: list[ToolCall] = []

    def _content(self, text: str, final: bool) -> list[dict]:
        if self.tools is None:
            events: list[Any] = [text] if text else []
        else:
            events = self.tools.feed(text) if text else []
            if final:
                events += self.tools.finish()
        out = []
        for e in events:
            if isinstance(e, str):
                self.content.append(e)
                out.append({"content": e})
            elif self.calls and not self.turn.parallel:
                continue  # parallel_tool_calls false: one call per answer
            else:
                i = len(self.calls)
                self.calls.append(e)
                head = {"index": i, "id": e.id, "type": "function"}
                out.append(
                    {"tool_calls": [{**head, "function": {"name": e.name, "arguments": ""}}]}
                )
                out.append({"tool_calls": [{"index": i, "function": {"arguments": e.arguments}}]})
        return out

    def _read(self, piece: str, final: bool) -> list[dict]:
        if self.splitter is None:
            return self._content(piece, final)
        parts = self.splitter.finish() if final else self.splitter.feed(piece)
        out: list[dict] = []
        for kind, text in parts:
            if kind == "reasoning":
                self.reasoning.append(text)
                out.append({"reasoning_content": text})
            else:
                out += self._content(text, False)
        if final:
            out += self._content("", True)
        return out

    def feed(self, piece: str) -> list[dict]:
        return self._read(piece, False)

    def finish(self) -> list[dict]:
        return self._read("", True)

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI's finish_reason: "tool_calls" when the answer made calls, else the
        generation's own ("stop", "length")."""
        return "tool_calls" if self.calls else engine_reason

    def message(self) -> dict:
        msg: dict[str, Any] = {"role": "assistant", "content": "".join(self.content)}
        if self.calls:
            msg["tool_calls"] = [c.openai() for c in self.calls]
            if not msg["content"].strip():
                msg["content"] = None
        if self.reasoning:
            msg["reasoning_content"] = "".join(self.reasoning)
        return msg
