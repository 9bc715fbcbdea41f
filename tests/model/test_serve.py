"""The OpenAI-compatible server, driven by the official `openai` client over real HTTP on a
free localhost port (real SmolLM2 weights)."""

from __future__ import annotations

import json
import socket
import threading
import time

import numpy as np
import pytest

from edgerun.generate.embedding import text_tokens

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

KEY = "test-key-123"
GREEDY = dict(temperature=0.0, extra_body={"repeat_penalty": 1.0})


@pytest.fixture(scope="module")
def server(smollm2_path):
    from local_server import running

    import edgerun
    from edgerun.serve.app import create_app

    model = edgerun.load(smollm2_path, n_ctx=512, threads=2)
    model.warm_up()
    app = create_app(model, api_key=KEY, max_body_bytes=64 << 10)
    with running(app) as base:
        yield model, base
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
    for depth in (200, 2000):  # past our limit, and past Python's own parser
        schema = '{"type":"array","items":' * depth + "{}" + "}" * depth
        deep = '{"messages": [{"role": "user", "content": "hi"}], "response_format": '
        deep += f'{{"type": "json_schema", "json_schema": {{"name": "x", "schema": {schema}}}}}}}'
        r = httpx.post(url, content=deep, headers=h)
        assert r.status_code == 400 and "levels deep" in r.json()["error"]["message"], r.text
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


def test_embeddings_with_the_openai_client(server, client):
    model, _ = server
    texts = ["The capital of France is Paris.", "def add(a, b): return a + b"]
    want = model.embed(texts)
    r = client.embeddings.create(model="x", input=texts)  # the client asks for base64
    got = np.array([d.embedding for d in r.data], np.float32)
    np.testing.assert_array_equal(got, want)
    assert [d.index for d in r.data] == [0, 1]
    n = sum(len(text_tokens(model.tokenizer, t)) for t in texts)
    assert r.usage.prompt_tokens == n == r.usage.total_tokens
    f = client.embeddings.create(model="x", input=texts[0], encoding_format="float")
    np.testing.assert_allclose(f.data[0].embedding, want[0], rtol=1e-6)
    ids = text_tokens(model.tokenizer, texts[1])
    t = client.embeddings.create(model="x", input=ids, encoding_format="float")
    np.testing.assert_allclose(t.data[0].embedding, want[1], rtol=1e-6)
    mean = client.embeddings.create(
        model="x", input=texts[0], encoding_format="float", extra_body={"pooling": "mean"}
    )
    np.testing.assert_allclose(mean.data[0].embedding, model.embed(texts[0], "mean")[0], rtol=1e-6)


@pytest.mark.parametrize(
    "body, param",
    [
        ({}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [1, -5]}, "input"),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "hi", "dimensions": 7}, "dimensions"),
        ({"input": "word " * 600}, "input"),
        ({"input": "hi", "pooling": "max"}, None),
    ],
)
def test_bad_embedding_requests(server, body, param):
    r = httpx.post(
        server[1] + "/v1/embeddings", json=body, headers={"Authorization": f"Bearer {KEY}"}
    )
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def _post_whole_then_read(base: str, body: bytes) -> bytes:
    """POST over a plain socket that sends the whole body, a slice at a time, before it
    reads anything (what a client on a slow link does); the status line it gets."""
    host, port = base.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {KEY}"
            f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        s.sendall(head.encode())
        for i in range(0, len(body), 256 << 10):
            s.sendall(body[i : i + (256 << 10)])
        return s.recv(4096).split(b"\r\n")[0]


def test_an_8mb_body_gets_a_413_the_client_reads(server, client):
    _, base = server
    content = "x" * (8 << 20)
    big = json.dumps({"messages": [{"role": "user", "content": content}]}).encode()
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    r = httpx.post(base + "/v1/chat/completions", content=big, headers=h, timeout=60)
    assert r.status_code == 413 and "request body over" in r.json()["error"]["message"]
    chunks = (big[i : i + (1 << 20)] for i in range(0, len(big), 1 << 20))  # no length given
    r = httpx.post(base + "/v1/chat/completions", content=chunks, headers=h, timeout=60)
    assert r.status_code == 413
    assert _post_whole_then_read(base, big) == b"HTTP/1.1 413 Request Entity Too Large"
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": content}])
    assert e.value.status_code == 413
    with pytest.raises(openai.APIStatusError) as e:
        client.embeddings.create(model="x", input=content)
    assert e.value.status_code == 413
    # the connection pool is still good for the next request
    assert client.embeddings.create(model="x", input="ok").data[0].embedding
