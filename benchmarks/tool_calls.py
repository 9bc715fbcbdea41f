"""Tool use on 30 prompts: does the model pick the right function(s), and do the arguments
parse and validate against the function's schema (jsonschema)?

Runs `edgerun serve` on each model and asks it through the official `openai` client
(greedy, non-streamed, plus the same prompts streamed where --stream is given), then, with
--llamacpp, llama-cpp-python on the same GGUF: `create_chat_completion(tools=...)` with
`chat_format="chatml-function-calling"` (its own prompt and grammar), and its engine on
edgerun's prompt (the GGUF's own template, rendered here) read back by edgerun's parser.

    python benchmarks/tool_calls.py -m ~/.cache/edgerun/models/qwen2.5-coder-0.5b-instruct.gguf \\
        --llamacpp -o benchmarks/results/tool_calls.txt

The prompts: 12 that need one call (one obvious tool), 8 that need a choice among close tools,
5 that need two calls at once (parallel), 5 that need none. A prompt scores when the set of
functions called is the expected one (none for the last group) and every call's arguments
are a JSON object valid against the function's parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import jsonschema


def _fn(name: str, description: str, props: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {"type": "object", "properties": props, "required": required},
        },
    }


S = {"type": "string"}
TOOLS = [
    _fn(
        "get_weather",
        "Current weather for a city",
        {"city": S, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        ["city"],
    ),
    _fn(
        "get_forecast",
        "Weather forecast for a city for the next days",
        {"city": S, "days": {"type": "integer", "minimum": 1, "maximum": 14}},
        ["city", "days"],
    ),
    _fn("calculator", "Evaluate an arithmetic expression", {"expression": S}, ["expression"]),
    _fn(
        "web_search",
        "Search the web and return the top results",
        {"query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 20}},
        ["query"],
    ),
    _fn(
        "create_calendar_event",
        "Create an event in the user's calendar",
        {"title": S, "date": {"type": "string", "description": "YYYY-MM-DD"}, "time": S},
        ["title", "date"],
    ),
    _fn(
        "list_calendar_events",
        "List the events in the user's calendar on a date",
        {"date": {"type": "string", "description": "YYYY-MM-DD"}},
        ["date"],
    ),
    _fn(
        "send_email",
        "Send an email",
        {"to": S, "subject": S, "body": S},
        ["to", "subject", "body"],
    ),
    _fn(
        "convert_currency",
        "Convert an amount of money from one currency to another",
        {"amount": {"type": "number"}, "from_currency": S, "to_currency": S},
        ["amount", "from_currency", "to_currency"],
    ),
    _fn(
        "translate_text",
        "Translate text into another language",
        {"text": S, "target_language": S},
        ["text", "target_language"],
    ),
    _fn(
        "get_stock_price",
        "The latest price of a stock by its ticker symbol",
        {"ticker": S},
        ["ticker"],
    ),
]

# (group, prompt, expected function names: a multiset; empty = no call)
PROMPTS: list[tuple[str, str, list[str]]] = [
    ("one", "What's the weather like in Paris right now?", ["get_weather"]),
    ("one", "Compute 17 * 23 + 5 for me.", ["calculator"]),
    ("one", "Search the web for the latest news about the James Webb telescope.", ["web_search"]),
    (
        "one",
        "Add a meeting called 'Budget review' to my calendar on 2025-03-14 at 10:00.",
        ["create_calendar_event"],
    ),
    (
        "one",
        "Send an email to alice@example.com with subject 'Lunch' saying 'See you at noon'.",
        ["send_email"],
    ),
    ("one", "How much is 250 US dollars in euros?", ["convert_currency"]),
    ("one", "Translate 'good morning, my friend' into Spanish.", ["translate_text"]),
    ("one", "What is Apple's stock (AAPL) trading at?", ["get_stock_price"]),
    ("one", "What's on my calendar for 2025-06-01?", ["list_calendar_events"]),
    ("one", "Give me the 5-day weather forecast for Berlin.", ["get_forecast"]),
    ("one", "What is the square root of 1764?", ["calculator"]),
    ("one", "Is it raining in London at the moment? Use celsius.", ["get_weather"]),
    ("choice", "Will I need an umbrella in Tokyo over the next 3 days?", ["get_forecast"]),
    ("choice", "How hot is it in Cairo today?", ["get_weather"]),
    ("choice", "Find recent articles about quantum computing.", ["web_search"]),
    ("choice", "Do I have anything scheduled on 2025-12-24?", ["list_calendar_events"]),
    ("choice", "Put 'Dentist' in my calendar for 2025-05-02.", ["create_calendar_event"]),
    ("choice", "What's 15% of 480?", ["calculator"]),
    ("choice", "How many Japanese yen do I get for 100 British pounds?", ["convert_currency"]),
    ("choice", "Check the current share price of Microsoft, ticker MSFT.", ["get_stock_price"]),
    (
        "parallel",
        "What's the weather in Paris and in Tokyo right now?",
        ["get_weather", "get_weather"],
    ),
    (
        "parallel",
        "Get me the stock prices of AAPL and GOOG.",
        ["get_stock_price", "get_stock_price"],
    ),
    (
        "parallel",
        "What's the weather in Rome, and what is 12 * 12?",
        ["get_weather", "calculator"],
    ),
    (
        "parallel",
        "Translate 'thank you' into French and into German.",
        ["translate_text", "translate_text"],
    ),
    (
        "parallel",
        "Convert 100 USD to EUR and 100 USD to JPY.",
        ["convert_currency", "convert_currency"],
    ),
    ("none", "Hi! How are you today?", []),
    ("none", "Write a haiku about autumn leaves.", []),
    ("none", "What is the capital of France?", []),
    ("none", "Explain what a Python list comprehension is in one sentence.", []),
    ("none", "Thanks, that's all I needed.", []),
]

SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def score(expected: list[str], calls: list[tuple[str, str]]) -> tuple[bool, bool, str]:
    """(right functions, every call's arguments valid, a note) for one answer."""
    names = Counter(n for n, _ in calls)
    right = names == Counter(expected) if expected else not calls
    if expected and not right and len(set(expected)) == 1 and set(names) == set(expected):
        right = False  # the right function, the wrong number of calls
    valid, notes = True, []
    for name, args in calls:
        try:
            obj = json.loads(args)
            if name not in SCHEMAS:
                raise ValueError(f"unknown function {name}")
            jsonschema.validate(obj, SCHEMAS[name])
        except (ValueError, jsonschema.ValidationError) as e:
            valid = False
            notes.append(f"{name}: {str(e).splitlines()[0][:60]}")
    return right, valid, "; ".join(notes)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_edgerun(model: str, threads: int, stream: bool, tool_choice: str = "auto") -> list[dict]:
    from openai import OpenAI

    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    cmd = [sys.executable, "-m", "edgerun", "serve", "-m", model, "--port", str(port)]
    cmd += ["--threads", str(threads), "--ctx", "4096"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        for _ in range(600):
            try:
                client.models.list()
                break
            except Exception:  # noqa: BLE001 - not up yet
                if proc.poll() is not None:
                    raise RuntimeError(proc.stderr.read().decode()[-2000:]) from None
                time.sleep(1)
        rows = []
        for group, prompt, expected in PROMPTS:
            t0 = time.perf_counter()
            msgs = [{"role": "user", "content": prompt}]
            kw = dict(model="m", messages=msgs, tools=TOOLS, temperature=0, max_tokens=256)
            kw["tool_choice"] = tool_choice
            if stream:
                calls: dict[int, list[str]] = {}
                content, finish = "", None
                for ch in client.chat.completions.create(stream=True, **kw):
                    c = ch.choices[0] if ch.choices else None
                    if c is None:
                        continue
                    finish = c.finish_reason or finish
                    content += c.delta.content or ""
                    for tc in c.delta.tool_calls or []:
                        slot = calls.setdefault(tc.index, ["", ""])
                        slot[0] += (tc.function.name or "") if tc.function else ""
                        slot[1] += (tc.function.arguments or "") if tc.function else ""
                got = [(n, a) for n, a in calls.values()]
            else:
                r = client.chat.completions.create(**kw)
                c = r.choices[0]
                finish, content = c.finish_reason, c.message.content or ""
                got = [(t.function.name, t.function.arguments) for t in c.message.tool_calls or []]
            rows.append(_row(group, prompt, expected, got, content, finish, t0))
        return rows
    finally:
        proc.terminate()
        proc.wait(30)


def _row(group, prompt, expected, got, content, finish, t0) -> dict:
    right, valid, note = score(expected, got)
    return {
        "group": group,
        "prompt": prompt,
        "expected": expected,
        "calls": got,
        "content": content[:80],
        "finish": finish,
        "right": right,
        "valid": valid,
        "note": note,
        "seconds": time.perf_counter() - t0,
    }


def run_llamacpp(model: str, threads: int, mode: str) -> list[dict]:
    """llama-cpp-python on the same GGUF. mode "chatml-function-calling": its own tool
    prompt and grammar; "template": edgerun's prompt (the GGUF's template), llama.cpp's
    decoding, edgerun's parser."""
    import llama_cpp

    from edgerun.generate.chat_template import render_chat
    from edgerun.generate.tool_calls import markup_for, parse_tool_calls

    fmt = "chatml-function-calling" if mode == "chatml-function-calling" else None
    llm = llama_cpp.Llama(
        model_path=model, n_ctx=4096, n_threads=threads, chat_format=fmt, verbose=False
    )
    template = llm.metadata.get("tokenizer.chat_template")
    markup = markup_for([], template)
    names = [t["function"]["name"] for t in TOOLS]
    rows = []
    for group, prompt, expected in PROMPTS:
        t0 = time.perf_counter()
        msgs = [{"role": "user", "content": prompt}]
        if fmt is not None:
            r = llm.create_chat_completion(
                messages=msgs, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=256
            )
            c = r["choices"][0]
            got = [
                (t["function"]["name"], t["function"]["arguments"])
                for t in c["message"].get("tool_calls") or []
            ]
            rows.append(
                _row(
                    group,
                    prompt,
                    expected,
                    got,
                    c["message"].get("content") or "",
                    c["finish_reason"],
                    t0,
                )
            )
        else:
            text = render_chat(template, msgs, tools=TOOLS)
            out = llm.create_completion(text, temperature=0, max_tokens=256)
            raw = out["choices"][0]["text"]
            content, calls = parse_tool_calls(raw, markup, names)
            got = [(c.name, c.arguments) for c in calls]
            finish = "tool_calls" if calls else out["choices"][0]["finish_reason"]
            rows.append(_row(group, prompt, expected, got, content, finish, t0))
    return rows


def report(title: str, rows: list[dict]) -> str:
    lines = [title]
    groups = ["one", "choice", "parallel", "none"]
    for g in groups + ["all"]:
        sel = [r for r in rows if g == "all" or r["group"] == g]
        n = len(sel)
        right = sum(r["right"] for r in sel)
        ok = sum(r["right"] and r["valid"] for r in sel)
        n_calls = sum(len(r["calls"]) for r in sel)
        valid_calls = n_calls - sum(r["note"].count(";") + 1 for r in sel if r["note"])
        lines.append(
            f"  {g:9s} right function(s) {right:2d}/{n:2d}  right + valid {ok:2d}/{n:2d}  "
            f"calls {n_calls:2d}, arguments valid {valid_calls:2d}"
        )
    secs = sum(r["seconds"] for r in rows)
    lines.append(f"  time {secs:.0f} s")
    misses = [r for r in rows if not (r["right"] and r["valid"])]
    for r in misses:
        got = ", ".join(f"{n}({a})" for n, a in r["calls"]) or repr(r["content"][:60])
        lines.append(f"    miss [{r['group']}] {r['prompt'][:50]!r}: {got[:110]} {r['note']}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", action="append", required=True, help="GGUF path (repeat)")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--stream", action="store_true", help="also ask edgerun with stream=True")
    ap.add_argument("--llamacpp", action="store_true", help="also run llama-cpp-python")
    ap.add_argument("--no-edgerun", action="store_true", help="run only llama-cpp-python")
    ap.add_argument("-o", "--out", default=None, help="append the report to this file")
    ap.add_argument(
        "--tool-choice",
        default="auto",
        choices=["auto", "required"],
        help="edgerun's tool_choice; 'required' forces a call on every prompt (the 'none' "
        "prompts then score as misses): what counts is that every call is valid",
    )
    a = ap.parse_args()
    out = []
    for model in a.model:
        model = os.path.expanduser(model)
        name = Path(model).name
        runs = [
            (
                "edgerun serve + openai client",
                lambda model=model: run_edgerun(model, a.threads, False, a.tool_choice),
            )
        ]
        if a.no_edgerun:
            runs = []
        if a.stream:
            runs.append(
                (
                    "edgerun serve + openai client, streamed",
                    lambda model=model: run_edgerun(model, a.threads, True, a.tool_choice),
                )
            )
        if a.llamacpp:
            runs.append(
                (
                    "llama-cpp-python create_chat_completion, chatml-function-calling",
                    lambda model=model: run_llamacpp(model, a.threads, "chatml-function-calling"),
                )
            )
            runs.append(
                (
                    "llama-cpp-python on the GGUF's template (edgerun's prompt and parser)",
                    lambda model=model: run_llamacpp(model, a.threads, "template"),
                )
            )
        for title, fn in runs:
            choice = f", tool_choice {a.tool_choice}" if "edgerun" in title else ""
            text = report(f"{name}: {title} ({len(PROMPTS)} prompts, greedy{choice})", fn())
            print(text, flush=True)
            out.append(text)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n\n".join(out) + "\n\n")


if __name__ == "__main__":
    main()
