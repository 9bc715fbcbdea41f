"""Decode attention: the split-position kernel (edgerun/ops/attention_decode.py) against
the one-row kernel it replaced for head sizes 64 / 128 / 256 (attention._attention for
one sequence, attention._attention_rows_batch for several), same data, alternating
call by call, medians of many calls. One layer's call, as a decode step makes it once
per layer.

Usage: python benchmarks/decode_attention.py [-s smollm2,qwen0.5b] [-c 100,1000,4000]
                                             [-n 1,4] [--kv f32,f16] [-r 300] [-t 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numba
import numpy as np

from edgerun.ops import attention as A
from edgerun.ops.attention_decode import attend_many, attend_one

# (query heads, KV heads, head size, sliding window) of the registry models' layers
SHAPES = {
    "smollm2": (9, 3, 64, 0),
    "qwen0.5b": (14, 2, 64, 0),
    "qwen1.5b": (12, 2, 128, 0),
    "gemma3-local": (4, 1, 256, 512),
    "gemma3-global": (4, 1, 256, 0),
}


def _case(shape, ctx, n, kv, rng):
    hq, hkv, hd, window = shape
    dt = np.float32 if kv == "f32" else np.uint16
    nctx = ctx + 16
    caches = []
    for _ in range(2 * n):  # [layers=1, hkv, nctx, hd] per sequence, K then V
        a = rng.standard_normal((1, hkv, nctx, hd)).astype(np.float32)
        caches.append(a if dt == np.float32 else a.astype(np.float16).view(np.uint16))
    ks, vs = caches[:n], caches[n:]
    q = rng.standard_normal((n, hq, hd)).astype(np.float32)
    starts = np.array([ctx - 1 - 7 * b for b in range(n)], np.int64)  # unequal lengths
    return ks, vs, q, starts, np.int64(window), np.float32(1.0 / np.sqrt(hd))


def _old(ks, vs, q, starts, window, scale, out, scores, addr):
    n = q.shape[0]
    if n == 1:
        A._attention(q, ks[0][0], vs[0][0], starts[0], window, scale, scores, out)
    else:
        kaddr, vaddr, nctx, like = addr
        A._attention_rows_batch(q, like, kaddr, vaddr, nctx, np.int64(0), starts, window,
                                scale, scores, out)  # fmt: skip


def _new(ks, vs, q, starts, window, scale, out, scores, addr):
    n = q.shape[0]
    if n == 1:
        attend_one(q[0], ks[0][0], vs[0][0], starts[0], window, scale, out[0])
    else:
        kaddr, vaddr, nctx, like = addr
        attend_many(q, like, kaddr, vaddr, nctx, np.int64(0), starts, window, scale, out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-s", "--shapes", default="smollm2,qwen0.5b,qwen1.5b,gemma3-local")
    ap.add_argument("-c", "--contexts", default="100,1000,4000")
    ap.add_argument("-n", "--sequences", default="1,4")
    ap.add_argument("--kv", default="f32,f16")
    ap.add_argument("-r", "--repeats", type=int, default=300)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    numba.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    print(f"threads {args.threads}; us per layer call, medians of {args.repeats} alternating calls")
    for name in args.shapes.split(","):
        shape = SHAPES[name]
        for kv in args.kv.split(","):
            for ctx in (int(c) for c in args.contexts.split(",")):
                for n in (int(x) for x in args.sequences.split(",")):
                    ks, vs, q, starts, window, scale = _case(shape, ctx, n, kv, rng)
                    addr = (
                        np.array([a.ctypes.data for a in ks], np.int64),
                        np.array([a.ctypes.data for a in vs], np.int64),
                        np.array([a.shape[2] for a in ks], np.int64),
                        np.zeros((n, shape[1], shape[2]), ks[0].dtype),
                    )
                    scores = np.empty((n * shape[0], ctx + 16), np.float32)
                    o1, o2 = np.empty_like(q), np.empty_like(q)
                    fns = ((_old, o1), (_new, o2))
                    for fn, o in fns:  # compile, warm
                        fn(ks, vs, q, starts, window, scale, o, scores, addr)
                    times = ([], [])
                    for _ in range(args.repeats):
                        for i, (fn, o) in enumerate(fns):
                            t = time.perf_counter()
                            fn(ks, vs, q, starts, window, scale, o, scores, addr)
                            times[i].append(time.perf_counter() - t)
                    old, new = (statistics.median(t) * 1e6 for t in times)
                    err = float(np.abs(o1 - o2).max())
                    print(
                        f"{name:13s} {kv} ctx {ctx:5d} n={n}: one-row {old:8.1f} us, "
                        f"split {new:8.1f} us, {old / new:5.2f}x  (max |diff| {err:.1e})"
                    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
