"""A long generation and a long chat under --ram-budget, measured from outside the process:
the child runs in a memory cgroup limited to the budget (+5%, as benchmarks/offload.py), as
a board with that much memory would be; it must finish (no OOM kill), and the cgroup's
peak usage (RSS + page cache, which the kernel reclaims at the limit) and its memory.stat
split (anon, shmem = the KV cache, mapped files, unmapped page cache) are reported.

Scenarios (one child each, page cache dropped first):
- generate: one 2,000-token generation (EOS ignored);
- chat: a 20-turn conversation on one Session (each answer up to --turn-tokens);
- prompt: one prompt of --prompt-tokens tokens of evaluation text, then 8 tokens (the
  KV cache fills at once: what dense offloading lent of its reserve is given back);
- sessions: --sessions sessions each read a different --session-tokens-token document
  and answer, then each asks one more question (idle caches past the KV window are
  moved to disk and read back, serving/kv_spill.py; --no-spill keeps them in memory).

Needs root (cgroup v1 memory controller, drop_caches). Usage:
  python benchmarks/budget_soak.py [-m smollm2-135m] [--budget 300M] [-t 2] [--json out]
      [--scenarios generate,chat,prompt,sessions] [--prompt-tokens 1990] [--no-limit]
      [--sessions 8] [--session-tokens 800] [--no-spill]
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
    from edgerun.generate.sampling import SamplingParams

    m = edgerun.load(
        spec["model"],
        ram_budget=spec["budget"],
        threads=spec["threads"],
        n_ctx=spec["ctx"],
        offload_options=spec["options"],
    )
    g = Path("/sys/fs/cgroup/memory") / spec["cgroup"]
    peaks = {"load": int((g / "memory.max_usage_in_bytes").read_text()) / 1e6}
    m.warm_up()
    peaks["warm-up"] = int((g / "memory.max_usage_in_bytes").read_text()) / 1e6
    (g / "memory.max_usage_in_bytes").write_text("0")  # the scenario's own peak from here
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

        # a prefix of the text: tokenizing all 465k characters left ~16 MiB of the
        # tokenizer's fragments in the heap, the harness's memory, not the prompt's
        ids = m.tokenize(evaluation_text()[: 8 * spec["prompt_tokens"]])[: spec["prompt_tokens"]]
        assert len(ids) == spec["prompt_tokens"], len(ids)
        r = m.scheduler.submit(ids, SamplingParams(temperature=0.0), 8, eos_ids=[])
        r.wait()
        tokens = r.stats.generated_tokens
    elif spec["scenario"] == "sessions":
        tokens = _sessions(m, spec, out_extra := {})
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
    # the peak before fincore runs (its file walk charges the cgroup kernel memory)
    peaks[spec["scenario"]] = int((g / "memory.max_usage_in_bytes").read_text()) / 1e6
    stat = dict(ln.split() for ln in (g / "memory.stat").read_text().splitlines())
    out = {"tokens": tokens, "seconds": dt, "plan": plan, "peak_mb": max(peaks.values())}
    if spec["scenario"] == "sessions":
        out.update(out_extra)
    out["peaks_mb"] = peaks
    out["stat_mb"] = {k: int(stat[k]) / 1e6 for k in ("rss", "shmem", "mapped_file", "cache")}
    out["cached_mb"] = _cached_files_mb()
    print("RESULT " + json.dumps(out), flush=True)
    m.close()


def _sessions(m, spec: dict, out: dict) -> int:
    """Many conversations on one model, each idle while the others run: every session
    reads its own document, then each asks a follow-up (its cache read back from disk if
    it was moved there). Fills `out` with the follow-ups' TTFT and the spill counts."""
    import statistics

    from edgerun.corpus import evaluation_text

    if not spec["spill"]:
        m.scheduler.spill_dir = None
    text = evaluation_text()
    n = spec["session_tokens"]
    sessions, tokens = [], 0
    for i in range(spec["sessions"]):
        ids = m.tokenize(text[i * 8 * n : (i + 1) * 8 * n])[:n]
        s = m.session()
        s.send("Summarize this:\n" + m.detokenize(ids), max_tokens=8, temperature=0.0)
        tokens += s.stats.generated_tokens
        sessions.append(s)
    ttft, cached = [], []
    for s in sessions:
        s.send("Who is speaking?", max_tokens=8, temperature=0.0)
        tokens += s.stats.generated_tokens
        ttft.append(s.stats.ttft_seconds)
        cached.append(s.stats.cached_tokens)
    c = m.scheduler.counters
    out.update(
        follow_up_ttft_s=round(statistics.median(ttft), 3),
        follow_up_ttft_max_s=round(max(ttft), 3),
        follow_up_cached_tokens=min(cached),
        kv_spills=c.kv_spills,
        kv_restores=c.kv_restores,
        kv_window_tokens=m.engine.kv_budget_tokens,
    )
    return tokens


def _cached_files_mb() -> dict[str, float]:
    """MB of page cache held by the files the process reads besides its mappings: Numba's
    kernel cache, the registry's model files (mapped: counted as mapped_file too), the
    offload data (bundles, profiles) and Python's modules, read with fincore (util-linux)
    where it is installed."""
    import shutil

    import numba

    from edgerun.registry import cache_dir

    if not shutil.which("fincore"):
        return {}
    out: dict = {}
    top: list[tuple[int, str]] = []
    for name, root in (
        ("numba cache", numba.config.CACHE_DIR),
        ("model files", str(cache_dir() / "models")),
        ("offload data", str(cache_dir() / "offload")),
        ("python", os.path.dirname(os.__file__)),
    ):
        files = [str(f) for f in Path(root).rglob("*") if f.is_file()] if root else []
        total = 0
        for i in range(0, len(files), 500):
            p = subprocess.run(
                ["fincore", "-b", "-n", "-o", "RES,FILE", *files[i : i + 500]],
                capture_output=True,
                text=True,
            )
            for line in p.stdout.splitlines():
                res, _, path = line.strip().partition(" ")
                if res.isdigit() and int(res):
                    total += int(res)
                    top.append((int(res), path.strip()))
        out[name] = round(total / 1e6, 1)
    top.sort(reverse=True)
    out["largest"] = [f"{path} {res / 1e6:.1f}" for res, path in top[:12]]
    return out


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
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--session-tokens", type=int, default=800)
    ap.add_argument("--no-spill", action="store_true", help="keep idle KV caches in memory")
    ap.add_argument("--offload-options", default=None, help='JSON, e.g. {"kv_loan_tiers": 8}')
    ap.add_argument(
        "--no-limit", action="store_true", help="no cgroup limit: trace the natural peak"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(json.loads(a.child))
        return 0
    from edgerun.offload.plan import parse_budget

    budget = parse_budget(a.budget)
    rows = []
    for scenario in a.scenarios.split(","):
        name = f"edgerun-soak-{os.getpid()}"
        # --no-limit: the process's own peak (a limited cgroup reclaims at the limit)
        g = _make_cgroup(name, (1 << 62) if a.no_limit else int(budget * 1.05))
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
            "sessions": a.sessions,
            "session_tokens": a.session_tokens,
            "spill": not a.no_spill,
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
        res["max_usage_mb"] = res.get(
            "peak_mb", int((g / "memory.max_usage_in_bytes").read_text()) / 1e6
        )
        res["failcnt"] = int((g / "memory.failcnt").read_text())
        stat = dict(ln.split() for ln in (g / "memory.stat").read_text().splitlines())
        res["end_stat_mb"] = {
            k: int(stat[k]) / 1e6 for k in ("rss", "shmem", "mapped_file", "cache") if k in stat
        }
        g.rmdir()
        # without a limit the peak must stay within the budget itself
        allowed = res["budget_mb"] * (1.0 if a.no_limit else 1.05)
        res["within_budget"] = p.returncode == 0 and res["max_usage_mb"] <= allowed
        rows.append(res)
        print(
            f"{a.model} {scenario:8s} budget {a.budget}: {res.get('tokens', 0)} tokens in "
            f"{res.get('seconds', 0):.0f} s ({res.get('plan', '?')}), cgroup peak "
            f"{res['max_usage_mb']:.0f} MB of {res['budget_mb']:.0f} MB budget"
            f"{' (no limit)' if a.no_limit else ' +5%'} "
            f"({'kept' if res['within_budget'] else 'NOT KEPT'}), peaks {res.get('peaks_mb')}, "
            f"failcnt {res['failcnt']}, "
            f"at the end {res.get('stat_mb')}, page cache {res.get('cached_mb')}, "
            + (
                f"follow-ups: TTFT median {res.get('follow_up_ttft_s')} s, max "
                f"{res.get('follow_up_ttft_max_s')} s, cached >= "
                f"{res.get('follow_up_cached_tokens')} tokens, spills {res.get('kv_spills')}, "
                f"restores {res.get('kv_restores')}, "
                if scenario == "sessions"
                else ""
            )
            + f"rc {p.returncode}"
            + (f", {res['error']}" if "error" in res else ""),
            flush=True,
        )
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
