"""The chat app's controller: the model's lifecycle, the generation protocol, the context policy
and the conversation held. Nothing here imports Textual (a test checks).

The view (app.py) calls `ChatController` on its own thread. Model work comes back as jobs
(`Load`, `Generation`, `Drop`): the view runs each in a worker thread as `job(emit)`, and the job
calls emit(event) with the events below. The view hands each event back to the controller on
its own thread; `stale` tells which belong to a generation abandoned since, so they are dropped.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgerun.generate.settings import DEFAULT_CTX, ModelSettings
from edgerun.tui.store import ChatSettings, Conversation, ConversationStore

RAW_STOPS = ("\nUser:", "\nuser:", "\nUSER:")
POST_INTERVAL = 0.05  # seconds: streamed text reaches the UI at most ~20 times a second


# -- context policy ------------------------------------------------------------------------


def uses_template(model: Any) -> bool:
    return bool(getattr(model, "chat_template", None))


def transcript(messages: list[dict[str, str]]) -> str:
    """Plain-text rendering of a conversation for models without a chat template."""
    parts = []
    for m in messages:
        if m["role"] == "system":
            parts.append(m["content"].strip() + "\n")
        elif m["role"] == "user":
            parts.append(f"User: {m['content'].strip()}")
        else:
            parts.append(f"Assistant: {m['content'].strip()}")
    parts.append("Assistant:")
    return "\n".join(parts)


def prompt_ids(model: Any, messages: list[dict[str, str]], reasoning: str = "") -> list[int]:
    """Token ids the model will see for `messages` (chat template, or the raw transcript):
    encode_chat's, so BOS comes once and special strings the user typed stay text.
    reasoning "on" / "off": the template asked to think or not, as Model.chat's reasoning
    ("": the template's default)."""
    if uses_template(model):
        if reasoning:
            from edgerun.generate.chat_turn import prepare_turn

            return prepare_turn(model.tokenizer, messages, reasoning=reasoning).ids
        return model.encode_chat(messages)
    return model.tokenize(transcript(messages))


def reserve(model: Any, max_tokens: int) -> int:
    """Room kept free for the answer when checking whether a prompt still fits."""
    return max(1, min(max_tokens, model.n_ctx // 4))


def fit_by_dropping(
    model: Any,
    system: list[dict[str, str]],
    turns: list[dict[str, str]],
    max_tokens: int,
    reasoning: str = "",
) -> int:
    """How many leading messages of `turns` to drop so the prompt fits; -1 if none works.

    Whole user/assistant pairs go first; the last user message always stays.
    """
    room = model.n_ctx - reserve(model, max_tokens)
    starts = [i for i, m in enumerate(turns) if m["role"] == "user"] or [0]
    for i in starts:
        if len(prompt_ids(model, system + turns[i:], reasoning)) <= room:
            return i
    return -1


def recommended(model: Any) -> ModelSettings | None:
    """The loaded model's recommended settings (None for a stand-in without them)."""
    rec = getattr(model, "settings", None)
    return rec if isinstance(rec, ModelSettings) else None


# -- what the model is called --------------------------------------------------------------


def model_quant(model: Any) -> str:
    """The registry's quant label for the model, else its most common tensor format."""
    try:
        from edgerun import registry

        for m in registry.manifests():
            if m.filename == model.path.name:
                return m.quant
    except Exception:  # noqa: BLE001 - a figure for display only
        pass
    try:
        counts: Counter = Counter()
        for _, fmt, (r, c), _ in model.tensor_summary():
            counts[fmt] += r * c
        return counts.most_common(1)[0][0]
    except Exception:  # noqa: BLE001
        return "?"


def label_for(name: str | None, model: Any) -> str:
    """The model's registry name, else the name it was asked for, else its file's stem."""
    try:
        from edgerun import registry

        for m in registry.manifests():
            if m.filename == model.path.name:
                return m.name
    except Exception:  # noqa: BLE001
        pass
    return str(name) if name else model.path.stem


# -- events a job emits ----------------------------------------------------------------------


@dataclass
class Token:
    """Streamed answer text (pieces batched to at most one event per POST_INTERVAL)."""

    piece: str
    gen: int | None = None


@dataclass
class Finished:
    """The answer ended: its whole text and a copy of its stats, or an error. Stats and error
    both None: stopped before it started."""

    text: str
    stats: Any
    error: str | None
    gen: int | None = None


@dataclass
class ContextFull:
    """The prompt leaves no room for the answer (`fits`: the prompt itself still fits)."""

    prompt_tokens: int
    fits: bool
    gen: int | None = None


@dataclass
class Dropped:
    """How many leading messages to drop so the prompt fits; -1: not even the last alone."""

    count: int
    gen: int | None = None


@dataclass
class ModelLoaded:
    model: Any
    label: str
    quant: str
    gen: int | None = None


@dataclass
class ModelFailed:
    name: str
    error: str
    gen: int | None = None


Event = Token | Finished | ContextFull | Dropped | ModelLoaded | ModelFailed
Emit = Callable[[Event], None]


# -- jobs (each runs in a worker thread) -----------------------------------------------------


@dataclass
class Load:
    """Load a model (and warm its kernels): emits ModelLoaded or ModelFailed."""

    name: str | None
    n_ctx: int | None
    threads: int | None
    kv_type: str | None
    offload: dict
    warmup: bool

    def __call__(self, emit: Emit) -> None:
        try:
            import edgerun

            model = edgerun.load(
                self.name,
                n_ctx=self.n_ctx,
                threads=self.threads,
                kv_type=self.kv_type,
                **self.offload,
            )
            quant = model_quant(model)
            if self.warmup:  # compile / load the Numba kernels before the first question
                try:
                    model.warm_up()
                except Exception:  # noqa: BLE001 - warm-up is best effort
                    pass
            emit(ModelLoaded(model, label_for(self.name, model), quant))
        except Exception as e:  # noqa: BLE001 - shown to the user, never a crash
            emit(ModelFailed(str(self.name or "default model"), str(e)))


@dataclass
class Generation:
    """One answer: emits Token events, then exactly one Finished or ContextFull, all tagged
    with `gen`. Setting `cancel` stops it at its next token (the text so far is kept)."""

    gen: int
    model: Any
    messages: list[dict[str, str]]
    sampling: dict[str, Any]
    check: bool  # ask first (ContextFull) when the prompt leaves no room for the answer
    cancel: threading.Event
    session: Any = None  # an edgerun Session: its KV cache carries over between turns
    draft: str | None = None  # ChatSettings.draft: set on the model first (None: keep)
    reasoning: str = ""  # ChatSettings.reasoning

    def __call__(self, emit: Emit) -> None:
        from edgerun.errors import ContextOverflowError

        model, gen, cancel = self.model, self.gen, self.cancel
        text = ""
        n = 0
        try:
            if self.draft is not None:
                model.set_draft(self.draft or None)
            ids = prompt_ids(model, self.messages, self.reasoning)
            n = len(ids)
            if self.check and n + reserve(model, self.sampling["max_tokens"]) > model.n_ctx:
                emit(ContextFull(n, n < model.n_ctx, gen))
                return
            if cancel.is_set():  # Escape before the first token: nothing to keep
                emit(Finished("", None, None, gen))
                return
            stop = () if uses_template(model) else RAW_STOPS
            request = None
            if self.session is not None:  # the session's own KV cache, via the model's scheduler
                request = self.session.complete(ids, stop=stop, **self.sampling)
                it = iter(request)
            else:
                it = model.generate(ids, stop=stop, **self.sampling)
            pending, last_post = "", 0.0
            try:
                for piece in it:
                    text += piece
                    pending += piece
                    now = time.monotonic()
                    if now - last_post >= POST_INTERVAL:  # batch pieces on fast machines
                        emit(Token(pending, gen))
                        pending, last_post = "", now
                    if cancel.is_set():
                        break
            finally:
                it.close()  # marks stats.finish_reason "cancelled" if we broke out
                if request is not None:
                    request.finished.wait(timeout=30)
            if pending:
                emit(Token(pending, gen))
            if not uses_template(model):
                text = text.strip()
            stats = request.stats if request is not None else model.stats
            emit(Finished(text, dataclasses.replace(stats), None, gen))
        except ContextOverflowError:
            emit(ContextFull(n, False, gen))
        except Exception as e:  # noqa: BLE001 - shown to the user, never a crash
            emit(Finished(text, None, f"{type(e).__name__}: {e}", gen))


@dataclass
class Drop:
    """Find how many of the oldest messages to drop so the prompt fits: emits Dropped."""

    gen: int
    model: Any
    messages: list[dict[str, str]]
    max_tokens: int
    reasoning: str = ""

    def __call__(self, emit: Emit) -> None:
        system = [m for m in self.messages if m["role"] == "system"]
        turns = [m for m in self.messages if m["role"] != "system"]
        try:
            n = fit_by_dropping(self.model, system, turns, self.max_tokens, self.reasoning)
            emit(Dropped(n, self.gen))
        except Exception:  # noqa: BLE001
            emit(Dropped(-1, self.gen))


# -- the controller --------------------------------------------------------------------------


class ChatController:
    """The conversation and the model behind the chat app, free of any UI.

    Pass `model` (a loaded edgerun Model) or `model_name` to load one (`load`). Every method
    runs on the view's thread; only the jobs it returns run elsewhere.
    """

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
        self.model: Any = None
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
        self.answer = ""  # the running generation's text as delivered so far
        self.cancel = threading.Event()
        self.gen = 0  # id of the current generation; events from older ones are stale
        self.preloaded = model  # adopted by `take_preloaded` once the view is up
        self.queued = False  # a message typed while the model loads, sent once it is ready
        self._session: Any = None  # edgerun.Session of (self.conv, self.model): its KV cache
        self._session_key: tuple | None = None
        conv = self.store.latest() if resume else None
        self.resumed = conv is not None
        if conv is None:
            conv = Conversation(settings=dataclasses.replace(settings or ChatSettings()))
        if system is not None:
            conv.settings.system = system
        self.conv = conv

    # -- model lifecycle ---------------------------------------------------------------
    @property
    def tool_markup(self) -> Any:
        """The tool-call markup the model writes (generate/tool_calls.py), so the app shows
        calls as blocks; None without a model or a tool-call format."""
        if self.model is None:
            return None
        from edgerun.generate.tool_calls import markup_for

        tok = self.model.tokenizer
        return markup_for(tok.special_texts(), tok.chat_template)

    def take_preloaded(self) -> ModelLoaded | None:
        """The model passed in, as the event a load would have emitted (once)."""
        m, self.preloaded = self.preloaded, None
        if m is None:
            return None
        return ModelLoaded(m, label_for(self.model_name, m), model_quant(m))

    def load(self, name: str | None, n_ctx: int | None) -> Load:
        """Mark a load under way; returns the job that loads `name`."""
        self.loading = True
        return Load(name, n_ctx, self.threads, self.kv_type, self.offload, self.warmup)

    @staticmethod
    def loading_text(name: str | None) -> str:
        what = f"Loading {name or 'the default model'}"
        try:
            from edgerun.runtime import numba_env

            if numba_env.kernel_cache_is_cold():
                what += " (first run: compiling kernels, a minute or so)"
        except Exception:  # noqa: BLE001 - a hint only
            pass
        return what + "…"

    def model_ready(self, ev: ModelLoaded) -> bool:
        """Adopt a loaded model. True: a message typed during the load is to be answered now."""
        self.model = ev.model
        self.model_label = ev.label
        self.model_quant = ev.quant
        self.model_name = ev.label
        self.n_ctx = ev.model.n_ctx
        self.loading = False
        self.conv.model = ev.label
        msgs = self.conv.messages
        go = self.queued and not self.generating and bool(msgs) and msgs[-1]["role"] == "user"
        self.queued = False
        return go

    def model_failed(self) -> bool:
        """A load failed (a loaded model stays). True: a waiting message will not be sent."""
        self.loading = False
        if self.queued and self.model is None:
            self.queued = False
            return True
        return False

    def model_choices(self) -> tuple[str, list[tuple[str, str]]]:
        """The model in use (a registry name or path) and the installed ones: (label, name)."""
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
        return current, models

    def ctx_shown(self) -> int:
        """The context size the settings show: the model's, or the default."""
        return self.n_ctx if self.n_ctx is not None else DEFAULT_CTX

    def apply_settings(
        self, settings: ChatSettings, model: str, n_ctx: int
    ) -> tuple[str, int | None] | None:
        """Take new settings. Returns (model, n_ctx) to load when the model or the context
        size changed (a running answer is told to stop), else None."""
        self.conv.settings = settings
        changed_model = model != (self.model_name or "")
        changed_ctx = n_ctx != self.ctx_shown()
        if not (changed_model or changed_ctx):
            return None
        if self.generating:
            self.cancel.set()
        self.ctx_given = self.ctx_given or changed_ctx
        return model, (n_ctx if self.ctx_given else None)

    # -- the conversation --------------------------------------------------------------
    def messages(self) -> list[dict[str, str]]:
        """The conversation as the model sees it, with the model's default system prompt."""
        rec = recommended(self.model)
        return self.conv.chat_messages(rec.system if rec is not None else "")

    def send_refusal(self) -> str | None:
        """Why a message cannot be sent now; None when it can."""
        if self.generating:
            return "Still answering: press Escape to stop it first."
        if self.model is None and (self.queued or not self.loading):
            return "A message is already waiting." if self.queued else "No model is loaded (F2)."
        return None

    def add_user(self, text: str) -> dict[str, Any]:
        msg = {"role": "user", "content": text}
        self.conv.messages.append(msg)
        return msg

    def pop_last_user(self) -> str | None:
        """Take back the last question (and the answers after it): its text, or None."""
        msgs = self.conv.messages
        while msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
        if msgs and msgs[-1]["role"] == "user":
            return msgs.pop()["content"]
        return None

    def pop_last_answer(self) -> bool:
        """Remove the last message if it is an answer (to regenerate it)."""
        msgs = self.conv.messages
        if msgs and msgs[-1]["role"] == "assistant":
            msgs.pop()
            return True
        return False

    def awaits_answer(self) -> bool:
        msgs = self.conv.messages
        return bool(msgs) and msgs[-1]["role"] == "user"

    def last_answer(self) -> str | None:
        for m in reversed(self.conv.messages):
            if m["role"] == "assistant":
                return m["content"]
        return None

    def new_conversation(self) -> None:
        """A fresh conversation with the current settings (save the old one first)."""
        self.conv = Conversation(
            settings=dataclasses.replace(self.conv.settings), model=self.model_label
        )

    def drop_oldest(self, count: int) -> None:
        del self.conv.messages[:count]

    # -- generation --------------------------------------------------------------------
    def start(self, check: bool) -> Generation:
        """Begin an answer to the conversation; returns the job that computes it."""
        model = self.model
        self.answer = ""
        self.generating = True
        self.cancel = threading.Event()
        self.gen += 1
        sampling = self.conv.settings.sampling(recommended(model))
        self.last_sampling = dict(sampling)
        return Generation(
            self.gen,
            model,
            self.messages(),
            sampling,
            check,
            self.cancel,
            self.session(),
            self.conv.settings.draft,
            self.conv.settings.reasoning,
        )

    def drop_job(self) -> Drop:
        settings = self.conv.settings
        return Drop(self.gen, self.model, self.messages(), settings.max_tokens, settings.reasoning)

    def stale(self, ev: Event) -> bool:
        """Whether `ev` comes from a generation abandoned since (untagged events never are)."""
        return ev.gen is not None and ev.gen != self.gen

    def stop(self) -> bool:
        """Ask the running answer to stop at its next token; False when none runs."""
        if self.generating:
            self.cancel.set()
            return True
        return False

    def on_token(self, ev: Token) -> None:
        self.answer += ev.piece

    def finish(self, ev: Finished) -> dict[str, Any] | None:
        """An answer ended: returns the message added to the conversation, or None when there
        is nothing to keep (stopped before it started, or an error before any text)."""
        self.generating = False
        self.answer = ""
        st = ev.stats
        if st is None and ev.error is None:
            return None
        self.last_stats = st
        if ev.error is not None and not ev.text:
            return None
        entry: dict[str, Any] = {"role": "assistant", "content": ev.text, "model": self.model_label}
        if st is not None:
            entry["stats"] = {
                "prompt_tokens": st.prompt_tokens,
                "cached_tokens": st.cached_tokens,
                "generated_tokens": st.generated_tokens,
                "prompt_tps": round(st.prompt_tps, 2),
                "generate_tps": round(st.generate_tps, 2),
                "finish_reason": st.finish_reason,
            }
        self.conv.messages.append(entry)
        return entry

    def filled_context(self, st: Any) -> bool:
        """Whether the answer stopped because the context window is full."""
        return (
            st.finish_reason == "length"
            and self.model is not None
            and self.cache_length() >= self.model.n_ctx
        )

    def context_full(self) -> None:
        """The answer did not start: the prompt leaves no room (the user chooses what next)."""
        self.generating = False
        self.answer = ""

    def abandon(self) -> None:
        """Forget the running answer (its worker has stopped), keeping the text it wrote."""
        if self.generating and self.answer:
            entry = {"role": "assistant", "content": self.answer, "model": self.model_label}
            self.conv.messages.append(entry)
        self.gen += 1
        self.generating = False
        self.answer = ""

    # -- the KV cache and persistence ------------------------------------------------------
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
                from edgerun.serving.session import Session

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

    def save(self) -> Path | None:
        """Save the conversation (raises OSError). One with no messages left is deleted."""
        if not self.conv.messages:
            self.store.delete(self.conv)
            return None
        path = self.store.save(self.conv)
        self._save_cache()
        return path

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


# -- the stats panel's rows ------------------------------------------------------------------


def _threads(model) -> str:
    """Threads in use; with automatic threads, out of how many (other load takes cores)."""
    if model is None:
        return "-"
    gov = getattr(model, "governor", None)
    if gov is None or not gov.adaptive:
        return str(model.threads)
    return f"{gov.threads} of {gov.max_threads}"


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f} MiB"


def default_providers(chat: Any) -> list[tuple[str, Callable[[], str]]]:
    """The side panel's rows: (label, callable giving the value). Add a row = add a line.

    `chat` is a ChatController, or anything with its .model (Model | None), .model_label,
    .model_quant, .status_text, .last_stats, .generating and .cache_length().
    """
    from edgerun.runtime.sysinfo import peak_rss_bytes

    def st():
        return getattr(chat, "last_stats", None) if chat.model is not None else None

    def ctx() -> str:
        m = chat.model
        if m is None:
            return "-"
        used = chat.cache_length() if hasattr(chat, "cache_length") else m.generator.cache.length
        return f"{used} / {m.n_ctx} ({100 * used / max(1, m.n_ctx):.0f}%)"

    def prompt() -> str:
        s = st()
        if s is None or not s.prompt_tokens:
            return "-"
        return f"{s.prompt_tps:.1f} tok/s ({s.prompt_tokens - s.cached_tokens} new)"

    def gen() -> str:
        s = st()
        if s is None or not s.generated_tokens:
            return "-"
        return f"{s.generate_tps:.1f} tok/s ({s.generated_tokens} tok)"

    def drafts() -> str:
        s = st()
        summary = s.draft_summary() if hasattr(s, "draft_summary") else ""
        return summary or "-"

    def finish() -> str:
        if getattr(chat, "generating", False):
            return "running"
        s = st()
        return (s.finish_reason or "-") if s is not None else "-"

    return [
        ("Model", lambda: chat.model_label or "-"),
        ("Quant", lambda: chat.model_quant or "-"),
        ("Arch", lambda: chat.model.spec.arch if chat.model else "-"),
        ("Context", ctx),
        ("Prompt", prompt),
        ("Generation", gen),
        ("Drafts", drafts),
        ("Finish", finish),
        ("Threads", lambda: _threads(chat.model)),
        ("Load", lambda: f"{chat.model.load_seconds:.2f} s" if chat.model else "-"),
        ("Peak RSS", lambda: _mib(peak_rss_bytes())),
        ("Status", lambda: chat.status_text),
    ]
