"""A chat turn through real models' templates (tests/data/chat_templates): tools, an
assistant's tool calls and the tool results rendered as each template writes them, thinking
on and off, the shared prompt head, and an answer read back as OpenAI deltas."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgerun.errors import InvalidArgumentError, UnsupportedError
from edgerun.generate.chat_turn import prepare_turn

TEMPLATES = Path(__file__).resolve().parents[1] / "data" / "chat_templates"


class CharTokenizer:
    """One token per character, so a prompt's ids decode to exactly the rendered text."""

    bos_id = None
    eos_id = None
    bos_token = ""
    eos_token = ""

    def __init__(self, template: str | None) -> None:
        self.chat_template = template

    def special_texts(self) -> dict[str, int]:
        return {}

    def special_pattern(self):
        return None

    def encode(self, text: str, add_bos=None, parse_special=True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)

    def _with_bos(self, ids, add_bos):
        return ids


def _tok(name: str) -> CharTokenizer:
    return CharTokenizer((TEMPLATES / f"{name}.jinja").read_text())


def _text(tok, turn) -> str:
    return tok.decode(turn.ids)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18 C, sunny"},
]


def test_qwen_renders_tools_calls_and_results():
    tok = _tok("qwen2.5")
    turn = prepare_turn(tok, HISTORY, TOOLS)
    text = _text(tok, turn)
    assert "<tools>\n" + json.dumps(TOOLS[0]) in text
    # the call's arguments as an object (not a JSON string inside JSON)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    )
    assert "<tool_response>\n18 C, sunny\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert turn.markup.name == "hermes" and turn.tool_choice == "auto" and turn.grammar is None


def test_tool_choice_none_leaves_the_tools_out():
    tok = _tok("qwen2.5")
    turn = prepare_turn(tok, HISTORY[:1], TOOLS, "none")
    assert "<tools>" not in _text(tok, turn) and not turn.calls_tools


def test_required_and_named_choices_carry_a_grammar():
    tok = _tok("qwen2.5")
    turn = prepare_turn(tok, HISTORY[:1], TOOLS, "required")
    assert turn.grammar.startswith('start: item ("\\n" item)*')
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert prepare_turn(tok, HISTORY[:1], TOOLS, named).grammar.startswith("start: item\n")


def test_llama3_and_mistral_templates_pick_their_markup():
    tok = _tok("llama3.2")
    turn = prepare_turn(tok, HISTORY[:1], TOOLS)
    assert turn.markup.name == "llama3"
    assert '"parameters": dictionary of argument name and its value' in _text(tok, turn)
    tok = _tok("mistral-nemo")
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    turn = prepare_turn(tok, msgs, TOOLS)
    assert turn.markup.name == "mistral" and "[AVAILABLE_TOOLS]" in _text(tok, turn)


def test_tools_for_a_template_without_a_tool_format_are_refused():
    tok = CharTokenizer("{% for m in messages %}{{ m.content }}{% endfor %}")
    with pytest.raises(UnsupportedError, match="no tool-call format"):
        prepare_turn(tok, HISTORY[:1], TOOLS)
    with pytest.raises(InvalidArgumentError, match="tools\\[0\\]"):
        prepare_turn(_tok("qwen2.5"), HISTORY[:1], [{"type": "function", "function": {}}])


def test_requests_with_the_same_tools_share_the_prompt_head():
    tok = _tok("qwen2.5")
    a = prepare_turn(tok, [{"role": "user", "content": "Weather in Paris?"}], TOOLS)
    b = prepare_turn(tok, [{"role": "user", "content": "And in Rome?"}], TOOLS)
    n = a.prefix_len
    assert n == b.prefix_len > 500  # the system turn with the tools
    assert a.ids[:n] == b.ids[:n] and a.ids[n] != b.ids[n]
    assert _text(tok, a)[:n].endswith("<|im_start|>user\n")


@pytest.mark.parametrize("name", ["qwen3", "smollm3"])
def test_thinking_off_and_on(name):
    tok = _tok(name)
    msgs = [{"role": "user", "content": "2+2?"}]
    off = _text(tok, prepare_turn(tok, msgs, reasoning="off"))
    on = _text(tok, prepare_turn(tok, msgs, reasoning="on"))
    assert off.endswith("<think>\n\n</think>\n\n") or off.endswith("<think>\n\n</think>\n")
    assert not on.rstrip().endswith("</think>")
    turn = prepare_turn(tok, msgs, reasoning="on")
    assert turn.thinks and not turn.opens_reasoning


def test_template_kwargs_reach_the_template():
    tok = _tok("qwen3")
    msgs = [{"role": "user", "content": "2+2?"}]
    turn = prepare_turn(tok, msgs, template_kwargs={"enable_thinking": False})
    assert _text(tok, turn).endswith("</think>\n\n") and turn.reasoning.enabled is False
    with pytest.raises(InvalidArgumentError, match="may not set messages"):
        prepare_turn(tok, msgs, template_kwargs={"messages": []})


def test_a_template_that_opens_the_block_in_the_prompt():
    tok = _tok("deepseek-r1-distill-qwen")
    msgs = [{"role": "user", "content": "2+2?"}]
    on = prepare_turn(tok, msgs, reasoning="on")
    assert _text(tok, on).endswith("<think>\n") and on.opens_reasoning
    off = prepare_turn(tok, msgs, reasoning="off")
    assert not off.opens_reasoning and _text(tok, off).rstrip().endswith("</think>")


def test_an_answer_read_as_openai_deltas():
    tok = _tok("qwen3")
    turn = prepare_turn(
        tok, [{"role": "user", "content": "Weather in Paris?"}], TOOLS, reasoning="on"
    )
    answer = (
        "<think>\nThe user wants weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    reader = turn.reader()
    deltas = [d for i in range(0, len(answer), 4) for d in reader.feed(answer[i : i + 4])]
    deltas += reader.finish()
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "The user wants weather."
    assert not any(d.get("content") for d in deltas)
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert calls[0]["id"].startswith("call_") and calls[0]["index"] == 0
    assert json.loads(calls[1]["function"]["arguments"]) == {"city": "Paris"}
    msg = reader.message()
    assert msg["content"] is None and msg["reasoning_content"] == reasoning
    assert msg["tool_calls"][0]["function"]["name"] == "get_weather"
    assert reader.finish_reason("stop") == "tool_calls"
