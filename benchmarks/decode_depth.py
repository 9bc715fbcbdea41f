"""Decode speed deep into a context: ms a token of the bound decode step after --depth
tokens are already cached. Run it once per version to compare (alternate the runs: the
machine is noisy); one line per run.

Usage: python benchmarks/decode_depth.py [-m MODEL] [--depth 1792] [--kv f32|f16]
                                         [-t 2] [-n 48] [-r 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="smollm2-135m")
    ap.add_argument("--depth", type=int, default=1792)
    ap.add_argument("--kv", choices=("f32", "f16"), default="f32")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=48, help="decode steps a run")
    ap.add_argument("-r", "--runs", type=int, default=3)
    args = ap.parse_args(argv)

    import edgerun
    from edgerun.compute_thread import compute_thread
    from edgerun.kvcache import KVCache

    n_ctx = args.depth + args.tokens + 8
    model = edgerun.load(args.model, threads=args.threads, kv_type=args.kv, n_ctx=n_ctx)
    model.warm_up()
    tr = model.transformer

    def run() -> list[float]:
        ids = [int(x) for x in np.random.default_rng(0).integers(200, 20000, args.depth)]
        cache = KVCache(tr.spec, n_ctx, model.kv_type)
        for i in range(0, args.depth, 256):
            tr.forward(ids[i : i + 256], cache)
        times = []
        for _ in range(args.runs):
            cache.truncate(args.depth)
            t0 = time.perf_counter()
            for i in range(args.tokens):
                tr._forward([100 + i], cache, False)
            times.append((time.perf_counter() - t0) / args.tokens * 1e3)
        return times

    times = compute_thread().call(run)
    print(
        f"{args.model} depth {args.depth} kv {args.kv} t={args.threads}: ms/token "
        f"{statistics.median(times):.2f}  ({' '.join(f'{x:.2f}' for x in times)})"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
