"""What a speculative verification pass costs: the target's batched decode step with m
rows against one row (issue 53 item 5), the whole model as it decodes.

Each row is one sequence's decode token after a 64-token prompt (forward for one row,
forward_batch over m caches for more: the rows a verification pass of m - 1 drafted
tokens runs); the row counts alternate within each round, medians over the rounds.

Usage: PYTHONPATH=. python benchmarks/verify_rows.py [-m PATH] [--rows 1 2 4 8 16]
       [--rounds 6] [--steps 4] [--threads 2] [--cpu-time]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import edgerun
from edgerun.model.kvcache import KVCache
from edgerun.runtime.cpu_share import set_threads

TARGET = Path.home() / ".cache/edgerun/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", type=Path, default=TARGET)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--cpu-time",
        action="store_true",
        help="time CPU seconds, not wall (1 thread, on a host shared with other work)",
    )
    args = ap.parse_args()
    clock = time.process_time if args.cpu_time else time.perf_counter
    set_threads(args.threads)
    m = edgerun.load(str(args.model), threads=args.threads, n_ctx=256)
    tr = m.transformer
    prompt = list(range(1000, 1064))
    caches = []
    for _ in range(max(args.rows)):
        c = KVCache(m.spec, len(prompt) + args.steps + 1, m.kv_type)
        tr.forward(prompt, c)
        caches.append(c)
    res: dict[int, list[float]] = {}
    for r in range(args.rounds + 1):  # round 0 warms up
        for n in args.rows:
            for c in caches[:n]:
                c.truncate(len(prompt))
            set_threads(args.threads)
            t0 = clock()
            for _ in range(args.steps):
                if n == 1:
                    tr.forward([42], caches[0])
                else:
                    tr.forward_batch([42] * n, caches[:n])
            if r:
                res.setdefault(n, []).append((clock() - t0) * 1e3 / args.steps)
    unit = "CPU" if args.cpu_time else "wall"
    print(f"{args.model.name}, {args.threads} threads, {unit} ms, medians of {args.rounds} rounds")
    one = statistics.median(res[args.rows[0]])
    for n, v in res.items():
        md = statistics.median(v)
        print(
            f"rows {n:2d}: {md:7.1f} ms/step ({min(v):.1f}..{max(v):.1f})  "
            f"{md / one:5.2f}x one row  {md / n / one:5.2f} per row"
        )


if __name__ == "__main__":
    main()
