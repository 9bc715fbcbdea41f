"""Decode attention alone (attention_decode.attend_one) at a long context, per KV cache type.

Random normal keys and values in f16, q8_0 and q4_0 caches of a model's attention shape;
one query token at the last position. Prints each type's largest difference from the
float64 reference on the same stored values, then CPU microseconds a call (medians over
rounds, the types alternating within each) and f16's time over each type's: the part of a
decode step the cache type changes, without the projections that dilute it.

Usage: PYTHONPATH=. python benchmarks/kv_decode_attention.py [--ctx 4096] [--reps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np

from edgerun.ops import attention_decode as D
from edgerun.ops.attention import attention_reference, cache_floats, cache_values

TYPES = {"f16": np.uint16, "q8_0": np.int8, "q4_0": np.uint8}
SHAPES = {  # query heads, KV heads, head_dim
    "gemma-3-270m": (4, 1, 256),
    "qwen2.5-coder-1.5b": (12, 2, 128),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=30, help="calls a timed run")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    ctx = args.ctx
    for name in args.shapes:
        hq, hkv, hd = SHAPES[name]
        scale = 1 / np.sqrt(hd)
        caches = {}
        for t, dtype in TYPES.items():
            x = rng.standard_normal((2, hkv, ctx, hd)).astype(np.float32)
            caches[t] = (cache_values(x[0], dtype), cache_values(x[1], dtype))
        q = rng.standard_normal((hq, hd)).astype(np.float32)
        out = np.empty((hq, hd), np.float32)
        for t, (k, v) in caches.items():
            D.attend_one(q, k, v, ctx - 1, 0, scale, out)
            ref = attention_reference(q[None], cache_floats(k, hd), cache_floats(v, hd), ctx - 1)
            err = float(np.abs(out - ref.reshape(hq, hd)).max())
            print(f"{name} {t}: max |out - reference| {err:.2e}", flush=True)
        us: dict[str, list[float]] = {t: [] for t in TYPES}
        for r in range(args.rounds):
            for t in list(TYPES) if r % 2 else list(TYPES)[::-1]:
                k, v = caches[t]
                c0 = time.process_time()
                for _ in range(args.reps):
                    D.attend_one(q, k, v, ctx - 1, 0, scale, out)
                us[t].append((time.process_time() - c0) / args.reps * 1e6)
        f16 = statistics.median(us["f16"])
        cells = [f"{t} {statistics.median(u):.0f} us ({f16 / statistics.median(u):.2f}x)"
                 for t, u in us.items()]  # fmt: skip
        print(f"{name} at {ctx}: " + ", ".join(cells) + f"; load {os.getloadavg()[0]:.1f}",
              flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
