"""Widgets of the chat app: messages, the input box, the stats panel."""

from __future__ import annotations

from collections.abc import Callable

from rich.table import Table
from rich.text import Text
from textual import events
from textual.containers import Vertical
from textual.message import Message
from textual.widgets import Label, Markdown, Static, TextArea


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


class MessageView(Vertical):
    """One chat message: a role line and a Markdown body (streamed into for answers)."""

    def __init__(self, role: str, content: str = "", title: str | None = None) -> None:
        super().__init__(classes=f"message {role}")
        self.role = role
        self.content = content
        self._title = title or {"user": "You", "assistant": "Assistant"}.get(role, role)
        self._stream = None

    def compose(self):
        yield Label(self._title, classes="role")
        text = hard_breaks(self.content) if self.role == "user" else self.content
        yield Markdown(text, classes="body")
        yield Label("", classes="meta")

    @property
    def body(self) -> Markdown:
        return self.query_one(".body", Markdown)

    def set_meta(self, text: str) -> None:
        meta = self.query_one(".meta", Label)
        meta.update(text)
        meta.display = bool(text)

    def on_mount(self) -> None:
        self.set_meta("")

    async def append(self, piece: str) -> None:
        """Add streamed text; rendering catches up in the background if it falls behind."""
        self.content += piece
        if self._stream is None:
            self._stream = Markdown.get_stream(self.body)
        await self._stream.write(piece)

    async def finish(self, final: str | None = None) -> None:
        """End streaming; re-render from `final` (the authoritative text) if given."""
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if final is not None and final != self.content:
            self.content = final
            await self.body.update(final)

    async def set_content(self, text: str) -> None:
        self.content = text
        await self.body.update(text)


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
