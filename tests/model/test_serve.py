"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP on a
free localhost port (real SmolLM2 weights)."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

KEY = "test-key-123"
GREEDY = dict(temperature=0.0, extra_body={"repeat_penalty": 1.0})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(smollm2_path):
    import edgerun
    from edgerun.serve.app import create_app

    model = edgerun.load(smollm2_path, n_ctx=512, threads=2)
    model.warm_up()
    port = _free_port()
    app = create_app(model, api_key=KEY, max_body_bytes=64 << 10)
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    base = f"http://127.0.0.1:{port}"
    yield model, base
    srv.should_exit = True
    t.join(timeout=10)
    model.close()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[1] + "/v1", api_key=KEY, max_retries=0)


def test_models_and_health(server, client):
    model, base = server
    assert [m.id for m in client.models.list().data] == [model.name]
    h = httpx.get(base + "/health").json()
    assert h["status"] == "ok"


def test_chat_completion_matches_the_library(server, client):
    model, _ = server
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    want = model.chat(msgs, max_tokens=16, temperature=0.0, repeat_penalty=1.0)
    r = client.chat.completions.create(model="x", messages=msgs, max_tokens=16, **GREEDY)
    assert r.choices[0].message.content == want
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming(server, client):
    msgs = [{"role": "user", "content": "Name a fruit."}]
    full = client.chat.completions.create(model="x", messages=msgs, max_tokens=12, **GREEDY)
    stream = client.chat.completions.create(
        model="x",
        messages=msgs,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        **GREEDY,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] in ("stop", "length") and all(r is None for r in reasons[:-1])
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions_with_stop_and_seed(server, client):
    r = client.completions.create(
        model="x", prompt="1, 2, 3, 4,", max_tokens=20, stop=[" 7"], **GREEDY
    )
    assert " 7" not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    a = client.completions.create(model="x", prompt="Once upon a time", max_tokens=12, seed=5)
    b = client.completions.create(model="x", prompt="Once upon a time", max_tokens=12, seed=5)
    assert a.choices[0].text == b.choices[0].text
    s = client.completions.create(model="x", prompt="Once upon a time", max_tokens=8, stream=True)
    assert len("".join(c.choices[0].text for c in s)) > 0


def test_wrong_key_is_401(server):
    bad = openai.OpenAI(base_url=server[1] + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    r = httpx.post(server[1] + "/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ({"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
        ({"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
        ({"prompt": "hi", "temperature": 5}, 400, "temperature"),
        ({"prompt": "hi", "stop": 3}, 400, "stop"),
        ({"prompt": "hi", "n": 2}, 400, "n"),
        ({"prompt": 12}, 400, "prompt"),
        ({"prompt": "word " * 600}, 400, "prompt"),
    ],
)
def test_bad_completion_requests(server, body, status, param):
    r = httpx.post(
        server[1] + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_malformed_and_oversized_bodies(server, client):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = server[1] + "/v1/chat/completions"
    r = httpx.post(url, content=b"{not json", headers=h)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, content=json.dumps({"messages": "hi"}), headers=h)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    big = json.dumps({"messages": [{"role": "user", "content": "x" * (70 << 10)}]})
    r = httpx.post(url, content=big, headers=h)
    assert r.status_code == 413
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "hi"}], max_tokens=-1
        )


def test_concurrent_clients_get_sequential_answers(server, client):
    prompts = ["Tell me a joke.", "What is 2+2?", "Name a colour.", "Say hi in French."]

    def ask(p: str) -> str:
        r = client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": p}], max_tokens=16, **GREEDY
        )
        return r.choices[0].message.content

    seq = [ask(p) for p in prompts]
    out: list = [None] * len(prompts)
    threads = [
        threading.Thread(target=lambda i=i: out.__setitem__(i, ask(prompts[i])))
        for i in range(len(prompts))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == seq


def test_disconnect_mid_stream_frees_the_slot(server):
    model, base = server
    body = {
        "messages": [{"role": "user", "content": "Write a very long story."}],
        "max_tokens": 400,
        "stream": True,
    }
    h = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", base + "/v1/chat/completions", json=body, headers=h) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                break
    deadline = time.time() + 2  # 400 tokens would take ~8 s: only a cancel ends it this soon
    while model.scheduler.active and time.time() < deadline:
        time.sleep(0.05)
    assert model.scheduler.active == 0
