"""tool_choice "required" or a named function on a real model (Qwen2.5-Coder-0.5B, its own
template): the call's markup and arguments are forced by the grammar
(generate/tool_calls.tool_call_grammar through generate/constraint), so every answer is
a call that parses and validates against the function's schema, greedy and sampled,
through the API and through `edgerun serve` read by the openai client."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 24},
                    "unit": {"enum": ["c", "f"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "integer", "minimum": 0, "maximum": 99},
                    "b": {"type": "integer", "minimum": 0, "maximum": 99},
                },
                "required": ["a", "b"],
            },
        },
    },
]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSGS = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = ["required", {"type": "function", "function": {"name": "add"}}]


@pytest.fixture(scope="module")
def qwen():
    import edgerun
    from edgerun import registry

    path = registry.resolve_path(registry.find("qwen2.5-coder-0.5b"))
    m = edgerun.load(path, n_ctx=2048, threads=2)
    yield m
    m.close()


def _check(calls: list[dict], choice) -> None:
    assert calls, "no tool call"
    for c in calls:
        name = c["function"]["name"]
        if isinstance(choice, dict):
            assert name == choice["function"]["name"]
        jsonschema.validate(json.loads(c["function"]["arguments"]), SCHEMAS[name])


@pytest.mark.parametrize("choice", CHOICES, ids=["required", "named"])
def test_a_forced_call_parses_and_validates(qwen, choice):
    for temperature, seed in ((0.0, None), (1.2, 5)):
        out = qwen.chat(
            MSGS,
            tools=TOOLS,
            tool_choice=choice,
            message=True,
            temperature=temperature,
            seed=seed,
            max_tokens=120,
        )
        assert out["finish_reason"] == "tool_calls", out
        _check(out["tool_calls"], choice)


def test_a_forced_call_with_a_response_format_is_refused(qwen):
    from edgerun.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="cannot be combined"):
        qwen.chat(
            MSGS, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}
        )


def test_the_server_forces_the_call_the_client_asks_for(qwen):
    from local_server import running

    from edgerun.serve.app import create_app

    with running(create_app(qwen)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        for choice in CHOICES:
            r = client.chat.completions.create(
                model="x", messages=MSGS, tools=TOOLS, tool_choice=choice, temperature=0.0
            )
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "tool_calls"
            _check([c.model_dump() for c in msg.tool_calls], choice)
        with pytest.raises(openai.BadRequestError, match="cannot be combined"):
            client.chat.completions.create(
                model="x",
                messages=MSGS,
                tools=TOOLS,
                tool_choice="required",
                response_format={"type": "json_object"},
            )
