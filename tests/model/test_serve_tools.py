"""Tool calls and reasoning through `edgerun serve`, read by the official `openai` client over
real HTTP: the model's answers are recorded ones (a tiny model with Qwen's template, its
scheduler replaced by a replay), so what is checked is the server's reading of them:
streamed tool_calls deltas, reasoning_content, finish_reason, and the 400s."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

DATA = Path(__file__).resolve().parents[1] / "data"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
CALLS = (
    "<think>\nTwo cities.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>'
)


class Replay:
    """A scheduler that answers every request with the recorded text, a few characters a
    piece (tags split across pieces), and keeps what it was asked."""

    def __init__(self) -> None:
        self.answer = ""
        self.asked: list[list[int]] = []

    def submit(self, ids, params, max_tokens, stop=(), prefix_len=0, **kw):
        from edgerun.generate.sequence import GenerationStats

        self.asked.append(list(ids))
        text = self.answer
        pieces = [text[i : i + 3] for i in range(0, len(text), 3)]

        class Request:
            stats = GenerationStats(prompt_tokens=len(ids), generated_tokens=len(pieces))
            stats.finish_reason = "stop"

            async def __aiter__(self):
                for p in pieces:
                    yield p

            def cancel(self):
                pass

        return Request()

    active = 0


@pytest.fixture(scope="module")
def server():
    from local_server import running

    import edgerun
    from edgerun.serve.app import create_app

    model = edgerun.load(DATA / "families" / "qwen2" / "q8_0.gguf", n_ctx=2048, threads=1)
    template = (DATA / "chat_templates" / "qwen3.jinja").read_text()
    model.tokenizer.chat_template = template
    model.n_ctx = 4096  # the replay computes nothing: the tiny model's 128 do not bind
    replay = Replay()
    model.serving._scheduler = replay  # what model.scheduler returns
    with running(create_app(model)) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)
        yield model, replay, client


MSGS = [{"role": "user", "content": "Weather in Paris and Tokyo?"}]


def test_tool_calls_in_a_response(server):
    model, replay, client = server
    replay.answer = CALLS
    r = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.content is None
    assert c.message.reasoning_content == "Two cities."
    args = [json.loads(t.function.arguments) for t in c.message.tool_calls]
    assert args == [{"city": "Paris"}, {"city": "Tokyo"}]
    assert len({t.id for t in c.message.tool_calls}) == 2
    assert model.tokenizer.decode(replay.asked[-1]).count('"name": "get_weather"') == 1


def test_tool_calls_streamed(server):
    _, replay, client = server
    replay.answer = CALLS
    calls: dict[int, dict] = {}
    reasoning, content, finish = "", "", None
    for ch in client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS, stream=True):
        d = ch.choices[0].delta
        finish = ch.choices[0].finish_reason or finish
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += tc.id or ""
            slot["name"] += tc.function.name or ""
            slot["arguments"] += tc.function.arguments or ""
    assert finish == "tool_calls" and content == "" and reasoning == "Two cities."
    assert [c["name"] for c in calls.values()] == ["get_weather", "get_weather"]
    assert [json.loads(c["arguments"])["city"] for c in calls.values()] == ["Paris", "Tokyo"]


def test_parallel_tool_calls_false_keeps_the_first_call(server):
    _, replay, client = server
    replay.answer = CALLS
    r = client.chat.completions.create(
        model="m", messages=MSGS, tools=TOOLS, parallel_tool_calls=False
    )
    calls = r.choices[0].message.tool_calls
    assert len(calls) == 1 and json.loads(calls[0].function.arguments) == {"city": "Paris"}


def test_tool_results_go_back_to_the_template(server):
    model, replay, client = server
    replay.answer = "It is 18 C in Paris."
    msgs = [
        *MSGS,
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
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
    ]
    r = client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    assert r.choices[0].message.content == "It is 18 C in Paris."
    assert r.choices[0].finish_reason == "stop"
    prompt = model.tokenizer.decode(replay.asked[-1])
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in prompt
    assert "<tool_response>\n18 C\n</tool_response>" in prompt


def test_broken_markup_comes_back_as_content(server):
    _, replay, client = server
    replay.answer = '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>'
    r = client.chat.completions.create(model="m", messages=MSGS, tools=TOOLS)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == replay.answer
    assert not r.choices[0].message.tool_calls


def test_reasoning_off_through_chat_template_kwargs_and_effort(server):
    model, replay, client = server
    replay.answer = "4"
    for extra in (
        {"chat_template_kwargs": {"enable_thinking": False}},
        {"reasoning_effort": "none"},
    ):
        r = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "2+2?"}], extra_body=extra
        )
        assert r.choices[0].message.content == "4"
        assert model.tokenizer.decode(replay.asked[-1]).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize(
    "extra,needle",
    [
        ({"tools": {"x": 1}}, "'tools' must be a list"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": "always"}, "'tool_choice' must be"),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not in 'tools'",
        ),
        ({"reasoning_effort": "extreme"}, "'reasoning_effort' must be one of"),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"function": "x"}]}]},
            "messages[0].tool_calls must be a list",
        ),
    ],
)
def test_malformed_requests_are_400s(server, extra, needle):
    _, _, client = server
    body = {"model": "m", "messages": MSGS, **extra}
    with pytest.raises(openai.BadRequestError) as e:
        client.post("/chat/completions", body=body, cast_to=object)
    assert needle in e.value.body["message"]
