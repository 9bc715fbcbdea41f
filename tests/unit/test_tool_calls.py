"""Tool calls: checking requests, reading each family's markup (whole and streamed token by
token, broken markup back as content), and the grammar that forces a call (compiled and run
by llguidance's matcher where it is installed)."""

from __future__ import annotations

import json

import pytest

from edgerun.errors import InvalidArgumentError
from edgerun.generate.tool_calls import (
    MARKUPS,
    ToolCall,
    ToolCallParser,
    check_tool_choice,
    check_tools,
    markup_for,
    parse_tool_calls,
    template_messages,
    tool_call_grammar,
)


def _tool(name: str, props: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


TOOLS = check_tools(
    [
        _tool("get_weather", {"city": {"type": "string"}}, ["city"]),
        _tool("calc", {"expr": {"type": "string"}}, ["expr"]),
    ]
)
NAMES = ["get_weather", "calc"]

# (markup, a model's answer, content expected, calls expected as (name, arguments dict))
RECORDED = [
    (
        "hermes",
        'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "calc", "arguments": {"expr": "2*3"}}\n</tool_call>',
        "Checking.\n",
        [("get_weather", {"city": "Paris"}), ("calc", {"expr": "2*3"})],
    ),
    (  # Qwen2.5-Coder-0.5B's own habit: the call in a JSON code fence
        "hermes",
        '```json\n{\n  "name": "calc",\n  "arguments": {\n    "expr": "17 * 23"\n  }\n}\n```',
        "",
        [("calc", {"expr": "17 * 23"})],
    ),
    (
        "llama3",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
        "",
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "llama3",
        '<|python_tag|>{"name": "calc", "parameters": {"expr": "1"}}; '
        '{"name": "get_weather", "parameters": {"city": "Rome"}}',
        "",
        [("calc", {"expr": "1"}), ("get_weather", {"city": "Rome"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lyon"}, "id": "abc123def"}]',
        "",
        [("get_weather", {"city": "Lyon"})],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Nice"}[TOOL_CALLS]calc[ARGS]{"expr": "9"}',
        "",
        [("get_weather", {"city": "Nice"}), ("calc", {"expr": "9"})],
    ),
    (
        "phi4",
        '<|tool_call|>[{"name": "calc", "arguments": {"expr": "4/2"}}]<|/tool_call|>',
        "",
        [("calc", {"expr": "4/2"})],
    ),
    # broken markup from the model: content, never an error
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> sorry',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call> sorry',
        [],
    ),
    ("hermes", '<tool_call>\n{"name": "get_wea', '<tool_call>\n{"name": "get_wea', []),
    (  # a function that was not offered is not a call
        "hermes",
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
        [],
    ),
    ("hermes", "Use ```python\nprint(1)\n``` here.", "Use ```python\nprint(1)\n``` here.", []),
    ("llama3", 'Sure: {"name": "calc"}', 'Sure: {"name": "calc"}', []),
    ("hermes", '{"city": "Paris"}', '{"city": "Paris"}', []),
]


def _calls(calls: list[ToolCall]) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("markup,text,content,calls", RECORDED)
def test_recorded_answers_parse_whole_and_streamed(markup, text, content, calls):
    got_content, got_calls = parse_tool_calls(text, MARKUPS[markup], NAMES)
    assert got_content == content
    assert _calls(got_calls) == calls
    for step in (1, 3):  # a piece per character, and pieces that split every tag
        p = ToolCallParser(MARKUPS[markup], NAMES)
        events = []
        for i in range(0, len(text), step):
            events += p.feed(text[i : i + step])
        events += p.finish()
        assert "".join(e for e in events if isinstance(e, str)) == content
        assert _calls([e for e in events if isinstance(e, ToolCall)]) == calls
        assert p.broken == (not calls and MARKUPS[markup].open in text)


def test_calls_arrive_as_soon_as_their_markup_closes():
    p = ToolCallParser(MARKUPS["hermes"], NAMES)
    head = '<tool_call>\n{"name": "calc", "arguments": {"expr": "1"}}\n</tool_call>'
    assert [type(e) for e in p.feed(head)] == [ToolCall]
    assert p.feed("<tool") == []  # a possible second opening is held back
    assert p.finish() == ["<tool"]


def test_markup_is_picked_from_tokens_and_template_not_names():
    assert markup_for(["[TOOL_CALLS]"], None).name == "mistral"
    assert markup_for(["<|tool_call|>"], "").name == "phi4"
    assert markup_for([], "... <tool_call> ...").name == "hermes"
    assert markup_for(["<|python_tag|>"], None).name == "llama3"
    assert markup_for(["<|im_start|>"], "{{ messages }}") is None


@pytest.mark.parametrize(
    "tools,message",
    [
        ({"a": 1}, "'tools' must be a list"),
        ([{"type": "retrieval"}], "tools[0].type must be 'function'"),
        ([{"type": "function"}], "tools[0].function must be an object"),
        ([{"type": "function", "function": {"name": "has space"}}], "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": "x"}}],
            "tools[0].function.parameters must be a JSON schema object",
        ),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}],
            "tools[0].function.parameters is not a valid JSON schema",
        ),
        ([_tool("f", {}, []), _tool("f", {}, [])], "'f' is given twice"),
    ],
)
def test_malformed_tools_are_refused_by_name(tools, message):
    with pytest.raises(InvalidArgumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        check_tools(tools)


def test_tool_choice():
    assert check_tool_choice(None, TOOLS) == "auto"
    assert check_tool_choice(None, []) == "none"
    assert check_tool_choice("required", TOOLS) == "required"
    named = {"type": "function", "function": {"name": "calc"}}
    assert check_tool_choice(named, TOOLS) == named
    with pytest.raises(InvalidArgumentError, match="not in 'tools'"):
        check_tool_choice({"type": "function", "function": {"name": "x"}}, TOOLS)
    with pytest.raises(InvalidArgumentError, match="no 'tools'"):
        check_tool_choice("required", [])
    with pytest.raises(InvalidArgumentError, match="'auto', 'none', 'required'"):
        check_tool_choice("sometimes", TOOLS)


def test_template_messages_give_templates_argument_objects():
    msgs = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "1",
                    "type": "function",
                    "function": {"name": "calc", "arguments": '{"a": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "1", "name": "calc", "content": "2"},
    ]
    out = template_messages(msgs)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1}
    assert out[1] == msgs[1]
    assert msgs[0]["tool_calls"][0]["function"]["arguments"] == '{"a": 1}'  # not modified


# -- the grammar that forces a call ------------------------------------------------------


@pytest.fixture(scope="module")
def byte_tokenizer():
    """An LLTokenizer of 256 byte tokens and an EOS: grammars run on text, instantly."""
    llguidance = pytest.importorskip("llguidance")

    class Bytes:
        eos_token_id = 256
        bos_token_id = None
        tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
        special_token_ids = [256]

        def __call__(self, s):
            return list(s if isinstance(s, bytes) else s.encode())

    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(Bytes()))


def _matches(tok, grammar: str, text: str) -> bool:
    import llguidance

    m = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_lark(grammar))
    assert not m.is_error(), m.get_error()
    return m.consume_tokens(list(text.encode())) and m.is_accepting()


CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
CALC = '{"name": "calc", "arguments": {"expr": "1+1"}}'


@pytest.mark.parametrize(
    "markup,good,bad",
    [
        (
            "hermes",
            [
                f"<tool_call>\n{CALL}\n</tool_call>",
                f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{CALC}\n</tool_call>",
            ],
            [
                CALL,
                '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',
                '<tool_call>\n{"name": "calc", "arguments": {"expr": 1}}\n</tool_call>',
            ],
        ),
        (
            "llama3",
            [
                CALL.replace("arguments", "parameters"),
                f"{CALL}; {CALC}".replace("arguments", "parameters"),
            ],
            [CALL, "<|python_tag|>" + CALL],
        ),
        ("mistral", [f"[TOOL_CALLS][{CALL}, {CALC}]"], [f"[TOOL_CALLS]{CALL}"]),
        ("phi4", [f"<|tool_call|>[{CALL}]<|/tool_call|>"], [f"<|tool_call|>[{CALL}]"]),
    ],
)
def test_required_grammar_accepts_valid_calls_only(byte_tokenizer, markup, good, bad):
    import llguidance

    g = tool_call_grammar(TOOLS, "required", MARKUPS[markup])
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(g)) == ""
    for text in good:
        assert _matches(byte_tokenizer, g, text), text
        content, calls = parse_tool_calls(text, MARKUPS[markup], NAMES)
        assert calls and not content.strip()  # what the grammar lets through, the parser reads
    for text in bad:
        assert not _matches(byte_tokenizer, g, text), text


def test_named_choice_grammar_forces_that_function_once(byte_tokenizer):
    g = tool_call_grammar(
        TOOLS, {"type": "function", "function": {"name": "calc"}}, MARKUPS["hermes"]
    )
    assert _matches(byte_tokenizer, g, f"<tool_call>\n{CALC}\n</tool_call>")
    assert not _matches(byte_tokenizer, g, f"<tool_call>\n{CALL}\n</tool_call>")
    assert not _matches(
        byte_tokenizer, g, f"<tool_call>\n{CALC}\n</tool_call>\n<tool_call>\n{CALC}\n</tool_call>"
    )


def test_a_grammar_without_parallel_calls_allows_one(byte_tokenizer):
    g = tool_call_grammar(TOOLS, "required", MARKUPS["hermes"], parallel=False)
    one = f"<tool_call>\n{CALC}\n</tool_call>"
    assert _matches(byte_tokenizer, g, one)
    assert not _matches(byte_tokenizer, g, one + "\n" + one)


def test_special_token_markers_become_token_references():
    g = tool_call_grammar(
        TOOLS, "required", MARKUPS["phi4"], special_tokens=["<|tool_call|>", "<|/tool_call|>"]
    )
    assert g.startswith("start: <|tool_call|> ")
    assert '"<|tool_call|>"' not in g


def test_parameters_with_local_references_compile_and_bind(byte_tokenizer):
    """pydantic (and instructor) write nested models and enums as `#/$defs/X`; inside the
    call's wrapper schema they must still point into the function's own parameters."""
    params = {
        "$defs": {
            "Priority": {"enum": ["low", "high"], "type": "string"},
            "Node": {
                "type": "object",
                "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}},
                "required": ["kids"],
                "additionalProperties": False,
            },
        },
        "type": "object",
        "properties": {"priority": {"$ref": "#/$defs/Priority"}, "tree": {"$ref": "#/$defs/Node"}},
        "required": ["priority", "tree"],
        "additionalProperties": False,
    }
    tools = [{"type": "function", "function": {"name": "task", "parameters": params}}]
    g = tool_call_grammar(tools, "required", MARKUPS["hermes"])

    def call(args: dict) -> str:
        return f"<tool_call>\n{json.dumps({'name': 'task', 'arguments': args})}\n</tool_call>"

    tree = {"kids": [{"kids": []}, {"kids": [{"kids": []}]}]}
    assert _matches(byte_tokenizer, g, call({"priority": "high", "tree": tree}))
    assert not _matches(byte_tokenizer, g, call({"priority": "urgent", "tree": tree}))
    assert not _matches(byte_tokenizer, g, call({"priority": "low", "tree": {"kids": [1]}}))
