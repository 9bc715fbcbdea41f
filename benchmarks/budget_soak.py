"""A long generation and a long chat under --ram-budget, measured from outside the process:
the child runs in a memory cgroup limited to the budget (+5%, as benchmarks/offload.py), as
a board with that much memory would be; it must finish (no OOM kill), and the cgroup's
peak usage (RSS + page cache, which the kernel reclaims at the limit) and its memory.stat
split (anon, shmem = the KV cache, mapped files, unmapped page cache) are reported.

Scenarios (one child each, page cache dropped first):
- generate: one 2,000-token generation (EOS ignored);
- chat: a 20-turn conversation on one Session (each answer up to --turn-tokens);
- prompt: one prompt of --prompt-tokens tokens of evaluation text, then 8 tokens (the
  KV cache fills at once: what dense offloading lent of its reserve is given back).

Needs root (cgroup v1 memory controller, drop_caches). Usage:
  python benchmarks/budget_soak.py [-m smollm2-135m] [--budget 300M] [-t 2] [--json out]
      [--scenarios generate,chat,prompt] [--prompt-tokens 1990]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from offload import _drop_caches, _make_cgroup  # noqa: E402

QUESTIONS = [
    "Tell me about the history of tea.",
    "Why is the sky blue?",
    "Give me a tip for learning Python.",
    "What is a prime number?",
    "Describe a cat in two sentences.",
]


def child(spec: dict) -> None:
    (Path("/sys/fs/cgroup/memory") / spec["cgroup"] / "cgroup.procs").write_text(str(os.getpid()))
    import edgerun
    from edgerun.sampling import SamplingParams

    m = edgerun.load(
        spec["model"],
        ram_budget=spec["budget"],
        threads=spec["threads"],
        n_ctx=spec["ctx"],
        offload_options=spec["options"],
    )
    t0 = time.perf_counter()
    if spec["scenario"] == "generate":
        ids = m.tokenize("Once upon a time, in a small village by the sea,")
        r = m.scheduler.submit(
            ids, SamplingParams(temperature=0.8, seed=1), spec["tokens"], eos_ids=[]
        )
        r.wait()
        tokens = r.stats.generated_tokens
    elif spec["scenario"] == "prompt":
        from edgerun.corpus import evaluation_text

        ids = m.tokenize(evaluation_text())[: spec["prompt_tokens"]]
        r = m.scheduler.submit(ids, SamplingParams(temperature=0.0), 8, eos_ids=[])
        r.wait()
        tokens = r.stats.generated_tokens
    else:
        s = m.session()
        tokens = 0
        for i in range(spec["turns"]):
            if s.cache.room() < spec["turn_tokens"] + 64:
                s.reset()  # a full window starts over, as a chat app's "new chat"
            s.send(
                QUESTIONS[i % len(QUESTIONS)],
                max_tokens=spec["turn_tokens"],
                temperature=0.7,
                seed=i,
            )
            tokens += s.stats.generated_tokens
    dt = time.perf_counter() - t0
    plan = m.plan.mode if m.plan is not None else "resident"
    print("RESULT " + json.dumps({"tokens": tokens, "seconds": dt, "plan": plan}), flush=True)
    m.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--budget", default="300M")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--turns", type=int, default=20)
    ap.add_argument("--turn-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=1990)
    ap.add_argument("--scenarios", default="generate,chat")
    ap.add_argument("--offload-options", default=None, help='JSON, e.g. {"kv_loan_tiers": 8}')
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return 0
    from edgerun.sched.placement import parse_budget

    budget = parse_budget(a.budget)
    rows = []
    for scenario in a.scenarios.split(","):
        name = f"edgerun-soak-{os.getpid()}"
        g = _make_cgroup(name, int(budget * 1.05))
        _drop_caches()
        spec = {
            "model": a.model,
            "budget": a.budget,
            "threads": a.threads,
            "cgroup": name,
            "scenario": scenario,
            "tokens": a.tokens,
            "turns": a.turns,
            "turn_tokens": a.turn_tokens,
            "prompt_tokens": a.prompt_tokens,
            "options": json.loads(a.offload_options) if a.offload_options else None,
            "ctx": 2048 + 64,
        }
        p = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(spec)], capture_output=True, text=True
        )
        res = {"scenario": scenario, "rc": p.returncode, "budget_mb": budget / 1e6}
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                res.update(json.loads(line[7:]))
        if p.returncode:
            res["error"] = (p.stderr.strip().splitlines() or [""])[-1][-300:]
        res["max_usage_mb"] = int((g / "memory.max_usage_in_bytes").read_text()) / 1e6
        res["failcnt"] = int((g / "memory.failcnt").read_text())
        stat = dict(ln.split() for ln in (g / "memory.stat").read_text().splitlines())
        res["end_stat_mb"] = {
            k: int(stat[k]) / 1e6 for k in ("rss", "shmem", "mapped_file", "cache") if k in stat
        }
        g.rmdir()
        res["within_budget"] = p.returncode == 0 and res["max_usage_mb"] <= res["budget_mb"] * 1.05
        rows.append(res)
        print(
            f"{a.model} {scenario:8s} budget {a.budget}: {res.get('tokens', 0)} tokens in "
            f"{res.get('seconds', 0):.0f} s ({res.get('plan', '?')}), cgroup peak "
            f"{res['max_usage_mb']:.0f} MB of {res['budget_mb']:.0f} MB budget "
            f"+5% ({'kept' if res['within_budget'] else 'NOT KEPT'}), failcnt {res['failcnt']}, "
            f"at the end {res['end_stat_mb']}, rc {p.returncode}"
            + (f", {res['error']}" if "error" in res else ""),
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
