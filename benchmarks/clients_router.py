"""A LiteLLM Router in front of two `edgerun serve` processes, one killed mid-run.

The way several edge devices are pooled behind one OpenAI endpoint: the Router spreads
requests over both servers and, when one dies, retries on the other. This starts two
servers on localhost (the same model), sends chat, streamed chat and embedding requests
through `litellm.Router` (unmodified, the OpenAI provider), SIGKILLs one server after a
third of them, and prints how many succeeded and which server answered each.

    pip install litellm
    python benchmarks/clients_router.py -m SmolLM2-135M-Instruct.Q4_1.gguf
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, threads: int) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "edgerun", "serve", "-m", model, "--port", str(port)]
    proc = subprocess.Popen(
        [*cmd, "-t", str(threads), "-c", "1024"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return proc, f"http://127.0.0.1:{port}"


def wait_ready(base: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"the server at {base} exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the server at {base} did not come up in {timeout:.0f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", "--requests", type=int, default=30)
    ap.add_argument("-t", "--threads", type=int, default=1, help="threads per server")
    ap.add_argument("-c", "--clients", type=int, default=3, help="client threads")
    args = ap.parse_args()
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network here
    import litellm

    litellm.suppress_debug_info = True
    servers = [start_server(args.model, args.threads) for _ in range(2)]
    try:
        t0 = time.time()
        for proc, base in servers:
            wait_ready(base, proc)
        print(f"two servers ready in {time.time() - t0:.1f} s: {[b for _, b in servers]}")
        deployment = lambda base: {  # noqa: E731
            "model_name": "edge",
            "litellm_params": {"model": "openai/edge", "api_base": base + "/v1", "api_key": "x"},
        }
        router = litellm.Router(
            model_list=[deployment(b) for _, b in servers],
            routing_strategy="simple-shuffle",
            num_retries=3,
            retry_after=0,
            allowed_fails=1,
            cooldown_time=60,
            timeout=60,
        )
        kill_at = args.requests // 3
        served: Counter[str] = Counter()
        kinds = ("chat", "stream", "embedding")

        def one(i: int) -> bool:
            kind = kinds[i % len(kinds)]
            msgs = [{"role": "user", "content": f"Say a word about the number {i}."}]
            try:
                if kind == "chat":
                    r = router.completion(model="edge", messages=msgs, max_tokens=8)
                    text = r.choices[0].message.content
                elif kind == "stream":
                    s = router.completion(model="edge", messages=msgs, max_tokens=8, stream=True)
                    text = "".join(c.choices[0].delta.content or "" for c in s)
                    r = s
                else:
                    r = router.embedding(model="edge", input=[f"text {i}", "another text"])
                    text = f"{len(r.data)} vectors of {len(r.data[0]['embedding'])}"
            except Exception as e:  # noqa: BLE001 - a failure is what this counts
                print(f"request {i:2d} {kind:9s} FAILED: {type(e).__name__}: {str(e)[:120]}")
                return False
            base = (getattr(r, "_hidden_params", None) or {}).get("api_base") or "?"
            served[str(base)] += 1
            print(f"request {i:2d} {kind:9s} ok  via {base}: {text!r}")
            return True

        t0 = time.time()
        with ThreadPoolExecutor(args.clients) as pool:
            futures = []
            for i in range(args.requests):
                if i == kill_at:
                    victim, vbase = servers[0]
                    os.kill(victim.pid, signal.SIGKILL)
                    victim.wait()
                    busy = sum(not f.done() for f in futures)
                    print(f"request {i}: killed {vbase} ({busy} requests not yet answered)")
                futures.append(pool.submit(one, i))
                time.sleep(0.05)
            results = [f.result() for f in futures]
        ok, failed = sum(results), len(results) - sum(results)
        dt = time.time() - t0
        print(
            f"{ok} of {args.requests} requests succeeded, {failed} failed, in {dt:.1f} s; "
            f"answered by: {dict(served)}"
        )
    finally:
        for proc, _ in servers:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)


if __name__ == "__main__":
    main()
