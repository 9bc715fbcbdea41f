"""Hostile requests against `edgerun serve` running in a memory cgroup.

Starts the server as the only process of a memory cgroup (Linux cgroup v1, root) with a
limit of `--limit` and sends requests an app or an attacker could send: schemas that
explode when compiled (a 10^5-member enum, a `$ref` cycle, 2^300-fold `$ref` doubling,
deep nesting, a huge `(x{1000}){1000}` regex, catastrophic regexes), malformed tools,
a grammar bomb, an 8 MiB body. Each must be answered with a 4xx (or, for a grammar the
library accepts, a bounded answer) within `--timeout` seconds; after all of them the
server must still answer a plain request, and the group must never have hit its limit.
Prints one line per request and the group's peak.

    python benchmarks/hostile_requests.py -m smollm2-135m --limit 1G
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offload import _drop_caches, _make_cgroup  # noqa: E402 - benchmarks/offload.py

from edgerun.offload.plan import parse_budget  # noqa: E402


def _ref_doubling(depth: int) -> dict:
    """A schema whose `$defs` each use the next twice: a few KB of JSON that expands to
    2^depth alternatives if a compiler inlines references."""
    defs = {f"d{i}": {"anyOf": [{"$ref": f"#/$defs/d{i + 1}"},
                                {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}}]}
            for i in range(depth)}  # fmt: skip
    defs[f"d{depth}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


class _Deep:
    """A schema nested `depth` objects deep, as JSON text (deeper than Python's own
    encoder recurses): a request parser must refuse it, not crash."""

    def __init__(self, depth: int) -> None:
        self.text = '{"type":"object","properties":{"a":' * depth + '{"type":"integer"}'
        self.text += '},"required":["a"]}' * depth


def _encode(body) -> str:
    """json.dumps, with each _Deep written as its text."""
    marks: dict[str, str] = {}

    def default(o):
        if isinstance(o, _Deep):
            key = f"@deep{len(marks)}@"
            marks[key] = o.text
            return key
        raise TypeError(type(o).__name__)

    text = json.dumps(body, default=default)
    for key, deep in marks.items():
        text = text.replace(json.dumps(key), deep)
    return text


def _fmt(schema) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _chat(**extra) -> dict:
    return {"messages": [{"role": "user", "content": "Answer."}], "max_tokens": 16, **extra}


def cases() -> list[tuple[str, bytes]]:
    cycle = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}}
    bomb = "\n".join(
        ["start: r0"] + [f'r{i}: r{i + 1} r{i + 1} | "x"' for i in range(60)] + ['r60: "y"']
    )
    tool = {"type": "function", "function": {"name": "f", "parameters": _Deep(2000)}}
    tool40 = {"type": "function", "function": {"name": "f", "parameters": _Deep(40)}}
    items = [
        ("enum 10^5", _chat(response_format=_fmt({"enum": list(range(10**5))}))),
        ("$ref cycle", _chat(response_format=_fmt(cycle))),
        ("$ref doubling 2^300", _chat(response_format=_fmt(_ref_doubling(300)))),
        ("nesting depth 2000", _chat(response_format=_fmt(_Deep(2000)))),
        ("regex (x{1000}){1000}", _chat(regex="(x{1000}){1000}")),
        ("regex (a+)+$", _chat(regex="(a+)+$")),
        ("regex (a|a?)+b{0,9999}", _chat(regex="(a|a?)+b{0,9999}")),
        ("grammar 2^60 rules", _chat(grammar=bomb)),
        ("tools: not a list", _chat(tools={"type": "function"})),
        ("tools: no name", _chat(tools=[{"type": "function", "function": {}}])),
        ("tools: depth 2000", _chat(tools=[tool], tool_choice="required")),
        ("tools: depth 40, forced", _chat(tools=[tool40], tool_choice="required")),
        ("tool_choice unknown", _chat(tools=[tool40], tool_choice={"type": "function",
                                                                  "function": {"name": "g"}})),
    ]  # fmt: skip
    out = [(name, _encode(body).encode()) for name, body in items]
    out.append(("8 MiB body", b'{"messages": [{"role": "user", "content": "' + b"a" * (8 << 20)
                + b'"}]}'))  # fmt: skip
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(base: str, body: bytes, timeout: float) -> tuple[int | str, str]:
    req = urllib.request.Request(
        f"{base}/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()[:120]
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()[:120]
    except OSError as e:
        return type(e).__name__, str(e)[:120]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--limit", default="1G", help="the memory cgroup's limit")
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds allowed per request")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    limit = parse_budget(args.limit)
    group = _make_cgroup(f"edgerun-hostile-{os.getpid()}", limit)
    _drop_caches()
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "edgerun", "serve", "-m", args.model, "--port", str(port),
           "-t", str(args.threads), "-c", "2048"]  # fmt: skip
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        preexec_fn=lambda: (group / "cgroup.procs").write_text(str(os.getpid())),
    )
    failures = 0
    try:
        for _ in range(600):
            if proc.poll() is not None:
                print(f"the server exited with {proc.returncode}")
                return 1
            try:
                urllib.request.urlopen(f"{base}/v1/models", timeout=1).read()
                break
            except OSError:
                time.sleep(0.5)
        start_peak = int((group / "memory.max_usage_in_bytes").read_text())
        print(f"server up; limit {limit >> 20} MiB, peak so far {start_peak >> 20} MiB")
        for name, body in cases():
            t0 = time.perf_counter()
            code, text = post(base, body, args.timeout)
            dt = time.perf_counter() - t0
            bounded = dt < args.timeout
            ok = bounded and (code == 200 or (isinstance(code, int) and 400 <= code < 500))
            failures += not ok
            print(f"{'ok  ' if ok else 'FAIL'} {name:26s} {code!s:>4} {dt:6.2f}s  {text!r:.90}")
        code, text = post(base, json.dumps(_chat()).encode(), 120)
        alive = code == 200 and proc.poll() is None
        failures += not alive
        print(f"{'ok  ' if alive else 'FAIL'} {'a plain request after':26s} {code!s:>4}")
    finally:
        proc.kill()
        proc.wait()
    peak = int((group / "memory.max_usage_in_bytes").read_text())
    hits = int((group / "memory.failcnt").read_text())
    for _ in range(50):  # the killed server can stay a member for a moment
        try:
            group.rmdir()
            break
        except OSError:
            time.sleep(0.1)
    print(f"cgroup: limit {limit >> 20} MiB, peak {peak >> 20} MiB, limit hits {hits}")
    failures += hits > 0
    print(f"{'all answered' if not failures else f'{failures} failures'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
