"""`edgerun chat`: the Textual view of the chat app.

It draws the conversation and the dialogs and turns keys into calls on the controller
(chat.ChatController). The controller's jobs run in thread workers here; the events they emit
come back through thread-safe `post_message` calls, so the UI stays responsive while tokens are
computed. Styles live in app.tcss.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from textual import on, work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, VerticalScroll
from textual.css.query import NoMatches
from textual.message import Message
from textual.widgets import Footer, Header, Label, LoadingIndicator, Static

from edgerun.tui import chat
from edgerun.tui.chat import ChatController, default_providers, recommended, uses_template
from edgerun.tui.screens import (
    ContextFullScreen,
    ConversationsScreen,
    HelpScreen,
    SettingsResult,
    SettingsScreen,
)
from edgerun.tui.store import ChatSettings, Conversation
from edgerun.tui.widgets import ChatInput, MessageView, StatsPanel

CSS_PATH = Path(__file__).with_name("app.tcss")

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


class _Event(Message):
    """A controller event (chat.py) delivered on the UI thread; its fields are attributes."""

    def __init__(self, event: chat.Event) -> None:
        super().__init__()
        self.event = event
        for f in dataclasses.fields(event):
            setattr(self, f.name, getattr(event, f.name))


class ChatApp(App):
    """The chat app. Pass `model` (a loaded edgerun Model) or `model_name` to load one."""

    TITLE = "edgerun chat"
    CSS_PATH = CSS_PATH
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

    # -- the controller's events as Textual messages ------------------------------------
    class Token(_Event):
        pass

    class Finished(_Event):
        pass

    class ContextFull(_Event):
        pass

    class Dropped(_Event):
        pass

    class ModelLoaded(_Event):
        pass

    class ModelFailed(_Event):
        pass

    _MESSAGES: dict[type, type[_Event]] = {
        chat.Token: Token,
        chat.Finished: Finished,
        chat.ContextFull: ContextFull,
        chat.Dropped: Dropped,
        chat.ModelLoaded: ModelLoaded,
        chat.ModelFailed: ModelFailed,
    }

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
        self.chat = ChatController(
            model_name,
            model=model,
            n_ctx=n_ctx,
            threads=threads,
            kv_type=kv_type,
            offload=offload,
            system=system,
            conversations_dir=conversations_dir,
            resume=resume,
            settings=settings,
            warmup=warmup,
        )
        self._gen_worker: Any = None
        self._answer: MessageView | None = None  # the answer being streamed into

    # -- the controller's state, read through ---------------------------------------------
    @property
    def model(self) -> Any:
        return self.chat.model

    @property
    def model_label(self) -> str:
        return self.chat.model_label

    @property
    def model_quant(self) -> str:
        return self.chat.model_quant

    @property
    def conv(self) -> Conversation:
        return self.chat.conv

    @property
    def store(self):
        return self.chat.store

    @property
    def generating(self) -> bool:
        return self.chat.generating

    @property
    def loading(self) -> bool:
        return self.chat.loading

    @property
    def resumed(self) -> bool:
        return self.chat.resumed

    @property
    def last_stats(self) -> Any:
        return self.chat.last_stats

    @property
    def last_sampling(self) -> dict[str, Any] | None:
        return self.chat.last_sampling

    @property
    def status_text(self) -> str:
        return self.chat.status_text

    def session(self) -> Any:
        return self.chat.session()

    def cache_length(self) -> int:
        return self.chat.cache_length()

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
        return default_providers(self.chat)

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
        preloaded = self.chat.take_preloaded()
        if preloaded is not None:
            await self._on_model_ready(preloaded)
        else:
            self.load_model(self.chat.model_name, self.chat.n_ctx)
        if self.chat.resumed:
            self.notify(f"Resumed: {self.conv.title or self.conv.auto_title()}")
        self._report_broken()

    def _report_broken(self) -> None:
        """Name the conversation files that could not be read (they are skipped, the others
        still open)."""
        for path, why in self.chat.store.broken:
            self.notify(
                f"Skipped an unreadable conversation {path.name}: {why}", severity="warning"
            )
        self._tick()

    def _set_status(self, text: str, busy: bool = False) -> None:
        self.chat.status_text = text
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
        m = self.chat.model
        if m is None:
            self.sub_title = self.chat.status_text
            return
        parts = [self.chat.model_label, f"ctx {self.chat.cache_length()}/{m.n_ctx}"]
        st = self.chat.last_stats
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
            title = f"Assistant · {m.get('model') or self.chat.model_label or 'model'}"
        view = MessageView(
            m["role"],
            m.get("content") or "",
            title=title,
            markup=self.chat.tool_markup,
            tool_calls=m.get("tool_calls"),
        )
        return view

    async def _mount_message(self, view: MessageView) -> None:
        for w in self.conversation.query("#welcome"):
            await w.remove()
        await self.conversation.mount(view)
        self.conversation.scroll_end(animate=False)

    def _views(self) -> list[MessageView]:
        return list(self.conversation.query(MessageView))

    # -- running the controller's jobs ---------------------------------------------------
    def _post(self, event: chat.Event) -> None:
        """From a worker thread: queue a controller event as a message for the UI thread."""
        self.post_message(self._MESSAGES[type(event)](event))

    @work(thread=True, exclusive=True, group="load", exit_on_error=False)
    def _load_worker(self, job: Callable[[chat.Emit], None]) -> None:
        job(self._post)

    @work(thread=True, group="generate", exit_on_error=False)
    def _generate_worker(self, job: Callable[[chat.Emit], None]) -> None:
        job(self._post)

    @work(thread=True, group="generate", exit_on_error=False)
    def _drop_worker(self, job: Callable[[chat.Emit], None]) -> None:
        job(self._post)

    # -- model loading -----------------------------------------------------------------
    def load_model(self, name: str | None, n_ctx: int | None) -> None:
        """Load a model in a thread worker; the UI keeps running meanwhile."""
        job = self.chat.load(name, n_ctx)
        self._set_status(self.chat.loading_text(name), busy=True)
        self._load_worker(job)

    async def on_chat_app_model_loaded(self, msg: ModelLoaded) -> None:
        await self._on_model_ready(msg.event)

    async def _on_model_ready(self, ev: chat.ModelLoaded) -> None:
        send_queued = self.chat.model_ready(ev)
        label = ev.label
        self._set_status(f"{label} ready", busy=False)
        if not uses_template(ev.model):
            self.notify(
                f"{label} has no chat template (a base model): answers are plain "
                "completions of the conversation transcript.",
                severity="warning",
                timeout=8,
            )
        self._tick()
        if send_queued:
            await self._start_generation(check=True)

    def on_chat_app_model_failed(self, msg: ModelFailed) -> None:
        if self.chat.model_failed():
            self.notify("Your message was not sent: load a model (F2), then Ctrl+R.")
        m = self.chat
        state = f"{m.model_label} (kept)" if m.model is not None else "no model loaded"
        self._set_status(f"Could not load {msg.event.name}: {state}", busy=False)
        self.notify(
            f"Could not load {msg.event.name}: {msg.event.error}", severity="error", timeout=10
        )

    # -- sending and generating -----------------------------------------------------------
    @on(ChatInput.Submitted)
    async def _on_submit(self, event: ChatInput.Submitted) -> None:
        await self.send(event.text)

    async def send(self, text: str) -> bool:
        """Send a user message (what Enter does). Returns False if it could not be sent."""
        if not text.strip():
            return False
        why = self.chat.send_refusal()
        if why is not None:
            self.notify(why, severity="warning")
            return False
        self.input.clear()
        msg = self.chat.add_user(text)
        await self._mount_message(self._view_for(msg))
        self.save()
        if self.chat.model is None:
            self.chat.queued = True
            self.notify("The model is still loading: your message goes as soon as it is ready.")
            return True
        await self._start_generation(check=True)
        return True

    async def _start_generation(self, check: bool) -> None:
        view = MessageView(
            "assistant",
            "",
            title=f"Assistant · {self.chat.model_label}",
            markup=self.chat.tool_markup,
        )
        await self._mount_message(view)
        self._answer = view
        job = self.chat.start(check)
        self._set_status("Thinking…  (Escape stops)", busy=True)
        self._gen_worker = self._generate_worker(job)

    async def _abandon_generation(self) -> None:
        """Stop the running generation and forget it (before the conversation is replaced)."""
        if self._gen_worker is not None and self.chat.generating:
            self.chat.cancel.set()
            await self._gen_worker.wait()
        self.chat.abandon()
        self._answer = None

    async def on_chat_app_token(self, msg: Token) -> None:
        if not self.chat.stale(msg.event) and self._answer is not None:
            self.chat.on_token(msg.event)
            await self._answer.append(msg.event.piece)

    async def on_chat_app_finished(self, msg: Finished) -> None:
        ev = msg.event
        if self.chat.stale(ev):
            return
        view, self._answer = self._answer, None
        entry = self.chat.finish(ev)
        if view is not None:
            await view.finish(ev.text)
        st = ev.stats
        if st is None and ev.error is None:  # stopped before it started
            if view is not None:
                await view.remove()
            self._set_status("Stopped", busy=False)
            return
        if ev.error is not None:
            self._set_status("Error", busy=False)
            self.notify(ev.error, severity="error", timeout=10)
            if view is not None:
                view.set_meta(f"error: {ev.error}")
            if entry is None:  # no text to keep
                if view is not None:
                    await view.remove()
                self._tick()
                return
        if st is not None:
            if view is not None:
                view.set_meta(
                    f"{st.generated_tokens} tokens · {st.generate_tps:.1f} tok/s · "
                    f"{st.finish_reason}"
                )
            self._set_status(f"Done ({st.finish_reason})", busy=False)
            if st.finish_reason == "cancelled":
                self.notify("Stopped.")
            elif self.chat.filled_context(st):
                self.notify(
                    "The context window is full and the answer was cut off. Your next message "
                    "will offer to drop the oldest turns or start a new chat.",
                    severity="warning",
                    timeout=10,
                )
        self.save()
        self._tick()

    # -- context full ------------------------------------------------------------
    async def on_chat_app_context_full(self, msg: ContextFull) -> None:
        ev = msg.event
        if self.chat.stale(ev):
            return
        view, self._answer = self._answer, None
        self.chat.context_full()
        if view is not None:
            await view.remove()
        self._set_status("Context full", busy=False)
        self.push_screen(
            ContextFullScreen(ev.prompt_tokens, self.chat.model.n_ctx, ev.fits),
            callback=self._on_context_choice,
        )

    async def _on_context_choice(self, choice: str | None) -> None:
        if choice == "send":
            await self._start_generation(check=False)
        elif choice == "drop":
            self._set_status("Making room…", busy=True)
            self._drop_worker(self.chat.drop_job())
        elif choice == "new":
            last = self.chat.pop_last_user()
            self.save()
            self.chat.new_conversation()
            await self._render_conversation()
            if last is not None:
                await self.send(last)
            self.notify("Started a new chat.")
        else:
            await self._give_back_last_question()
            self._set_status("Cancelled", busy=False)

    async def _give_back_last_question(self) -> None:
        """The last question leaves the conversation and goes back into the input."""
        last = self.chat.pop_last_user()
        await self._render_conversation()
        self.save()
        if last is not None:
            self.input.load_text(last)

    async def on_chat_app_dropped(self, msg: Dropped) -> None:
        ev = msg.event
        if self.chat.stale(ev):
            return
        if ev.count < 0:
            await self._give_back_last_question()
            self._set_status("Message too long", busy=False)
            self.notify(
                "Even on its own, this message does not fit in the context window: shorten it, "
                "lower Max tokens, or raise the context size in Settings (F2).",
                severity="error",
                timeout=10,
            )
            return
        self.chat.drop_oldest(ev.count)
        await self._render_conversation()
        self.save()
        self.notify(f"Dropped the {ev.count} oldest messages to make room.")
        await self._start_generation(check=False)

    # -- actions -------------------------------------------------------------------
    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in _MAIN_ONLY and self.screen.is_modal:
            return False
        return True

    async def action_quit(self) -> None:
        self.chat.cancel.set()  # the generation thread stops at its next token
        self.exit()

    def action_stop(self) -> None:
        if self.chat.stop():
            self._set_status("Stopping…", busy=True)

    async def action_regenerate(self) -> None:
        if self.chat.generating or self.chat.model is None:
            self.notify("Wait for the current answer (or press Escape).", severity="warning")
            return
        if not self.conv.messages:
            self.notify("Nothing to regenerate yet.")
            return
        if self.chat.pop_last_answer():
            views = self._views()
            if views:
                await views[-1].remove()
        if not self.chat.awaits_answer():
            self.notify("Nothing to regenerate yet.")
            return
        await self._start_generation(check=True)

    async def action_edit_last(self) -> None:
        if self.chat.generating:
            self.notify("Wait for the current answer (or press Escape).", severity="warning")
            return
        last = self.chat.pop_last_user()
        if last is None:
            self.notify("No message to edit.")
            return
        await self._render_conversation()
        self.save()
        self.input.load_text(last)
        self.input.focus()
        self.input.move_cursor(self.input.document.end)

    def action_copy_last(self) -> None:
        text = self.chat.last_answer()
        if not text:
            self.notify("No answer to copy yet.")
            return
        self.copy_to_clipboard(text)
        self.notify(f"Copied the last answer ({len(text)} characters).")

    async def action_clear(self) -> None:
        await self._abandon_generation()
        self.save()
        self.chat.new_conversation()
        await self._render_conversation()
        self.input.clear()
        self.notify("New chat.")

    def action_help(self) -> None:
        self.push_screen(HelpScreen(str(self.chat.store.dir)))

    def action_toggle_panel(self) -> None:
        visible = self.panel.display
        self.screen.set_class(visible, "-panel-off")
        self.screen.set_class(not visible, "-panel-on")

    def action_export(self) -> None:
        if not self.conv.messages:
            self.notify("Nothing to export yet.")
            return
        self.save()
        path = self.chat.store.export_markdown(self.conv)
        self.notify(f"Exported to {path}", timeout=8)

    def action_settings(self) -> None:
        current, models = self.chat.model_choices()
        self.push_screen(
            SettingsScreen(
                self.conv.settings,
                current,
                models,
                self.chat.ctx_shown(),
                recommended(self.chat.model),
            ),
            callback=self._apply_settings,
        )

    def _apply_settings(self, result: SettingsResult | None) -> None:
        if result is None:
            return
        reload = self.chat.apply_settings(result.settings, result.model, result.n_ctx)
        self.save()
        if reload is not None:
            self.load_model(*reload)
        self.notify("Settings saved.")

    def action_conversations(self) -> None:
        convs = self.chat.store.list()
        self._report_broken()
        self.push_screen(ConversationsScreen(convs), callback=self._open_conversation)

    async def _open_conversation(self, conv: Conversation | None) -> None:
        if conv is None:
            return
        await self._abandon_generation()
        self.save()
        self.chat.conv = conv
        await self._render_conversation()
        self.notify(f"Opened: {conv.title or conv.auto_title()}")

    # -- persistence -----------------------------------------------------------------
    def save(self) -> Path | None:
        """Save the conversation (never raises: a failed save is a notification)."""
        try:
            return self.chat.save()
        except OSError as e:
            self.notify(f"Could not save the conversation: {e}", severity="error")
            return None


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


def main() -> None:  # python -m edgerun.tui
    import argparse

    p = argparse.ArgumentParser(prog="edgerun chat")
    p.add_argument("-m", "--model", default=None)
    p.add_argument("-c", "--ctx", type=int, default=None)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--kv-type", choices=("f32", "f16", "q8_0", "q4_0"), default="f32")
    p.add_argument("--system", default=None)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--conversations-dir", default=None)
    raise SystemExit(run(p.parse_args()))


if __name__ == "__main__":
    main()
