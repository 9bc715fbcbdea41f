"""Decode-step attention of n sequences: one BatchAttention call per layer against one
`attention` call per sequence and layer (the loop forward_batch used before), same data,
alternating, medians. Shapes default to SmolLM2-135M (30 layers, 9 query heads over 3 KV
heads of 64).

Usage: python benchmarks/attention.py [-n 1,4,8] [-c 64,256,1024] [-r 7]
                                      [--layers 30 --heads 9 --kv-heads 3 --head-dim 64]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def _per_sequence(attention, ks, vs, q, kn, start, out):
    for li in range(ks[0].shape[0]):
        for b in range(len(ks)):
            ks[b][li, :, start] = kn[b]
            vs[b][li, :, start] = kn[b]
            out[b] = attention(q[b : b + 1], ks[b][li], vs[b][li], start, 0)[0]


def _batched(batch_attention, ks, vs, q, kn, start, out):
    attend = batch_attention(ks, vs, [start] * len(ks))
    for li in range(ks[0].shape[0]):
        attend(li, q, kn, kn, 0, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--sequences", default="1,4,8")
    ap.add_argument("-c", "--cached", default="64,256,1024")
    ap.add_argument("-r", "--repetitions", type=int, default=7)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    args = ap.parse_args(argv)
    from edgerun.ops.attention import BatchAttention, attention

    rng = np.random.default_rng(0)
    L, hq, hkv, hd = args.layers, args.heads, args.kv_heads, args.head_dim
    print("| sequences | cached | per-sequence ms/step | batched ms/step | batched / per-seq |")
    print("|---|---|---|---|---|")
    for ctx in (int(c) for c in args.cached.split(",")):
        for n in (int(x) for x in args.sequences.split(",")):
            shape = (L, hkv, ctx + 1, hd)
            ks = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
            vs = [rng.standard_normal(shape).astype(np.float32) for _ in range(n)]
            q = rng.standard_normal((n, hq, hd)).astype(np.float32)
            kn = rng.standard_normal((n, hkv, hd)).astype(np.float32)
            out = np.empty((n, hq * hd), np.float32)
            runs = {"per": [], "batch": []}
            for rep in range(args.repetitions + 1):  # the first pair compiles, dropped
                for key, fn, impl in (
                    ("per", _per_sequence, attention),
                    ("batch", _batched, BatchAttention),
                ):
                    t0 = time.perf_counter()
                    fn(impl, ks, vs, q, kn, ctx, out)
                    if rep:
                        runs[key].append((time.perf_counter() - t0) * 1e3)
            per, bat = (statistics.median(runs[k]) for k in ("per", "batch"))
            print(f"| {n} | {ctx} | {per:.2f} | {bat:.2f} | {bat / per:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
