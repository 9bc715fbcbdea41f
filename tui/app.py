"""`edgerun chat`: a Textual chat app over an edgerun Model.

The model only ever runs in thread workers; they talk to the UI with thread-safe
`post_message` calls, so the UI stays responsive while tokens are computed.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.message import Message
from textual.widgets import Footer, Header, Label, LoadingIndicator, Static

from edgerun.settings import DEFAULT_CTX, ModelSettings
from tui.backend import (
    RAW_STOPS,
    default_providers,
    fit_by_dropping,
    model_quant,
    prompt_ids,
    reserve,
    uses_template,
)
from tui.screens import (
    ContextFullScreen,
    ConversationsScreen,
    HelpScreen,
    SettingsResult,
    SettingsScreen,
)
from tui.store import ChatSettings, Conversation, ConversationStore
from tui.widgets import ChatInput, MessageView, StatsPanel

CSS = """
#main { height: 1fr; }
#conversation { width: 1fr; height: 1fr; padding: 0 1; }
#sidebar {
    width: 36; height: 1fr; padding: 0 1;
    border-left: vkey $panel-lighten-2;
}
Screen.-narrow #sidebar { display: none; }
Screen.-panel-on #sidebar { display: block; }
Screen.-panel-off #sidebar { display: none; }
#welcome { color: $text-muted; padding: 1 0; }
.message { height: auto; margin: 0 0 1 0; }
.message .role { text-style: bold; }
.message.user .role { color: $accent; }
.message.assistant .role { color: $success; }
.message.user { border-left: thick $accent; padding-left: 1; }
.message.assistant { border-left: thick $success; padding-left: 1; }
.message Markdown { margin: 0; padding: 0; }
.message .meta { color: $text-muted; }
#statusbar { height: 1; padding: 0 1; }
#spinner { width: 6; height: 1; min-height: 1; }
#status-label { color: $text-muted; }
ChatInput { height: auto; min-height: 3; max-height: 10; }
.dialog {
    width: 90%; max-width: 100; height: auto; max-height: 90%;
    background: $surface; border: thick $primary; padding: 0 1;
}
.dialog-title { text-style: bold; padding: 0 0 1 0; }
.buttons { height: auto; margin-top: 1; }
.buttons Button { margin-right: 1; min-width: 8; width: auto; }
HelpScreen, SettingsScreen, ContextFullScreen, ConversationsScreen { align: center middle; }
#settings-grid { grid-size: 2; grid-columns: 26 1fr; grid-rows: 1; grid-gutter: 0 0; height: auto; }
#settings-grid Label { padding: 0; }
#settings-grid Input { border: none; height: 1; padding: 0 1; background: $boost; }
#settings-grid Input:focus { background: $primary 40%; }
#settings-grid Input.-invalid { background: $error 40%; }
#settings-grid Select { height: 1; }
#settings-grid SelectCurrent { border: none; height: 1; padding: 0 1; background: $boost; }
#settings-grid Select:focus SelectCurrent { background: $primary 40%; }
#settings-box TextArea { height: 4; }
#settings-error { color: $error; }
#ctx-message { width: 1fr; }
#help-note { color: $text-muted; margin-top: 1; }
#convs { height: auto; max-height: 20; }
"""

POST_INTERVAL = 0.05  # seconds: streamed text reaches the UI at most ~20 times a second

# actions that only make sense on the main screen (not while a dialog is open)
_MAIN_ONLY = {
    "stop",
    "regenerate",
    "edit_last",
    "copy_last",
    "clear",
    "settings",
    "conversations",
    "toggle_panel",
    "export",
    "help",
}


class ChatApp(App):
    """The chat app. Pass `model` (a loaded edgerun Model) or `model_name` to load one."""

    TITLE = "edgerun chat"
    CSS = CSS
    HORIZONTAL_BREAKPOINTS = [(0, "-narrow"), (90, "-wide")]
    BINDINGS = [
        Binding("escape", "stop", "Stop"),
        Binding("ctrl+r", "regenerate", "Regen"),
        Binding("ctrl+t", "edit_last", "Edit"),
        Binding("ctrl+o", "copy_last", "Copy", show=False),
        Binding("ctrl+l", "clear", "New chat", show=False),
        Binding("f2,ctrl+s", "settings", "Settings"),
        Binding("f3", "conversations", "Open", show=False),
        Binding("f4,ctrl+b", "toggle_panel", "Panel", show=False),
        Binding("f5", "export", "Export", show=False),
        Binding("f1,question_mark", "help", "Help"),
        Binding("ctrl+q", "quit", "Quit", priority=True),
    ]

    # -- messages from the workers ------------------------------------------------
    class Token(Message):
        def __init__(self, piece: str) -> None:
            super().__init__()
            self.piece = piece

    class Finished(Message):
        def __init__(self, text: str, stats: Any, error: str | None) -> None:
            super().__init__()
            self.text, self.stats, self.error = text, stats, error

    class ContextFull(Message):
        def __init__(self, prompt_tokens: int, fits: bool) -> None:
            super().__init__()
            self.prompt_tokens, self.fits = prompt_tokens, fits

    class Dropped(Message):
        def __init__(self, count: int) -> None:
            super().__init__()
            self.count = count

    class ModelLoaded(Message):
        def __init__(self, model: Any, label: str, quant: str) -> None:
            super().__init__()
            self.model, self.label, self.quant = model, label, quant

    class ModelFailed(Message):
        def __init__(self, name: str, error: str) -> None:
            super().__init__()
            self.name, self.error = name, error

    def __init__(
        self,
        model_name: str | None = None,
        *,
        model: Any = None,
        n_ctx: int | None = None,
        threads: int | None = None,
        kv_type: str | None = None,
        offload: dict | None = None,
        system: str | None = None,
        conversations_dir: str | Path | None = None,
        resume: bool = False,
        settings: ChatSettings | None = None,
        warmup: bool = True,
    ) -> None:
        super().__init__()
        self.model = None
        self.model_name = model_name
        self.model_label = ""
        self.model_quant = ""
        self.n_ctx = n_ctx  # None until a model is loaded: its recommended size
        self.ctx_given = n_ctx is not None  # else a model switch takes the new model's
        self.threads = threads
        self.kv_type = kv_type
        self.offload = offload or {}  # load() keywords: ram_budget, offload, offload_options
        self.warmup = warmup
        self.store = ConversationStore(conversations_dir)
        self.status_text = "starting"
        self.generating = False
        self.loading = False
        self.last_sampling: dict[str, Any] | None = None
        self.last_stats: Any = None
        self._cancel = threading.Event()
        self._gen = 0  # id of the current generation; messages from older ones are dropped
        self._gen_worker: Any = None
        self._answer: MessageView | None = None
        self._preloaded = model
        self._session: Any = None  # edgerun.Session of (self.conv, self.model): its KV cache
        self._session_key: tuple | None = None
        self._queued = False  # a message typed while the model loads, sent once it is ready
        conv = self.store.latest() if resume else None
        self.resumed = conv is not None
        if conv is None:
            conv = Conversation(settings=dataclasses.replace(settings or ChatSettings()))
        if system is not None:
            conv.settings.system = system
        self.conv = conv

    # -- layout ------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        yield Header()
        with Horizontal(id="main"):
            yield VerticalScroll(id="conversation")
            yield StatsPanel(self.stats_providers(), id="sidebar")
        with Horizontal(id="statusbar"):
            yield LoadingIndicator(id="spinner")
            yield Label("", id="status-label")
        yield ChatInput(id="input")
        yield Footer()

    def stats_providers(self) -> list[tuple[str, Any]]:
        """Rows of the side panel: (label, zero-argument callable returning the value).

        Extend in a subclass, e.g. `return super().stats_providers() + [("KV", fn)]`.
        """
        return default_providers(self)

    @property
    def input(self) -> ChatInput:
        return self.query_one("#input", ChatInput)

    @property
    def conversation(self) -> VerticalScroll:
        return self.query_one("#conversation", VerticalScroll)

    @property
    def panel(self) -> StatsPanel:
        return self.query_one("#sidebar", StatsPanel)

    async def on_mount(self) -> None:
        self.conversation.anchor()
        await self._render_conversation()
        self.input.focus()
        self.set_interval(0.5, self._tick)
        if self._preloaded is not None:
            m = self._preloaded
            self._preloaded = None
            await self._on_model_ready(m, self._label_for(self.model_name, m), model_quant(m))
        else:
            self.load_model(self.model_name, self.n_ctx)
        if self.resumed:
            self.notify(f"Resumed: {self.conv.title or self.conv.auto_title()}")
        self._report_broken()

    def _report_broken(self) -> None:
        """Name the conversation files that could not be read (they are skipped, the others
        still open)."""
        for path, why in self.store.broken:
            self.notify(
                f"Skipped an unreadable conversation {path.name}: {why}", severity="warning"
            )
        self._tick()

    def _set_status(self, text: str, busy: bool = False) -> None:
        self.status_text = text
        try:
            self.query_one("#status-label", Label).update(text)
            self.query_one("#spinner", LoadingIndicator).display = busy
        except NoMatches:  # shutting down
            pass

    def _tick(self) -> None:
        try:
            self.panel.refresh_stats()
        except NoMatches:  # shutting down, or a dialog owns the screen stack
            return
        m = self.model
        if m is None:
            self.sub_title = self.status_text
            return
        parts = [self.model_label, f"ctx {self.cache_length()}/{m.n_ctx}"]
        st = self.last_stats
        if st is not None and st.generated_tokens:
            parts.append(f"{st.generate_tps:.1f} tok/s")
        self.sub_title = " · ".join(parts)

    async def _render_conversation(self) -> None:
        conv = self.conversation
        await conv.remove_children()
        if not self.conv.messages:
            await conv.mount(
                Static(
                    "Type a message and press Enter. Shift+Enter or Ctrl+J: new line. F1: help.",
                    id="welcome",
                )
            )
        for m in self.conv.messages:
            await conv.mount(self._view_for(m))
        conv.scroll_end(animate=False)

    def _view_for(self, m: dict[str, Any]) -> MessageView:
        title = None
        if m["role"] == "assistant":
            title = f"Assistant · {m.get('model') or self.model_label or 'model'}"
        view = MessageView(m["role"], m["content"], title=title)
        return view

    async def _mount_message(self, view: MessageView) -> None:
        for w in self.conversation.query("#welcome"):
            await w.remove()
        await self.conversation.mount(view)
        self.conversation.scroll_end(animate=False)

    def _views(self) -> list[MessageView]:
        return list(self.conversation.query(MessageView))

    # -- model loading -----------------------------------------------------------------
    @staticmethod
    def _label_for(name: str | None, model: Any) -> str:
        try:
            from edgerun import registry

            for m in registry.manifests():
                if m.filename == model.path.name:
                    return m.name
        except Exception:  # noqa: BLE001
            pass
        return str(name) if name else model.path.stem

    def load_model(self, name: str | None, n_ctx: int | None) -> None:
        """Load a model in a thread worker; the UI keeps running meanwhile."""
        self.loading = True
        what = f"Loading {name or 'the default model'}"
        try:
            from edgerun import _numba_env

            if _numba_env.kernel_cache_is_cold():
                what += " (first run: compiling kernels, a minute or so)"
        except Exception:  # noqa: BLE001 - a hint only
            pass
        self._set_status(what + "…", busy=True)
        self._load_worker(name, n_ctx)

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load_worker(self, name: str | None, n_ctx: int | None) -> None:
        try:
            import edgerun

            model = edgerun.load(
                name, n_ctx=n_ctx, threads=self.threads, kv_type=self.kv_type, **self.offload
            )
            quant = model_quant(model)
            if self.warmup:  # compile / load the Numba kernels before the first question
                try:
                    model.warm_up()
                except Exception:  # noqa: BLE001 - warm-up is best effort
                    pass
            self.post_message(self.ModelLoaded(model, self._label_for(name, model), quant))
        except Exception as e:  # noqa: BLE001 - shown to the user, never a crash
            self.post_message(self.ModelFailed(str(name or "default model"), str(e)))

    async def on_chat_app_model_loaded(self, msg: ModelLoaded) -> None:
        await self._on_model_ready(msg.model, msg.label, msg.quant)

    async def _on_model_ready(self, model: Any, label: str, quant: str) -> None:
        self.model = model
        self.model_label = label
        self.model_quant = quant
        self.model_name = label
        self.n_ctx = model.n_ctx
        self.loading = False
        self.conv.model = label
        self._set_status(f"{label} ready", busy=False)
        if not uses_template(model):
            self.notify(
                f"{label} has no chat template (a base model): answers are plain "
                "completions of the conversation transcript.",
                severity="warning",
                timeout=8,
            )
        self._tick()
        msgs = self.conv.messages
        if self._queued and not self.generating and msgs and msgs[-1]["role"] == "user":
            await self._start_generation(check=True)
        self._queued = False

    def on_chat_app_model_failed(self, msg: ModelFailed) -> None:
        self.loading = False
        if self._queued and self.model is None:
            self._queued = False
            self.notify("Your message was not sent: load a model (F2), then Ctrl+R.")
        state = f"{self.model_label} (kept)" if self.model is not None else "no model loaded"
        self._set_status(f"Could not load {msg.name}: {state}", busy=False)
        self.notify(f"Could not load {msg.name}: {msg.error}", severity="error", timeout=10)

    # -- sending and generating -----------------------------------------------------------
    @on(ChatInput.Submitted)
    async def _on_submit(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> bool:
        """Send a user message (what Enter does). Returns False if it could not be sent."""
        if not text.strip():
            return False
        if self.generating:
            self.notify("Still answering: press Escape to stop it first.", severity="warning")
            return False
        if self.model is None and (self._queued or not self.loading):
            why = "A message is already waiting." if self._queued else "No model is loaded (F2)."
            self.notify(why, severity="warning")
            return False
        self.input.clear()
        msg = {"role": "user", "content": text}
        self.conv.messages.append(msg)
        await self._mount_message(self._view_for(msg))
        self.save()
        if self.model is None:
            self._queued = True
            self.notify("The model is still loading: your message goes as soon as it is ready.")
            return True
        await self._start_generation(check=True)
        return True

    def session(self) -> Any:
        """The current conversation's Session on the loaded model (None for a model without
        sessions). Its KV cache carries over between turns and is saved beside the
        conversation, so reopening a chat does not recompute it."""
        model = self.model
        if model is None or not hasattr(model, "session"):
            return None
        key = (self.conv.id, id(model))
        if self._session_key != key:
            self._session = None
            path = self.store.kv_path(self.conv)
            if path.exists():
                from edgerun.errors import EdgerunError
                from edgerun.session import Session

                try:
                    self._session = Session.load(model, path)
                except EdgerunError:  # another model's cache, or damaged: recompute instead
                    self._session = None
            if self._session is None:
                self._session = model.session()
            self._session_key = key
        return self._session

    def cache_length(self) -> int:
        s = self.session()
        if s is not None:
            return s.cache.length
        return self.model.generator.cache.length if self.model is not None else 0

    async def _start_generation(self, check: bool) -> None:
        model = self.model
        view = MessageView("assistant", "", title=f"Assistant · {self.model_label}")
        await self._mount_message(view)
        self._answer = view
        self.generating = True
        self._cancel = threading.Event()
        self._gen += 1
        sampling = self.conv.settings.sampling(_recommended(model))
        self.last_sampling = dict(sampling)
        self._set_status("Thinking…  (Escape stops)", busy=True)
        self._gen_worker = self._generate_worker(
            self._gen, model, self._messages(), sampling, check, self._cancel, self.session()
        )

    def _messages(self) -> list[dict[str, str]]:
        """The conversation as the model sees it, with the model's default system prompt."""
        rec = _recommended(self.model)
        return self.conv.chat_messages(rec.system if rec is not None else "")

    def _post(self, gen: int, msg: Message) -> None:
        """From a worker thread: tag `msg` with its generation id and queue it."""
        msg.gen = gen
        self.post_message(msg)

    def _stale(self, msg: Message) -> bool:
        return getattr(msg, "gen", self._gen) != self._gen

    async def _abandon_generation(self) -> None:
        """Stop the running generation and forget it (before the conversation is replaced)."""
        if self._gen_worker is not None and self.generating:
            self._cancel.set()
            await self._gen_worker.wait()
            partial = self._answer.content if self._answer is not None else ""
            if partial:  # keep what was written so far
                entry = {"role": "assistant", "content": partial, "model": self.model_label}
                self.conv.messages.append(entry)
        self._gen += 1
        self.generating = False
        self._answer = None

    @work(thread=True, group="generate", exit_on_error=False)
    def _generate_worker(
        self,
        gen: int,
        model: Any,
        messages: list[dict[str, str]],
        sampling: dict[str, Any],
        check: bool,
        cancel: threading.Event,
        session: Any = None,
    ) -> None:
        from edgerun.errors import ContextOverflowError

        text = ""
        n = 0
        try:
            ids = prompt_ids(model, messages)
            n = len(ids)
            if check and n + reserve(model, sampling["max_tokens"]) > model.n_ctx:
                self._post(gen, self.ContextFull(n, n < model.n_ctx))
                return
            if cancel.is_set():  # Escape before the first token: nothing to keep
                self._post(gen, self.Finished("", None, None))
                return
            stop = () if uses_template(model) else RAW_STOPS
            request = None
            if session is not None:  # the session's own KV cache, via the model's scheduler
                request = session.complete(ids, stop=stop, **sampling)
                it = iter(request)
            else:
                it = model.generate(ids, stop=stop, **sampling)
            pending, last_post = "", 0.0
            try:
                for piece in it:
                    text += piece
                    pending += piece
                    now = time.monotonic()
                    if now - last_post >= POST_INTERVAL:  # batch pieces on fast machines
                        self._post(gen, self.Token(pending))
                        pending, last_post = "", now
                    if cancel.is_set():
                        break
            finally:
                it.close()  # marks stats.finish_reason "cancelled" if we broke out
                if request is not None:
                    request.finished.wait(timeout=30)
            if pending:
                self._post(gen, self.Token(pending))
            if not uses_template(model):
                text = text.strip()
            stats = request.stats if request is not None else model.stats
            self._post(gen, self.Finished(text, dataclasses.replace(stats), None))
        except ContextOverflowError:
            self._post(gen, self.ContextFull(n, False))
        except Exception as e:  # noqa: BLE001 - shown to the user, never a crash
            self._post(gen, self.Finished(text, None, f"{type(e).__name__}: {e}"))

    async def on_chat_app_token(self, msg: Token) -> None:
        if not self._stale(msg) and self._answer is not None:
            await self._answer.append(msg.piece)

    async def on_chat_app_finished(self, msg: Finished) -> None:
        if self._stale(msg):
            return
        view, self._answer = self._answer, None
        self.generating = False
        text = msg.text
        if view is not None:
            await view.finish(text)
        st = msg.stats
        if st is None and msg.error is None:  # stopped before it started
            if view is not None:
                await view.remove()
            self._set_status("Stopped", busy=False)
            return
        self.last_stats = st
        if msg.error is not None:
            self._set_status("Error", busy=False)
            self.notify(msg.error, severity="error", timeout=10)
            if view is not None:
                view.set_meta(f"error: {msg.error}")
            if not text:
                if view is not None:
                    await view.remove()
                self._tick()
                return
        entry: dict[str, Any] = {"role": "assistant", "content": text, "model": self.model_label}
        if st is not None:
            entry["stats"] = {
                "prompt_tokens": st.prompt_tokens,
                "cached_tokens": st.cached_tokens,
                "generated_tokens": st.generated_tokens,
                "prompt_tps": round(st.prompt_tps, 2),
                "generate_tps": round(st.generate_tps, 2),
                "finish_reason": st.finish_reason,
            }
            if view is not None:
                view.set_meta(
                    f"{st.generated_tokens} tokens · {st.generate_tps:.1f} tok/s · "
                    f"{st.finish_reason}"
                )
            self._set_status(f"Done ({st.finish_reason})", busy=False)
            if st.finish_reason == "cancelled":
                self.notify("Stopped.")
            elif (
                st.finish_reason == "length"
                and self.model is not None
                and self.cache_length() >= self.model.n_ctx
            ):
                self.notify(
                    "The context window is full and the answer was cut off. Your next message "
                    "will offer to drop the oldest turns or start a new chat.",
                    severity="warning",
                    timeout=10,
                )
        self.conv.messages.append(entry)
        self.save()
        self._tick()

    # -- context full ------------------------------------------------------------
    async def on_chat_app_context_full(self, msg: ContextFull) -> None:
        if self._stale(msg):
            return
        view, self._answer = self._answer, None
        self.generating = False
        if view is not None:
            await view.remove()
        self._set_status("Context full", busy=False)
        self.push_screen(
            ContextFullScreen(msg.prompt_tokens, self.model.n_ctx, msg.fits),
            callback=self._on_context_choice,
        )

    async def _on_context_choice(self, choice: str | None) -> None:
        if choice == "send":
            await self._start_generation(check=False)
        elif choice == "drop":
            self._set_status("Making room…", busy=True)
            self._drop_worker(
                self._gen, self.model, self._messages(), self.conv.settings.max_tokens
            )
        elif choice == "new":
            last = self._pop_last_user()
            self.save()
            self.conv = Conversation(
                settings=dataclasses.replace(self.conv.settings), model=self.model_label
            )
            await self._render_conversation()
            if last is not None:
                await self.send(last)
            self.notify("Started a new chat.")
        else:
            last = self._pop_last_user()
            await self._render_conversation()
            self.save()
            if last is not None:
                self.input.load_text(last)
            self._set_status("Cancelled", busy=False)

    def _pop_last_user(self) -> str | None:
        msgs = self.conv.messages
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if msgs and msgs[-1]["role"] == "user":
            return msgs.pop()["content"]
        return None

    @work(thread=True, group="generate", exit_on_error=False)
    def _drop_worker(
        self, gen: int, model: Any, messages: list[dict[str, str]], max_tokens: int
    ) -> None:
        system = [m for m in messages if m["role"] == "system"]
        turns = [m for m in messages if m["role"] != "system"]
        try:
            self._post(gen, self.Dropped(fit_by_dropping(model, system, turns, max_tokens)))
        except Exception:  # noqa: BLE001
            self._post(gen, self.Dropped(-1))

    async def on_chat_app_dropped(self, msg: Dropped) -> None:
        if self._stale(msg):
            return
        if msg.count < 0:
            last = self._pop_last_user()
            await self._render_conversation()
            self.save()
            if last is not None:
                self.input.load_text(last)
            self._set_status("Message too long", busy=False)
            self.notify(
                "Even on its own, this message does not fit in the context window: shorten it, "
                "lower Max tokens, or raise the context size in Settings (F2).",
                severity="error",
                timeout=10,
            )
            return
        del self.conv.messages[: msg.count]
        await self._render_conversation()
        self.save()
        self.notify(f"Dropped the {msg.count} oldest messages to make room.")
        await self._start_generation(check=False)

    # -- actions -------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in _MAIN_ONLY and self.screen.is_modal:
            return False
        return True

    async def action_quit(self) -> None:
        self._cancel.set()  # the generation thread stops at its next token
        self.exit()

    def action_stop(self) -> None:
        if self.generating:
            self._cancel.set()
            self._set_status("Stopping…", busy=True)

    async def action_regenerate(self) -> None:
        if self.generating or self.model is None:
            self.notify("Wait for the current answer (or press Escape).", severity="warning")
            return
        msgs = self.conv.messages
        if not msgs:
            self.notify("Nothing to regenerate yet.")
            return
        if msgs[-1]["role"] == "assistant":
            msgs.pop()
            views = self._views()
            if views:
                await views[-1].remove()
        if not msgs or msgs[-1]["role"] != "user":
            self.notify("Nothing to regenerate yet.")
            return
        await self._start_generation(check=True)

    async def action_edit_last(self) -> None:
        if self.generating:
            self.notify("Wait for the current answer (or press Escape).", severity="warning")
            return
        last = self._pop_last_user()
        if last is None:
            self.notify("No message to edit.")
            return
        await self._render_conversation()
        self.save()
        self.input.load_text(last)
        self.input.focus()
        self.input.move_cursor(self.input.document.end)

    def last_answer(self) -> str | None:
        for m in reversed(self.conv.messages):
            if m["role"] == "assistant":
                return m["content"]
        return None

    def action_copy_last(self) -> None:
        text = self.last_answer()
        if not text:
            self.notify("No answer to copy yet.")
            return
        self.copy_to_clipboard(text)
        self.notify(f"Copied the last answer ({len(text)} characters).")

    async def action_clear(self) -> None:
        await self._abandon_generation()
        self.save()
        self.conv = Conversation(
            settings=dataclasses.replace(self.conv.settings), model=self.model_label
        )
        await self._render_conversation()
        self.input.clear()
        self.notify("New chat.")

    def action_help(self) -> None:
        self.push_screen(HelpScreen(str(self.store.dir)))

    def action_toggle_panel(self) -> None:
        visible = self.panel.display
        self.screen.set_class(visible, "-panel-off")
        self.screen.set_class(not visible, "-panel-on")

    def action_export(self) -> None:
        if not self.conv.messages:
            self.notify("Nothing to export yet.")
            return
        self.save()
        path = self.store.export_markdown(self.conv)
        self.notify(f"Exported to {path}", timeout=8)

    def action_settings(self) -> None:
        models: list[tuple[str, str]] = []
        current = self.model_name or ""
        try:
            from edgerun import registry

            current = current or registry.default_manifest().name
            for m in registry.manifests():
                if registry.is_installed(m):
                    tag = "" if m.chat else ", no chat template"
                    models.append((f"{m.name} ({m.quant}{tag})", m.name))
        except Exception:  # noqa: BLE001
            pass
        self.push_screen(
            SettingsScreen(
                self.conv.settings, current, models, self._ctx_shown(), _recommended(self.model)
            ),
            callback=self._apply_settings,
        )

    def _ctx_shown(self) -> int:
        """The context size the settings dialog shows: the model's, or the default."""
        return self.n_ctx if self.n_ctx is not None else DEFAULT_CTX

    def _apply_settings(self, result: SettingsResult | None) -> None:
        if result is None:
            return
        self.conv.settings = result.settings
        self.save()
        changed_model = result.model != (self.model_name or "")
        changed_ctx = result.n_ctx != self._ctx_shown()
        if changed_model or changed_ctx:
            if self.generating:
                self._cancel.set()
            self.ctx_given = self.ctx_given or changed_ctx
            self.load_model(result.model, result.n_ctx if self.ctx_given else None)
        self.notify("Settings saved.")

    def action_conversations(self) -> None:
        convs = self.store.list()
        self._report_broken()
        self.push_screen(ConversationsScreen(convs), callback=self._open_conversation)

    async def _open_conversation(self, conv: Conversation | None) -> None:
        if conv is None:
            return
        await self._abandon_generation()
        self.save()
        self.conv = conv
        await self._render_conversation()
        self.notify(f"Opened: {conv.title or conv.auto_title()}")

    # -- persistence -----------------------------------------------------------------
    def save(self) -> Path | None:
        """Save the conversation (never raises: a failed save is a notification).

        A conversation with no messages left is not kept on disk.
        """
        try:
            if not self.conv.messages:
                self.store.delete(self.conv)
                return None
            path = self.store.save(self.conv)
            self._save_cache()
            return path
        except OSError as e:
            self.notify(f"Could not save the conversation: {e}", severity="error")
            return None

    def _save_cache(self) -> None:
        """The session's KV cache beside the conversation (best effort: a failure only
        means the next open recomputes it)."""
        s = self._session if self._session_key == (self.conv.id, id(self.model)) else None
        if s is None or self.generating or not s.cache.length:
            return
        from edgerun.errors import EdgerunError

        try:
            s.messages = [
                {"role": m["role"], "content": m["content"]}
                for m in self.conv.messages
                if isinstance(m.get("content"), str)
            ]
            s.save(self.store.kv_path(self.conv))
        except (EdgerunError, OSError):
            pass


def _recommended(model: Any) -> ModelSettings | None:
    """The loaded model's recommended settings (None for a stand-in without them)."""
    rec = getattr(model, "settings", None)
    return rec if isinstance(rec, ModelSettings) else None


def run(args: Any) -> int:
    """Entry point for `edgerun chat` (args from the CLI parser)."""
    app = ChatApp(
        getattr(args, "model", None),
        n_ctx=getattr(args, "ctx", None),
        threads=getattr(args, "threads", None),
        kv_type=getattr(args, "kv_type", None),
        offload=getattr(args, "offload_kwargs", None),
        system=getattr(args, "system", None),
        conversations_dir=getattr(args, "conversations_dir", None),
        resume=getattr(args, "resume", False),
    )
    app.run()
    return 0


def main() -> None:  # python -m tui.app
    import argparse

    p = argparse.ArgumentParser(prog="edgerun chat")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-c", "--ctx", type=int, default=None)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--kv-type", choices=("f32", "f16"), default="f32")
    p.add_argument("--system", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--conversations-dir", default=None)
    raise SystemExit(run(p.parse_args()))


if __name__ == "__main__":
    main()
