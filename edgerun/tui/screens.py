"""Modal screens: help, settings, context full, saved conversations."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Grid, Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, OptionList, Select, Static, TextArea
from textual.widgets.option_list import Option

from edgerun.generate.settings import SAMPLING_FIELDS, ModelSettings
from edgerun.tui.store import ChatSettings, Conversation

KEYS = [
    ("Enter", "send the message"),
    ("Shift+Enter / Ctrl+J", "new line in the message"),
    ("Escape", "stop the answer being generated (keeps what was written)"),
    ("Ctrl+R", "regenerate the last answer"),
    ("Ctrl+T", "edit and resend: the last question goes back into the input"),
    ("Ctrl+O", "copy the last answer to the clipboard"),
    ("Ctrl+L", "clear: start a new chat (the old one stays saved)"),
    ("F2 / Ctrl+S", "settings: sampling, system prompt, model"),
    ("F3", "open a saved conversation"),
    ("F4 / Ctrl+B", "show / hide the stats panel"),
    ("F5", "export this conversation to Markdown"),
    ("F1 / ?", "this help"),
    ("Ctrl+Q", "quit"),
]


class HelpScreen(ModalScreen[None]):
    BINDINGS = [
        Binding("escape,f1,q,question_mark", "dismiss_help", "Close", show=True),
    ]

    def __init__(self, conversations_dir: str | None = None) -> None:
        super().__init__()
        self.conversations_dir = conversations_dir

    def compose(self) -> ComposeResult:
        table = Table(box=None, show_header=False, padding=(0, 2, 0, 0), expand=True)
        table.add_column(style="bold", no_wrap=True)
        table.add_column(ratio=1)
        for key, action in KEYS:
            table.add_row(key, action)
        where = f" in {self.conversations_dir}" if self.conversations_dir else ""
        with VerticalScroll(id="help-box", classes="dialog"):
            yield Label("edgerun chat: keys", classes="dialog-title")
            yield Static(table)
            yield Label(
                f"Conversations are saved automatically{where} (JSON; F5 writes Markdown "
                "beside it).",
                id="help-note",
            )
            yield Button("Close", id="close", variant="primary")

    def action_dismiss_help(self) -> None:
        self.dismiss(None)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(None)


@dataclass
class SettingsResult:
    settings: ChatSettings
    model: str  # registry name or path
    n_ctx: int


_FIELDS = [
    ("temperature", "Temperature (0 = greedy)", float),
    ("top_k", "Top-k (0 = off)", int),
    ("top_p", "Top-p", float),
    ("min_p", "Min-p", float),
    ("repeat_penalty", "Repeat penalty", float),
    ("max_tokens", "Max tokens", int),
    ("seed", "Seed (empty = random)", int),
]


class SettingsScreen(ModalScreen["SettingsResult | None"]):
    BINDINGS = [Binding("escape", "cancel", "Cancel"), Binding("ctrl+s", "save", "Save")]

    def __init__(
        self,
        settings: ChatSettings,
        model: str,
        models: list[tuple[str, str]],
        n_ctx: int,
        recommended: ModelSettings | None = None,
    ) -> None:
        super().__init__()
        self.settings = settings
        self.model = model
        self.models = models  # (label, value)
        self.n_ctx = n_ctx
        # The loaded model's recommended settings: shown for the fields left to the model.
        self.recommended = recommended if recommended is not None else ModelSettings()

    def _shown(self, name: str) -> object:
        value = getattr(self.settings, name)
        if value is None and name in SAMPLING_FIELDS:
            return getattr(self.recommended, name)
        return value

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="settings-box", classes="dialog"):
            yield Label("Settings", classes="dialog-title")
            with Grid(id="settings-grid"):
                values = [v for _, v in self.models]
                opts = list(self.models)
                if self.model not in values:
                    opts.insert(0, (self.model, self.model))
                yield Label("Model")
                yield Select(opts, value=self.model, allow_blank=False, id="model")
                yield Label("Context size")
                yield Input(str(self.n_ctx), id="n_ctx", type="integer")
                for name, label, _ in _FIELDS:
                    value = self._shown(name)
                    yield Label(label)
                    yield Input("" if value is None else str(value), id=name)
            yield Label("Draft (ngram, a model; empty = none)")
            yield Input(self.settings.draft or "", id="draft")
            yield Label("Reasoning (on, off; empty = the template's default)")
            yield Input(self.settings.reasoning, id="reasoning")
            yield Label("System prompt")
            yield TextArea(self.settings.system, id="system")
            yield Label("", id="settings-error")
            with Horizontal(classes="buttons"):
                yield Button("Save", id="save", variant="primary")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#model", Select).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "save":
            self.action_save()
        else:
            self.action_cancel()

    def action_cancel(self) -> None:
        self.dismiss(None)

    def action_save(self) -> None:
        result = self.collect()
        if result is not None:
            self.dismiss(result)

    def collect(self) -> SettingsResult | None:
        err = self.query_one("#settings-error", Label)
        changes = {}
        for name, label, typ in _FIELDS:
            raw = self.query_one(f"#{name}", Input).value.strip()
            if name == "seed" and raw == "":
                changes[name] = None
                continue
            try:
                changes[name] = typ(raw)
            except ValueError:
                err.update(f"{label}: '{raw}' is not a valid {typ.__name__}")
                return None
        problems = []
        if changes["temperature"] < 0:
            problems.append("temperature must be >= 0")
        if changes["top_k"] < 0:
            problems.append("top-k must be >= 0")
        if not 0 < changes["top_p"] <= 1:
            problems.append("top-p must be in (0, 1]")
        if not 0 <= changes["min_p"] < 1:
            problems.append("min-p must be in [0, 1)")
        if changes["repeat_penalty"] <= 0:
            problems.append("repeat penalty must be > 0")
        if changes["max_tokens"] < 1:
            problems.append("max tokens must be >= 1")
        try:
            n_ctx = int(self.query_one("#n_ctx", Input).value.strip())
            if n_ctx < 16:
                problems.append("context size must be >= 16")
        except ValueError:
            problems.append("context size must be an integer")
            n_ctx = self.n_ctx
        reasoning = self.query_one("#reasoning", Input).value.strip().lower()
        if reasoning not in ("", "on", "off"):
            problems.append("reasoning must be on, off or empty")
        if problems:
            err.update("; ".join(problems))
            return None
        changes["reasoning"] = reasoning
        for name in SAMPLING_FIELDS:  # left at the model's value: stays the model's
            if getattr(self.settings, name) is None and changes[name] == self._shown(name):
                changes[name] = None
        changes["system"] = self.query_one("#system", TextArea).text
        draft = self.query_one("#draft", Input).value.strip()
        # empty and never set: the model keeps what it was loaded with
        changes["draft"] = None if draft == "" and self.settings.draft is None else draft
        model = self.query_one("#model", Select).value
        return SettingsResult(replace(self.settings, **changes), str(model), n_ctx)


class ContextFullScreen(ModalScreen[str]):
    """Asks what to do when the conversation no longer fits: 'drop', 'new', 'send', 'cancel'."""

    BINDINGS = [Binding("escape", "choose('cancel')", "Cancel")]

    def __init__(self, prompt_tokens: int, n_ctx: int, fits: bool) -> None:
        super().__init__()
        self.prompt_tokens = prompt_tokens
        self.n_ctx = n_ctx
        self.fits = fits

    def compose(self) -> ComposeResult:
        if self.fits:
            msg = (
                f"The context is nearly full: the conversation takes {self.prompt_tokens} of "
                f"{self.n_ctx} tokens, so the answer may be cut short."
            )
        else:
            msg = (
                f"The conversation ({self.prompt_tokens} tokens) no longer fits in the "
                f"context window ({self.n_ctx} tokens)."
            )
        with Vertical(id="ctx-box", classes="dialog"):
            yield Label("Context full", classes="dialog-title")
            yield Label(msg, id="ctx-message")
            with Horizontal(classes="buttons"):
                yield Button("Drop oldest turns", id="drop", variant="primary")
                yield Button("New chat", id="new")
                if self.fits:
                    yield Button("Send anyway", id="send")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#drop", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id or "cancel")

    def action_choose(self, what: str) -> None:
        self.dismiss(what)


class ConversationsScreen(ModalScreen["Conversation | None"]):
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, conversations: list[Conversation]) -> None:
        super().__init__()
        self.conversations = conversations

    def compose(self) -> ComposeResult:
        with Vertical(id="convs-box", classes="dialog"):
            yield Label("Saved conversations (Enter opens, Escape closes)", classes="dialog-title")
            opts = []
            for c in self.conversations:
                when = time.strftime("%Y-%m-%d %H:%M", time.localtime(c.updated))
                n = sum(1 for m in c.messages if m["role"] == "user")
                turns = f"{n} turn" + ("" if n == 1 else "s")
                opts.append(Option(f"{when}  {c.title or c.auto_title()}  ({turns})", id=c.id))
            if not opts:
                opts.append(Option("(no saved conversations yet)", id="", disabled=True))
            yield OptionList(*opts, id="convs")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        for c in self.conversations:
            if c.id == event.option.id:
                self.dismiss(c)
                return

    def action_cancel(self) -> None:
        self.dismiss(None)
