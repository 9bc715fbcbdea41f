"""Concurrent sessions: batched decoding (one weight read per step for all sequences)
against running the same requests one after another, on the same loaded model.

For N in --sessions: N requests with different prompts, each generating exactly -n tokens
(EOS ignored), submitted at once to the model's BatchScheduler; then the same N requests
sequentially. Reports aggregate tok/s (all tokens / wall time), aggregate decode tok/s
(tokens / time the scheduler spent in decode steps, prefill chunks excluded), per-session
decode tok/s and TTFT (mean, p95). Each repetition runs every N (batched, then sequential);
medians over repetitions, and "x one" is the median of each repetition's N vs N=1 ratio.

With --ram-budget the model is loaded under that budget (offloaded when it does not fit):
concurrent requests then share one KV window and, dense-offloaded, each step's streamed
weight reads; run it inside a memory cgroup to prove the budget from outside.

With --history T each request starts with T tokens of its own stretch of a document (a
long chat's context): every decode step then attends over T+ positions per session.

Usage: python benchmarks/concurrency.py [-m MODEL ...] [-s 1,2,4,8] [-n 64] [-r 3] [-t 2]
                                        [--ram-budget 800M] [-c 512] [--history T] [--kv-type f16]
                                        [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash map works, step by step.",
    "List ten things to pack for a camping trip and say why.",
    "Describe the water cycle to a ten year old.",
    "What are the pros and cons of electric cars?",
    "Write a poem about the sea at night.",
    "How do vaccines train the immune system?",
    "Give me a recipe for a simple tomato soup.",
]


def _history(model, i: int, tokens: int) -> list[int]:
    """About `tokens` tokens of the built-in evaluation text, a different stretch for
    each session i (no shared prefix: each session's attention reads its own context)."""
    from edgerun.corpus import evaluation_text

    ids = model.tokenize(evaluation_text(), add_bos=False)
    start = (i * tokens) % max(1, len(ids) - tokens)
    return ids[start : start + tokens]


def _run(model, n_sessions: int, n_gen: int, concurrent: bool, history: int = 0) -> dict:
    from edgerun.generate.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, repeat_penalty=1.0)
    ids = []
    for i in range(n_sessions):
        text = PROMPTS[i % len(PROMPTS)]
        if history:
            text = model.detokenize(_history(model, i, history)) + "\n\n" + text
        ids.append(model.encode_chat([{"role": "user", "content": text}]))
    sched = model.scheduler
    c0 = dataclasses.replace(sched.counters)
    t0 = time.perf_counter()
    reqs = []
    if concurrent:
        reqs = [sched.submit(x, params, n_gen, eos_ids=[]) for x in ids]
        for r in reqs:
            r.wait()
    else:
        for x in ids:
            r = sched.submit(x, params, n_gen, eos_ids=[])
            r.wait()
            reqs.append(r)
    wall = time.perf_counter() - t0
    gen = sum(r.stats.generated_tokens for r in reqs)
    c1 = sched.counters
    decode_span = c1.decode_seconds - c0.decode_seconds  # time in decode steps only
    ttft = sorted(r.stats.ttft_seconds for r in reqs)
    p95 = ttft[min(len(ttft) - 1, int(round(0.95 * (len(ttft) - 1))))]
    return {
        "aggregate_tps": gen / wall,
        "aggregate_decode_tps": gen / decode_span,
        "per_session_tps": statistics.mean(r.stats.generate_tps for r in reqs),
        "ttft_mean_s": statistics.mean(ttft),
        "ttft_p95_s": p95,
        "mean_batch": statistics.mean(b for r in reqs for b in r.stats.batch_sizes),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", action="append", default=None)
    ap.add_argument("-s", "--sessions", default="1,2,4,8")
    ap.add_argument("-n", "--n-gen", type=int, default=64)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--ram-budget", default=None, help="load under this budget (e.g. 800M)")
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("--kv-type", default=None, help="f32 or f16 (default: the model's)")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--history", type=int, default=0, help="tokens of a different document before each prompt"
    )
    ap.add_argument(
        "--interleave",
        choices=("default", "on", "off", "both"),
        default="default",
        help="the interleaved decode copies (load(interleave=...)); both: one model each, "
        "alternating per repetition",
    )
    args = ap.parse_args(argv)
    import edgerun

    layouts = {"default": [None], "on": [True], "off": [False], "both": [False, True]}
    rows = []
    for name in args.model or ["smollm2-135m", "qwen2.5-coder-0.5b"]:
        models = {}
        for il in layouts[args.interleave]:
            kw = {} if il is None else {"interleave": il}
            model = edgerun.load(
                name,
                threads=args.threads,
                n_ctx=args.ctx,
                ram_budget=args.ram_budget,
                kv_type=args.kv_type,
                **kw,
            )
            if model.plan is not None:
                print(f"{name}: {model.plan.mode} plan under {args.ram_budget}", flush=True)
            model.warm_up()
            _run(model, 2, 4, True)  # scheduler thread up, kernels hot
            label = name if il is None else f"{name}{' [interleaved]' if il else ' [rows]'}"
            models[label] = model
        sizes = [int(x) for x in args.sessions.split(",")]
        runs = {(label, n): {"batched": [], "sequential": []} for label in models for n in sizes}
        # Repetitions outermost, every N inside each: on a shared (noisy) machine a slow
        # spell then hits all N alike, and "x one" is the median of per-repetition ratios
        for _ in range(args.repetitions):
            for label, model in models.items():
                for n in sizes:
                    r = runs[label, n]
                    r["batched"].append(_run(model, n, args.n_gen, True, args.history))
                    r["sequential"].append(_run(model, n, args.n_gen, False, args.history))
        for label in models:
            _report(label, sizes, runs, rows)
        for model in models.values():
            model.close()
    if args.json:
        with open(args.json, "w") as f:
            out = {"threads": args.threads, "n_gen": args.n_gen, "ctx": args.ctx, "rows": rows}
            out["history"] = args.history
            json.dump({**out, "ram_budget": args.ram_budget}, f, indent=1)
    return 0


def _report(name: str, sizes: list[int], all_runs: dict, rows: list) -> None:
    """Print (and append to rows) one model's medians per session count."""
    runs = {n: all_runs[name, n] for n in sizes}
    one = runs.get(1, {}).get("batched")
    for n in sizes:
        med = {
            mode: {k: statistics.median(x[k] for x in rs) for k in rs[0]}
            for mode, rs in runs[n].items()
        }
        row = {"model": name, "sessions": n, **{m: v for m, v in med.items()}}
        row["decode_vs_one"] = (
            statistics.median(
                b["aggregate_decode_tps"] / a["aggregate_decode_tps"]
                for a, b in zip(one, runs[n]["batched"])
            )
            if one
            else None
        )
        seq_tps = med["sequential"]["aggregate_tps"]
        row["vs_sequential"] = med["batched"]["aggregate_tps"] / seq_tps
        rows.append(row)
        b, s = med["batched"], med["sequential"]
        vs_one = f"{row['decode_vs_one']:.2f}x one" if one else "no N=1 run"
        print(
            f"{name:20s} N={n}  batched: agg {b['aggregate_tps']:6.1f} tok/s, decode "
            f"{b['aggregate_decode_tps']:6.1f} ({vs_one}), per-session "
            f"{b['per_session_tps']:5.1f}, TTFT mean {b['ttft_mean_s']:.2f} s p95 "
            f"{b['ttft_p95_s']:.2f} s | sequential: agg {s['aggregate_tps']:6.1f}, TTFT mean "
            f"{s['ttft_mean_s']:.2f} s p95 {s['ttft_p95_s']:.2f} s | batched/sequential "
            f"{row['vs_sequential']:.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    sys.exit(main())
