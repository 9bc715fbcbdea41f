"""`instructor` extracting pydantic models through `edgerun serve`, unmodified.

instructor pins its own `openai` version, so it runs from its own virtual environment;
this script runs there and starts the server with the Python that has edgerun:

    python -m venv /tmp/venv-instructor && /tmp/venv-instructor/bin/pip install instructor
    /tmp/venv-instructor/bin/python benchmarks/clients_instructor.py \\
        --server-python "$(which python)" -m qwen2.5-coder-0.5b-instruct.gguf

Each case extracts a pydantic model from a sentence with instructor's JSON_SCHEMA mode
(`response_format` json_schema: the server's constrained decoding) and TOOLS mode (a
forced named tool call), greedy, and counts the answers that validate (instructor
raises when one does not, after its retries, which are off here so a miss counts).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time
import urllib.request
from enum import Enum

import instructor
import openai
from pydantic import BaseModel, Field


class User(BaseModel):
    name: str
    age: int


class Priority(str, Enum):
    low = "low"
    medium = "medium"
    high = "high"


class Task(BaseModel):
    title: str
    priority: Priority
    tags: list[str] = Field(max_length=4)


class Address(BaseModel):
    city: str
    country: str


class Company(BaseModel):
    name: str
    founded: int
    headquarters: Address
    products: list[str]


CASES = [
    (User, "Jason is 25 years old."),
    (User, "The new intern, Maria Lopez, turned thirty-one last week."),
    (Task, "Urgent: fix the login bug on the checkout page (backend, security)."),
    (Task, "Sometime, maybe, tidy up the README wording."),
    (Company, "Acme Corp was founded in 1947 in Paris, France and makes anvils and rockets."),
    (Company, "Globex, based in Springfield, USA since 1989, sells widgets."),
]
MODES = ("JSON_SCHEMA", "TOOLS")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(python: str, model: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [python, "-m", "edgerun", "serve", "-m", model, "--port", str(port), "-c", "2048"]
    proc = subprocess.Popen(
        [*cmd, "-t", str(threads)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            urllib.request.urlopen(f"{base}/v1/models", timeout=1).read()
            return proc, base
        except OSError:
            if proc.poll() is not None:
                sys.exit(f"the server exited with {proc.returncode}")
            time.sleep(0.5)
    proc.kill()
    sys.exit("the server did not start in 300 s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--server-python", default="python3", help="a Python with edgerun")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    print(f"instructor {instructor.__version__}, openai {openai.__version__}")
    proc, base = start_server(args.server_python, args.model, args.threads)
    ok = total = 0
    try:
        raw = openai.OpenAI(base_url=f"{base}/v1", api_key="none")
        for mode in MODES:
            client = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
            for model_cls, text in CASES:
                total += 1
                t = time.perf_counter()
                try:
                    got = client.chat.completions.create(
                        model="edgerun",
                        response_model=model_cls,
                        max_retries=0,
                        temperature=0,
                        max_tokens=200,
                        messages=[
                            {"role": "system", "content": "Extract the data as asked."},
                            {"role": "user", "content": text},
                        ],
                    )
                    ok += 1
                    verdict = f"ok   {got.model_dump_json()}"
                except Exception as e:  # noqa: BLE001 - a miss is counted and shown
                    verdict = f"MISS {type(e).__name__}: {str(e)[:160]}"
                dt = time.perf_counter() - t
                print(f"{mode:11s} {model_cls.__name__:8s} {dt:5.1f}s {verdict}")
    finally:
        proc.kill()
        proc.wait()
    print(f"{ok}/{total} extractions validated")
    sys.exit(0 if ok == total else 1)


if __name__ == "__main__":
    main()
