"""The terminal chat app (edgerun/tui/), driven headless with Textual's pilot on the real default
model, and its controller (edgerun/tui/chat.py) driven directly.

Async pilot code runs under asyncio.run() so no pytest plugin is needed.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest

from edgerun.tui.app import ChatApp
from edgerun.tui.chat import _threads, fit_by_dropping, prompt_ids, transcript
from edgerun.tui.screens import ContextFullScreen, HelpScreen, SettingsResult, SettingsScreen
from edgerun.tui.store import ChatSettings, Conversation, ConversationStore
from edgerun.tui.widgets import ChatInput, MessageView

edgerun = pytest.importorskip("edgerun")


@pytest.fixture(scope="module")
def model():
    """The default model, loaded once for the module (kernels compile on first use)."""
    from edgerun import registry

    if not registry.is_installed(registry.default_manifest()):
        pytest.skip("the default model is not installed (edgerun pull)")
    m = edgerun.load(None, n_ctx=1024, threads=None)
    list(m.generate("Hi", max_tokens=2, temperature=0.0))  # compile kernels up front
    return m


class RecordingApp(ChatApp):
    """ChatApp that keeps the notifications it shows, for assertions."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.notes: list[str] = []
        self.pieces: list[str] = []  # streamed text as it reached the UI

    async def on_chat_app_token(self, msg) -> None:
        self.pieces.append(msg.piece)
        await super().on_chat_app_token(msg)

    def notify(self, message, *args, **kwargs) -> None:  # noqa: D401
        self.notes.append(str(message))
        super().notify(message, *args, **kwargs)


def make_app(model, tmp_path: Path, **kw) -> RecordingApp:
    settings = kw.pop("settings", ChatSettings(max_tokens=16, temperature=0.0))
    return RecordingApp(model=model, conversations_dir=tmp_path / "convs", settings=settings, **kw)


async def until(pilot, cond, timeout: float = 60.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not cond():
        if loop.time() > end:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.05)


async def finish(app, pilot) -> None:
    await app.workers.wait_for_complete()
    await pilot.pause()
    await until(pilot, lambda: not app.generating)


async def type_and_send(pilot, text: str) -> None:
    for ch in text:
        await pilot.press("space" if ch == " " else ch)
    await pilot.press("enter")


def run(coro) -> None:
    asyncio.run(coro)


# -- pure parts ------------------------------------------------------------------------


def test_store_roundtrip_and_markdown(tmp_path):
    store = ConversationStore(tmp_path)
    assert store.latest() is None
    conv = Conversation(settings=ChatSettings(temperature=0.3, system="be brief"))
    conv.messages += [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "```python\nprint(4)\n```", "stats": {"x": 1}},
    ]
    path = store.save(conv)
    assert path.exists() and json.loads(path.read_text())["version"] == 1
    back = store.load(path)
    assert back.messages == conv.messages and back.settings.temperature == 0.3
    assert back.title == "What is 2+2?"
    assert store.latest().id == conv.id
    assert back.chat_messages()[0] == {"role": "system", "content": "be brief"}
    md = store.export_markdown(back)
    assert md == path.with_suffix(".md")
    text = md.read_text()
    assert "## You" in text and "```python" in text and "be brief" in text
    (tmp_path / "broken.json").write_text("{not json")
    assert [c.id for c in store.list()] == [conv.id]  # unreadable files are skipped


def test_transcript_for_models_without_template():
    t = transcript([{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}])
    assert t.startswith("sys") and t.endswith("User: hi\nAssistant:")


def test_user_line_breaks_survive_markdown():
    from edgerun.tui.widgets import hard_breaks

    assert hard_breaks("a\nb\n```\nx\n```") == "a  \nb  \n```\nx\n```"


def test_cli_has_chat_subcommand():
    from edgerun.cli import COMMANDS, _build_parser

    args = _build_parser().parse_args(
        ["chat", "-m", "smollm2-135m", "--resume", "--conversations-dir", "x", "-c", "512"]
    )
    assert args.command == "chat" and "chat" in COMMANDS
    assert args.resume and args.conversations_dir == "x" and args.ctx == 512


# -- the app on the real model ---------------------------------------------------------------


def test_stream_answer_save_and_resume(model, tmp_path):
    async def go():
        app = make_app(model, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            assert app.model is model and app.model_label == "smollm2-135m"
            await type_and_send(pilot, "Say hello")
            assert app.query_one("#input", ChatInput).text == ""
            assert app.conv.messages[0] == {"role": "user", "content": "Say hello"}
            await finish(app, pilot)
            assert app.pieces and "".join(app.pieces) == app.conv.messages[-1]["content"]
            views = app.query(MessageView)
            assert [v.role for v in views] == ["user", "assistant"]
            answer = app.conv.messages[-1]
            assert answer["role"] == "assistant" and answer["content"].strip()
            assert views[-1].content == answer["content"]
            assert answer["stats"]["finish_reason"] in ("stop", "length")
            assert answer["stats"]["generated_tokens"] <= 16
            rows = dict(app.panel.rows())
            assert rows["Model"] == "smollm2-135m" and rows["Quant"] == "Q4_1"
            assert rows["Context"].split(" / ")[1].startswith("1024")
            assert "tok/s" in rows["Generation"] and "MiB" in rows["Peak RSS"]
            assert re.fullmatch(r"\d+( of \d+)?", rows["Threads"]), rows["Threads"]
            # copy the last answer
            await pilot.press("ctrl+o")
            assert app.clipboard == answer["content"]
            assert any("Copied" in n for n in app.notes)
            # export to Markdown, next to the JSON
            await pilot.press("f5")
            conv_id = app.conv.id
        saved = tmp_path / "convs" / f"{conv_id}.json"
        assert saved.exists() and saved.with_suffix(".md").exists()
        data = json.loads(saved.read_text())
        assert [m["role"] for m in data["messages"]] == ["user", "assistant"]

        # --resume reopens the last conversation
        app2 = make_app(model, tmp_path, resume=True)
        async with app2.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            assert app2.conv.id == conv_id
            views = app2.query(MessageView)
            assert [v.role for v in views] == ["user", "assistant"]
            assert views[1].content == data["messages"][1]["content"]

    run(go())


def test_escape_stops_and_keeps_partial_text(model, tmp_path):
    async def go():
        app = make_app(model, tmp_path, settings=ChatSettings(max_tokens=400))
        async with app.run_test(size=(100, 30)) as pilot:
            await app.send("Write a long story about a dragon.")
            await until(pilot, lambda: app.pieces)
            await pilot.press("escape")
            await finish(app, pilot)
            st = app.last_stats
            assert st.finish_reason == "cancelled"
            assert 0 < st.generated_tokens < 400
            answer = app.conv.messages[-1]
            assert answer["role"] == "assistant" and answer["content"].strip()
            assert answer["stats"]["finish_reason"] == "cancelled"
            assert app.query(MessageView)[-1].content == answer["content"]
            assert dict(app.panel.rows())["Finish"] == "cancelled"

            # Ctrl+L mid-answer: a clean new chat; the old one is saved with its partial answer
            old_id = app.conv.id
            app.pieces.clear()
            await app.send("Tell me another long story.")
            await until(pilot, lambda: app.pieces)
            await pilot.press("ctrl+l")
            await pilot.pause(0.3)
            assert not app.generating and app.conv.messages == []
            assert len(app.query(MessageView)) == 0
            saved = app.store.load(old_id)
            assert [m["role"] for m in saved.messages] == ["user", "assistant"] * 2
            assert saved.messages[-1]["content"]
            app.conv.settings.max_tokens = 8
            await app.send("Hi")  # the model is free again
            await finish(app, pilot)
            assert [m["role"] for m in app.conv.messages] == ["user", "assistant"]

    run(go())


def test_settings_change_temperature_is_used(model, tmp_path):
    async def go():
        app = make_app(model, tmp_path, settings=ChatSettings(max_tokens=8, temperature=0.8))
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.press("f2")
            await pilot.pause()
            screen = app.screen
            assert isinstance(screen, SettingsScreen)
            from textual.widgets import Input

            screen.query_one("#temperature", Input).value = "0"
            screen.query_one("#top_k", Input).value = "5"
            screen.query_one("#seed", Input).value = "7"
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert not isinstance(app.screen, SettingsScreen)
            assert app.conv.settings.temperature == 0.0 and app.conv.settings.seed == 7
            await app.send("Hi")
            await finish(app, pilot)
            assert app.last_sampling["temperature"] == 0.0
            assert app.last_sampling["top_k"] == 5 and app.last_sampling["seed"] == 7
            # fields left alone follow the model's recommended settings
            assert app.conv.settings.top_p is None
            assert app.last_sampling["top_p"] == model.settings.top_p
            # invalid values are refused with a message, the screen stays open
            await pilot.press("f2")
            await pilot.pause()
            app.screen.query_one("#top_p", Input).value = "2"
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert isinstance(app.screen, SettingsScreen)
            await pilot.press("escape")
            await pilot.pause()
            assert app.conv.settings.top_p is None

    run(go())


def test_regenerate_and_edit_last(model, tmp_path):
    async def go():
        app = make_app(model, tmp_path, settings=ChatSettings(max_tokens=8))
        async with app.run_test(size=(100, 30)) as pilot:
            await app.send("Name a colour.")
            await finish(app, pilot)
            assert len(app.conv.messages) == 2
            await pilot.press("ctrl+r")
            await finish(app, pilot)
            assert [m["role"] for m in app.conv.messages] == ["user", "assistant"]
            assert len(app.query(MessageView)) == 2
            await pilot.press("ctrl+t")
            await pilot.pause()
            assert app.conv.messages == []
            assert app.query_one("#input", ChatInput).text == "Name a colour."
            # Ctrl+J inserts a new line instead of sending
            await pilot.press("ctrl+j")
            assert app.query_one("#input", ChatInput).text.count("\n") == 1
            assert app.conv.messages == []
            await pilot.press("ctrl+l")
            await pilot.pause()
            assert len(app.query(MessageView)) == 0

    run(go())


def test_context_full_drop_oldest_and_new_chat(tmp_path):
    small = edgerun.load(None, n_ctx=96)

    async def go():
        app = make_app(small, tmp_path, settings=ChatSettings(max_tokens=8, temperature=0.0))
        # an old conversation that fills most of the 96-token window
        filler = "Tell me about the weather in spring and summer. " * 3
        app.conv.messages += [
            {"role": "user", "content": filler},
            {"role": "assistant", "content": "It is warm and sunny most days. " * 2},
        ]
        async with app.run_test(size=(100, 30)) as pilot:
            await app.send("And winter?")
            await until(pilot, lambda: isinstance(app.screen, ContextFullScreen))
            await pilot.pause()
            await pilot.click("#drop")
            await until(pilot, lambda: app.generating or len(app.conv.messages) >= 2)
            await finish(app, pilot)
            roles = [m["role"] for m in app.conv.messages]
            assert roles == ["user", "assistant"]
            assert app.conv.messages[0]["content"] == "And winter?"
            assert any("Dropped" in n for n in app.notes)
            # a message that cannot fit even alone: told so, text back in the input
            await app.send("word " * 120)
            await until(pilot, lambda: isinstance(app.screen, ContextFullScreen))
            first = app.screen
            await pilot.pause()
            await pilot.click("#new")  # the new chat holds just this message: asked again
            await until(
                pilot, lambda: isinstance(app.screen, ContextFullScreen) and app.screen is not first
            )
            await pilot.pause()
            await pilot.click("#drop")
            await until(pilot, lambda: any("does not fit" in n for n in app.notes))
            await pilot.pause()
            assert app.query_one("#input", ChatInput).text.startswith("word")
            assert app.conv.messages == []

            # nearly full (the prompt fits, the answer may not): "send anyway" is offered;
            # the answer then stops when the window is full and the user is told
            app.input.clear()
            app.conv.settings.max_tokens = 40
            k = 1
            while len(prompt_ids(small, [{"role": "user", "content": "apple " * k}])) < 80:
                k += 1
            await app.send("apple " * k)
            await until(pilot, lambda: isinstance(app.screen, ContextFullScreen))
            await pilot.pause()
            await pilot.click("#send")
            await finish(app, pilot)
            assert app.last_stats.finish_reason == "length"
            assert app.session().cache.length == small.n_ctx
            assert any("context window is full" in n for n in app.notes)

    run(go())


def test_fit_by_dropping(model):
    system = [{"role": "system", "content": "s"}]
    turns = [
        {"role": "user", "content": "a " * 100},
        {"role": "assistant", "content": "b " * 100},
        {"role": "user", "content": "c"},
    ]
    n_all = len(prompt_ids(model, system + turns))
    assert fit_by_dropping(model, system, turns, 8) == 0  # 1024 tokens: all fits
    assert n_all > 200


def test_model_without_chat_template_uses_plain_completion(model, tmp_path):
    saved = model.tokenizer.chat_template
    model.tokenizer.chat_template = None
    try:

        async def go():
            app = make_app(model, tmp_path, settings=ChatSettings(max_tokens=8))
            async with app.run_test(size=(100, 30)) as pilot:
                await pilot.pause()
                assert any("no chat template" in n for n in app.notes)
                await app.send("Hello there")
                await finish(app, pilot)
                assert app.conv.messages[-1]["role"] == "assistant"
                assert app.last_stats is not None

        run(go())
    finally:
        model.tokenizer.chat_template = saved


def test_narrow_terminal_help_and_screenshot(model, tmp_path):
    async def go():
        app = make_app(model, tmp_path)
        async with app.run_test(size=(80, 24)) as pilot:
            await pilot.pause()
            assert not app.panel.display  # side panel hidden at 80 columns
            assert "smollm2-135m" in app.sub_title  # compact figures in the header
            await pilot.press("f4")
            await pilot.pause()
            assert app.panel.display
            await pilot.press("f1")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, HelpScreen)
            svg = app.save_screenshot(path=str(tmp_path), filename="narrow.svg")
            assert Path(svg).read_text().startswith("<svg")
        wide = make_app(model, tmp_path)
        async with wide.run_test(size=(110, 30)) as pilot:
            await pilot.pause()
            assert wide.panel.display

    run(go())


def test_background_model_load_from_settings(tmp_path):
    """A model (re)load runs in a thread worker while the UI keeps handling input."""

    async def go():
        app = RecordingApp(
            "smollm2-135m",
            n_ctx=256,
            conversations_dir=tmp_path,
            warmup=False,
            settings=ChatSettings(max_tokens=8),
        )
        async with app.run_test(size=(100, 30)) as pilot:
            assert app.loading and app.model is None
            await app.send("Hello")  # typed while loading: sent once the model is ready
            await pilot.press("f1")  # the UI answers while the model loads
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape")
            await until(pilot, lambda: app.model is not None)
            assert app.model.n_ctx == 256 and not app.loading
            await finish(app, pilot)
            assert [m["role"] for m in app.conv.messages] == ["user", "assistant"]
            first = app.model
            app._apply_settings(SettingsResult(app.conv.settings, "smollm2-135m", 128))
            assert app.loading
            await until(pilot, lambda: app.model is not first and not app.loading)
            assert app.model.n_ctx == 128
            # an unknown model is reported, the current one kept
            app.load_model("no-such-model", 128)
            await until(pilot, lambda: not app.loading)
            assert app.model is not None and any("Could not load" in n for n in app.notes)

    run(go())


@pytest.mark.skipif(not os.environ.get("EDGERUN_TUI_SCREENSHOT"), reason="writes docs/tui.svg")
def test_write_readme_screenshot(model, tmp_path):
    """EDGERUN_TUI_SCREENSHOT=1 pytest tests/ui/test_tui.py -k screenshot: refresh docs/tui.svg."""

    async def go():
        app = make_app(model, tmp_path, settings=ChatSettings(max_tokens=72, temperature=0.0))
        async with app.run_test(size=(110, 34)) as pilot:
            await app.send("Write a Python function that reverses a string.")
            await finish(app, pilot)
            await pilot.pause(0.5)
            docs = Path(__file__).resolve().parents[2] / "docs"
            docs.mkdir(exist_ok=True)
            app.save_screenshot(path=str(docs), filename="tui.svg")

    run(go())


def test_threads_row_says_how_many_of_how_many() -> None:
    fixed = SimpleNamespace(threads=4, governor=SimpleNamespace(adaptive=False))
    assert _threads(fixed) == "4"
    auto = SimpleNamespace(
        threads=4, governor=SimpleNamespace(adaptive=True, threads=3, max_threads=4)
    )
    assert _threads(auto) == "3 of 4"
    assert _threads(None) == "-"


def test_resume_reuses_the_saved_kv_cache(model, tmp_path):
    """A reopened chat loads its session's KV cache: the next turn computes only itself."""

    async def go():
        app = make_app(model, tmp_path)
        async with app.run_test(size=(100, 30)) as pilot:
            await type_and_send(pilot, "Name a fruit")
            await finish(app, pilot)
            held = app.session().cache.length
            kv = app.store.kv_path(app.conv)
        assert held > 0 and kv.exists()
        again = make_app(model, tmp_path, resume=True)
        async with again.run_test(size=(100, 30)) as pilot:
            assert again.resumed and again.session().cache.length == held
            await type_and_send(pilot, "Another")
            await finish(again, pilot)
            st = again.last_stats
            assert st.cached_tokens >= held - 2 and st.prompt_tokens > st.cached_tokens

    asyncio.run(go())


# -- the controller on its own (no Textual) ----------------------------------------------------


def _imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at module level or inside functions."""
    import ast

    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text("utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
    return out


def test_controller_and_store_import_no_textual():
    import subprocess
    import sys

    import edgerun.tui.chat as chat_module

    here = Path(chat_module.__file__).parent
    for name in ("chat.py", "store.py"):
        mods = _imported_modules(here / name)
        assert not [m for m in mods if m.split(".")[0] in ("textual", "rich")], name
    code = (
        "import sys, edgerun.tui.chat\n"
        "bad = [m for m in sys.modules if m.split('.')[0] == 'textual']\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


def test_only_the_cli_imports_the_chat_app():
    root = Path(edgerun.__file__).parent
    users = sorted(
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "tui" not in p.relative_to(root).parts[:1]
        and any(m == "edgerun.tui" or m.startswith("edgerun.tui.") for m in _imported_modules(p))
    )
    assert users == ["cli.py"]


def test_controller_drives_a_turn_without_textual(model, tmp_path):
    from edgerun.tui import chat
    from edgerun.tui.chat import ChatController

    c = ChatController(model=model, conversations_dir=tmp_path, settings=ChatSettings(max_tokens=8))
    assert c.model is None and c.send_refusal() == "No model is loaded (F2)."
    assert c.model_ready(c.take_preloaded()) is False  # nothing was waiting
    assert c.model is model and c.model_label == "smollm2-135m" and c.send_refusal() is None

    # one turn: the job runs here (the view runs it in a worker thread), events come back
    c.add_user("Say hello")
    job = c.start(check=True)
    assert isinstance(job, chat.Generation) and c.generating
    assert c.send_refusal().startswith("Still answering")
    events: list = []
    job(events.append)
    *tokens, end = events
    assert tokens and all(isinstance(e, chat.Token) and not c.stale(e) for e in tokens)
    for e in tokens:
        c.on_token(e)
    assert isinstance(end, chat.Finished) and end.error is None
    assert "".join(e.piece for e in tokens) == end.text
    entry = c.finish(end)
    assert not c.generating and c.conv.messages[-1] is entry
    assert entry["content"] == end.text and entry["model"] == "smollm2-135m"
    assert entry["stats"]["finish_reason"] in ("stop", "length")
    assert 0 < entry["stats"]["generated_tokens"] <= 8
    assert c.last_sampling["max_tokens"] == 8
    assert c.save().exists() and c.store.kv_path(c.conv).exists()
    assert c.cache_length() > 0

    # abandoned mid-answer: the text delivered so far is kept, the job's late events are stale
    c.add_user("Again")
    job = c.start(check=True)
    c.on_token(chat.Token("partial", job.gen))
    c.cancel.set()
    c.abandon()
    assert not c.generating and c.conv.messages[-1]["content"] == "partial"
    events.clear()
    job(events.append)
    assert events == [chat.Finished("", None, None, job.gen)] and c.stale(events[0])

    # a message that cannot fit even alone: ContextFull, then Drop finds no cut (-1)
    c.new_conversation()
    c.add_user("word " * 1100)
    job = c.start(check=True)
    events.clear()
    job(events.append)
    (full,) = events
    assert isinstance(full, chat.ContextFull) and not full.fits and full.prompt_tokens > 1024
    c.context_full()
    assert not c.generating
    events.clear()
    c.drop_job()(events.append)
    assert events == [chat.Dropped(-1, c.gen)]
    assert c.pop_last_user().startswith("word") and c.conv.messages == []
    assert c.save() is None  # an empty conversation is not kept


def test_the_reasoning_setting_renders_the_template_asked_to_think_or_not(model, tmp_path):
    """Settings' reasoning "off" renders a thinking template with enable_thinking false
    (Qwen3's: an empty <think></think> block after the generation prompt), "on" and ""
    leave it open; anything else is refused on the settings screen."""
    import copy

    template = (Path(__file__).parents[1] / "data" / "chat_templates" / "qwen3.jinja").read_text()
    tok = copy.copy(model.tokenizer)
    tok.chat_template = template
    qwen3ish = SimpleNamespace(tokenizer=tok, chat_template=template)
    msgs = [{"role": "user", "content": "Hi"}]
    off = model.tokenizer.decode(prompt_ids(qwen3ish, msgs, "off"))
    on = model.tokenizer.decode(prompt_ids(qwen3ish, msgs, "on"))
    assert off.rstrip().endswith("<think>\n\n</think>")
    assert "<think>" not in on
    assert prompt_ids(qwen3ish, msgs, "on") != prompt_ids(qwen3ish, msgs, "off")

    async def go():
        app = make_app(model, tmp_path)
        async with app.run_test(size=(100, 40)) as pilot:
            from textual.widgets import Input

            await pilot.press("f2")
            await pilot.pause()
            app.screen.query_one("#reasoning", Input).value = "maybe"
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert isinstance(app.screen, SettingsScreen)
            app.screen.query_one("#reasoning", Input).value = "Off"
            await pilot.press("ctrl+s")
            await pilot.pause()
            assert not isinstance(app.screen, SettingsScreen)
            assert app.conv.settings.reasoning == "off"

    run(go())
