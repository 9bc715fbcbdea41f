"""Widgets of the chat app: messages (reasoning folded, tool calls as blocks), the input
box, the stats panel."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from rich.table import Table
from rich.text import Text
from textual import events
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Collapsible, Label, Markdown, Static, TextArea

from edgerun.generate.reasoning import ReasoningSplitter
from edgerun.generate.tool_calls import ToolCall, ToolCallParser, ToolMarkup


def hard_breaks(text: str) -> str:
    """Keep the user's line breaks in Markdown (outside code fences)."""
    out, fenced = [], False
    for line in text.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            out.append(line)
        else:
            out.append(line if fenced or not line.strip() else line + "  ")
    return "\n".join(out)


class AnswerParts:
    """An answer's text read as it streams into reasoning (a ``<think>`` block), content and
    tool calls (the model's own markup, when ``markup`` is given)."""

    def __init__(self, markup: ToolMarkup | None = None) -> None:
        self.splitter = ReasoningSplitter()
        self.tools = ToolCallParser(markup) if markup is not None else None

    def _content(self, text: str, final: bool) -> list[tuple[str, Any]]:
        if self.tools is None:
            return [("content", text)] if text else []
        events = (self.tools.feed(text) if text else []) + (self.tools.finish() if final else [])
        return [("content", e) if isinstance(e, str) else ("tool", e) for e in events]

    def feed(self, piece: str, final: bool = False) -> list[tuple[str, Any]]:
        out: list[tuple[str, Any]] = []
        parts = self.splitter.feed(piece) + (self.splitter.finish() if final else [])
        for kind, text in parts:
            out += [(kind, text)] if kind == "reasoning" else self._content(text, False)
        if final:
            out += self._content("", True)
        return out

    @classmethod
    def split(cls, text: str, markup: ToolMarkup | None = None) -> tuple[str, str, list[ToolCall]]:
        """(reasoning, content, calls) of a whole answer."""
        reasoning, content, calls = [], [], []
        for kind, value in cls(markup).feed(text, final=True):
            {"reasoning": reasoning, "content": content, "tool": calls}[kind].append(value)
        return "".join(reasoning), "".join(content), calls


def tool_call_text(name: str, arguments: str) -> Text:
    """A tool call as the block shows it: the function's name, then its arguments."""
    try:
        args = json.dumps(json.loads(arguments), ensure_ascii=False)
        if len(args) > 60:  # long arguments one per line
            args = "\n" + json.dumps(json.loads(arguments), ensure_ascii=False, indent=1)
    except ValueError:
        args = arguments
    out = Text("⚙ ", style="bold")
    out.append(name, style="bold")
    out.append(" " + args)
    return out


class MessageView(Vertical):
    """One chat message: a role line, the reasoning folded (a collapsed block), the Markdown
    body (streamed into for answers), and a block per tool call."""

    def __init__(
        self,
        role: str,
        content: str = "",
        title: str | None = None,
        markup: ToolMarkup | None = None,
        tool_calls: list[dict] | None = None,
    ) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.content = content
        self.markup = markup
        self._title = title or {"user": "You", "assistant": "Assistant"}.get(role, role)
        self._stream = None
        self._parts = AnswerParts(markup)
        self.reasoning, self._body, calls = "", content, []
        if role == "assistant":
            self.reasoning, self._body, calls = AnswerParts.split(content, markup)
        self.calls = [(c.name, c.arguments) for c in calls]
        for c in tool_calls or []:  # a stored message in OpenAI's shape
            fn = c.get("function") or {}
            args = fn.get("arguments")
            self.calls.append(
                (str(fn.get("name")), args if isinstance(args, str) else json.dumps(args))
            )

    def compose(self):
        yield Label(self._title, classes="role")
        block = Collapsible(
            Static(Text(self.reasoning, style="dim italic"), classes="reasoning-text"),
            title="Reasoning",
            collapsed=True,
            classes="reasoning",
        )
        block.display = bool(self.reasoning)
        yield block
        text = hard_breaks(self._body) if self.role == "user" else self._body
        yield Markdown(text, classes="body")
        with Vertical(classes="tool-calls"):
            for name, args in self.calls:
                yield Static(tool_call_text(name, args), classes="tool-call")
        yield Label("", classes="meta")

    @property
    def body(self) -> Markdown:
        return self.query_one(".body", Markdown)

    @property
    def reasoning_block(self) -> Collapsible:
        return self.query_one(".reasoning", Collapsible)

    def tool_blocks(self) -> list[Static]:
        return list(self.query(".tool-call").results(Static))

    def set_meta(self, text: str) -> None:
        meta = self.query_one(".meta", Label)
        meta.update(text)
        meta.display = bool(text)

    def on_mount(self) -> None:
        self.set_meta("")

    async def _show(self, events: list[tuple[str, Any]]) -> None:
        for kind, value in events:
            if kind == "reasoning":
                self.reasoning += value
                block = self.reasoning_block
                block.display = True
                block.query_one(".reasoning-text", Static).update(
                    Text(self.reasoning, style="dim italic")
                )
            elif kind == "content":
                self._body += value
                if self._stream is None:
                    self._stream = Markdown.get_stream(self.body)
                await self._stream.write(value)
            else:
                self.calls.append((value.name, value.arguments))
                await self.query_one(".tool-calls", Vertical).mount(
                    Static(tool_call_text(value.name, value.arguments), classes="tool-call")
                )

    async def append(self, piece: str) -> None:
        """Add streamed text; rendering catches up in the background if it falls behind."""
        self.content += piece
        await self._show(self._parts.feed(piece))

    async def finish(self, final: str | None = None) -> None:
        """End streaming; re-render from `final` (the authoritative text) if given."""
        await self._show(self._parts.feed("", final=True))
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if final is not None and final != self.content:
            await self.set_content(final)

    async def set_content(self, text: str) -> None:
        self.content = text
        reasoning, body, calls = AnswerParts.split(text, self.markup)
        if self.role != "assistant":
            reasoning, body, calls = "", text, []
        self.reasoning, self._body = reasoning, body
        block = self.reasoning_block
        block.display = bool(reasoning)
        block.query_one(".reasoning-text", Static).update(Text(reasoning, style="dim italic"))
        await self.body.update(body)
        box = self.query_one(".tool-calls", Vertical)
        await box.remove_children()
        self.calls = [(c.name, c.arguments) for c in calls]
        for name, args in self.calls:
            await box.mount(Static(tool_call_text(name, args), classes="tool-call"))


class ChatInput(TextArea):
    """Multi-line input: Enter sends, Shift+Enter or Ctrl+J inserts a new line."""

    class Submitted(Message):
        def __init__(self, text: str) -> None:
            super().__init__()
            self.text = text

    def __init__(self, **kwargs) -> None:
        kwargs.setdefault("placeholder", "Message  (Enter sends · Ctrl+J new line · F1 help)")
        super().__init__(soft_wrap=True, tab_behavior="focus", **kwargs)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            self.post_message(self.Submitted(self.text))
            return
        if event.key in ("shift+enter", "ctrl+j", "newline"):
            event.stop()
            event.prevent_default()
            start, end = self.selection
            self._replace_via_keyboard("\n", start, end)
            return
        await super()._on_key(event)


class StatsPanel(Static):
    """Live figures, one row per (label, provider) pair; a failing provider shows '?'."""

    def __init__(self, providers: list[tuple[str, Callable[[], str]]], **kwargs) -> None:
        super().__init__(**kwargs)
        self.providers = providers

    def rows(self) -> list[tuple[str, str]]:
        out = []
        for label, fn in self.providers:
            try:
                value = str(fn())
            except Exception:  # noqa: BLE001 - a figure must never take the UI down
                value = "?"
            out.append((label, value))
        return out

    def refresh_stats(self) -> None:
        table = Table.grid(padding=(0, 1))
        table.add_column(style="bold", no_wrap=True)
        table.add_column(overflow="fold")
        for label, value in self.rows():
            table.add_row(label, Text(value))
        self.update(table)
