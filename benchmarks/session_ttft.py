"""Time to first token for a resumed conversation and for a shared system prompt, with and
without the saved KV cache / the prefix cache, on the same loaded model.

- resume: a conversation of about --history tokens (turns cut from the built-in corpus) is
  answered once and saved (Session.save). A follow-up question is then asked (a) on a new
  session holding the same messages but no cache, which recomputes the history, and (b) on
  Session.load of the saved file.
- prefix: a system prompt of about --system tokens (a document); a question is asked by a
  new session (a) with the model's prefix cache cleared and (b) after another session
  computed that system prompt once.

Alternating runs, medians. Usage:
  python benchmarks/session_ttft.py [-m MODEL] [--history 1500] [--system 1000] [-r 3] [-t 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _conversation(model, n_tokens: int) -> list[dict[str, str]]:
    from edgerun.corpus import evaluation_text

    words = evaluation_text().split()
    msgs: list[dict[str, str]] = []
    i = 0
    while len(model.encode_chat(msgs or [{"role": "user", "content": ""}])) < n_tokens:
        role = "user" if len(msgs) % 2 == 0 else "assistant"
        msgs.append({"role": role, "content": " ".join(words[i : i + 60])})
        i += 60
    if msgs[-1]["role"] == "user":
        msgs.pop()
    return msgs


def _ttft(session, question: str) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = session.send(question, stream=True, max_tokens=1, temperature=0.0)
    r.wait()
    return time.perf_counter() - t0, r.stats.cached_tokens


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--history", type=int, default=1500)
    ap.add_argument("--system", type=int, default=1000)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    import edgerun
    from edgerun.corpus import evaluation_text

    model = edgerun.load(args.model, threads=args.threads, n_ctx=4096)
    model.warm_up()
    history = _conversation(model, args.history)
    seed_session = model.session()
    seed_session.messages = list(history[:-1])
    seed_session.send(
        history[-1]["content"] if history[-1]["role"] == "user" else "Go on.",
        max_tokens=8,
        temperature=0.0,
    )
    n_hist = seed_session.cache.length
    tmp = Path(tempfile.mkdtemp())
    saved = seed_session.save(tmp / "chat.safetensors")
    question = "Summarise what we discussed in one sentence."

    words = evaluation_text().split()
    system, k = "", 0
    while len(model.encode_chat([{"role": "system", "content": system}])) < args.system:
        system += " ".join(words[k : k + 50]) + "\n"
        k += 50
    res: dict[str, list[float]] = {
        k: [] for k in ("resume_none", "resume_saved", "prefix_none", "prefix_cached")
    }
    cached: dict[str, int] = {}
    for _ in range(args.repetitions):
        fresh = model.session()
        fresh.messages = list(seed_session.messages)
        t, c = _ttft(fresh, question)
        res["resume_none"].append(t)
        cached["resume_none"] = c
        t, c = _ttft(edgerun.Session.load(model, saved), question)
        res["resume_saved"].append(t)
        cached["resume_saved"] = c
        model.engine.prefix_cache.clear()
        t, c = _ttft(model.session(system=system), question)
        res["prefix_none"].append(t)
        cached["prefix_none"] = c
        t, c = _ttft(model.session(system=system), question)  # the first one stored it
        res["prefix_cached"].append(t)
        cached["prefix_cached"] = c
    med = {k: statistics.median(v) for k, v in res.items()}
    n_sys = len(model.encode_chat([{"role": "system", "content": system}], False))
    print(f"{args.model}, {args.threads} threads, medians of {args.repetitions}")
    print(
        f"resume a {n_hist}-token conversation: TTFT without the saved cache "
        f"{med['resume_none']:.2f} s, with it {med['resume_saved']:.3f} s "
        f"({med['resume_none'] / med['resume_saved']:.1f}x; cached tokens "
        f"{cached['resume_none']} vs {cached['resume_saved']})"
    )
    print(
        f"shared {n_sys}-token system prompt: TTFT without the prefix cache "
        f"{med['prefix_none']:.2f} s, with it {med['prefix_cached']:.3f} s "
        f"({med['prefix_none'] / med['prefix_cached']:.1f}x; cached tokens "
        f"{cached['prefix_none']} vs {cached['prefix_cached']})"
    )
    if args.json:
        out = {
            "model": args.model,
            "threads": args.threads,
            "history_tokens": n_hist,
            "system_tokens": n_sys,
            "median_s": med,
            "runs_s": res,
            "cached_tokens": cached,
        }
        Path(args.json).write_text(json.dumps(out, indent=1))
    model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
