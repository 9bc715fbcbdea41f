"""The chat app's messages from thinking and tool-calling models: the reasoning folded in a
collapsed block (opened by a click), each tool call a block of its own, both from a streamed
answer (tags split across pieces) and from a stored one. Driven headless with Textual's pilot
under asyncio.run(); the look is checked by a snapshot (pytest-textual-snapshot)."""

from __future__ import annotations

import asyncio

from textual.app import App
from textual.containers import VerticalScroll
from textual.widgets import Static

from edgerun.generate.tool_calls import MARKUPS
from edgerun.tui.app import CSS_PATH
from edgerun.tui.widgets import AnswerParts, MessageView

HERMES = MARKUPS["hermes"]
ANSWER = (
    "<think>\nThe user wants the weather in two cities.\n</think>\n\n"
    "Let me look that up.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
)


class Host(App):
    CSS_PATH = CSS_PATH

    def __init__(self, views) -> None:
        super().__init__()
        self._views = views

    def compose(self):
        with VerticalScroll(id="conversation"):
            yield from self._views


def _block_texts(view: MessageView) -> list[str]:
    return [str(b.render()) for b in view.tool_blocks()]


def test_answer_parts_split():
    reasoning, content, calls = AnswerParts.split(ANSWER, HERMES)
    assert reasoning == "The user wants the weather in two cities."
    assert content == "Let me look that up.\n"
    assert [c.name for c in calls] == ["get_weather", "get_weather"]
    assert AnswerParts.split("plain answer") == ("", "plain answer", [])


def test_a_stored_answer_shows_folded_reasoning_and_call_blocks():
    async def run():
        view = MessageView("assistant", ANSWER, markup=HERMES)
        app = Host([view])
        async with app.run_test(size=(80, 30)) as pilot:
            block = view.reasoning_block
            assert block.display and block.collapsed
            assert view._body == "Let me look that up.\n"
            texts = _block_texts(view)
            assert len(texts) == 2 and "Paris" in texts[0] and "Tokyo" in texts[1]
            assert all("get_weather" in t for t in texts)
            await pilot.click(".reasoning CollapsibleTitle")  # open the reasoning
            await pilot.pause()
            assert not block.collapsed
            inner = block.query_one(".reasoning-text", Static)
            assert "two cities" in str(inner.render())

    asyncio.run(run())


def test_a_streamed_answer_fills_the_same_blocks():
    async def run():
        view = MessageView("assistant", "", markup=HERMES)
        app = Host([view])
        async with app.run_test(size=(80, 30)) as pilot:
            assert not view.reasoning_block.display
            for i in range(0, len(ANSWER), 5):  # pieces that split the tags
                await view.append(ANSWER[i : i + 5])
            await view.finish(ANSWER)
            await pilot.pause()
            assert view.content == ANSWER
            assert view.reasoning == "The user wants the weather in two cities."
            assert view.reasoning_block.display and view.reasoning_block.collapsed
            assert len(_block_texts(view)) == 2
            assert "<tool_call>" not in view._body and "<think>" not in view._body

    asyncio.run(run())


def test_stored_openai_tool_calls_and_plain_messages():
    async def run():
        calls = [{"function": {"name": "calculator", "arguments": '{"expression": "2+2"}'}}]
        a = MessageView("assistant", "", tool_calls=calls)
        b = MessageView("user", "<think>not reasoning</think>")
        app = Host([a, b])
        async with app.run_test(size=(80, 30)):
            assert "calculator" in _block_texts(a)[0] and "2+2" in _block_texts(a)[0]
            assert not a.reasoning_block.display
            assert not b.reasoning_block.display and not b.tool_blocks()

    asyncio.run(run())


def test_reasoning_and_tool_call_blocks_snapshot(snap_compare):
    app = Host(
        [
            MessageView("user", "Weather in Paris and Tokyo?"),
            MessageView("assistant", ANSWER, title="Assistant", markup=HERMES),
        ]
    )
    assert snap_compare(app, terminal_size=(80, 24))
