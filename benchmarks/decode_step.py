"""The bound decode step (edgerun/model/decode_step.py) against the general forward loop, in
one process, alternating, so a noisy host moves both alike.

For each row count n (1: `forward` of one token; n >= 2: `forward_batch`, as the
scheduler steps n sessions), each round times `--steps` decode steps through the loop
and then through the bound step, from the same cache contents; prints the median ms a
step, the speedup and the aggregate tok/s, and n-vs-1 aggregate ratios of both.

Usage: python benchmarks/decode_step.py [-m smollm2-135m] [-t 2] [--rows 1 2 4] [-r 6]
"""

from __future__ import annotations

import argparse
import statistics
import time

import edgerun
from edgerun.model.kvcache import KVCache
from edgerun.runtime.compute_thread import compute_thread


def _timed(tr, caches: list[KVCache], bound: bool, args) -> float:
    """ms a step over args.steps decode steps of len(caches) sequences from the same
    cache contents, through the bound step or the general loop."""
    n = len(caches)
    for c in caches:
        c.truncate(args.context)
    if bound:
        tr._decode_step = None  # rebuilt on the next step
    else:
        tr._decode_step, tr._decode_key = False, tr._executors()
    t0 = time.perf_counter()
    for i in range(args.steps):
        ids = [3 + i] * n
        if n == 1:
            tr._forward(ids, caches[0], False)
        else:
            tr._forward_batch(ids, caches)
    return (time.perf_counter() - t0) / args.steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("-r", "--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--context", type=int, default=99, help="tokens in each cache first")
    args = ap.parse_args()
    model = edgerun.load(args.model, threads=args.threads)
    model.warm_up()
    tr = model.transformer
    medians: dict[int, tuple[float, float]] = {}
    for n in args.rows:
        caches = [KVCache(tr.spec, args.context + args.steps + 8) for _ in range(n)]
        for c in caches:
            tr.forward(list(range(1, args.context + 1)), c)

        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(args.rounds):
            for bound in (False, True):
                times[bound].append(compute_thread().call(_timed, tr, caches, bound, args))
        loop, bound = statistics.median(times[False]), statistics.median(times[True])
        medians[n] = (loop, bound)
        print(
            f"{args.model} t={args.threads} n={n}: loop {loop:.2f} ms/step, bound {bound:.2f} "
            f"({loop / bound:.2f}x); aggregate {n * 1e3 / loop:.1f} -> {n * 1e3 / bound:.1f} tok/s",
            flush=True,
        )
    tr._decode_step = None
    if 1 in medians:
        for n, (loop, bound) in medians.items():
            if n > 1:
                one_loop, one_bound = medians[1]
                print(
                    f"  n={n} vs n=1 aggregate: loop {n * one_loop / loop:.2f}x, "
                    f"bound {n * one_bound / bound:.2f}x"
                )


if __name__ == "__main__":
    main()
