"""Decode speed while other processes keep CPUs busy: automatic vs fixed threads.

A laptop or a Pi is rarely idle. Each run is a fresh child process that
generates N tokens (EOS ignored) with either automatic threads (the governor in
runtime/cpu_share.py gives up cores other processes use) or a fixed count, while
K spinner processes each keep one core busy. Runs alternate between the two
settings; the table gives medians.

Usage: python benchmarks/shared_cpu.py [-m MODEL] [-n 128] [-b 0,1] [-t 2] [-r 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SPIN = "while True: pass"


def _child(model: str, threads: int | None, n_gen: int) -> dict:
    import edgerun
    from edgerun.generate.sampling import SamplingParams

    m = edgerun.load(model, threads=threads)
    ids = m.tokenize("Once upon a time, in a small village by the sea,")
    gen = m.generator
    list(gen.stream(ids, SamplingParams(temperature=0.0), max_tokens=4, stop_ids=()))  # warm up
    gen.cache.clear()
    list(gen.stream(ids, SamplingParams(temperature=0.0), max_tokens=n_gen, stop_ids=()))
    return {"tps": gen.stats.generate_tps, "threads": gen.stats.threads}


def _run(model: str, threads: int | None, n_gen: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "-m", model, "-n", str(n_gen)]
    if threads:
        cmd += ["-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-b", "--busy", default="0,1", help="spinner processes, comma list")
    ap.add_argument("-t", "--threads", type=int, default=None, help="fixed count to compare")
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.model, args.threads, args.n_gen)))
        return 0
    from edgerun.runtime.sysinfo import default_threads

    fixed = args.threads or default_threads()
    rows = []
    for busy in [int(b) for b in args.busy.split(",")]:
        spinners = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
        try:
            time.sleep(0.5)
            auto, pinned = [], []
            for _ in range(args.repetitions):
                auto.append(_run(args.model, None, args.n_gen))
                pinned.append(_run(args.model, fixed, args.n_gen))
        finally:
            for p in spinners:
                p.kill()
        a = statistics.median(r["tps"] for r in auto)
        f = statistics.median(r["tps"] for r in pinned)
        rows.append(
            {
                "busy_processes": busy,
                "auto_tps": a,
                "auto_threads": [r["threads"] for r in auto],
                "fixed_threads": fixed,
                "fixed_tps": f,
                "ratio": a / f if f else float("nan"),
            }
        )
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"decode tok/s, {args.n_gen} tokens, median of {args.repetitions} alternating runs")
    print("| busy processes | automatic threads | tok/s | fixed threads | tok/s | auto/fixed |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['busy_processes']} | {','.join(map(str, r['auto_threads']))} | "
            f"{r['auto_tps']:.1f} | {r['fixed_threads']} | {r['fixed_tps']:.1f} | "
            f"{r['ratio']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
