"""A long context's KV cache in a memory limit: the 1.5B at 32k positions, per KV type.

Fills a cache of `--ctx` positions (random rows in the cache's type, as a long chat's
would be: every page written) and decodes `-n` tokens after them, printing the
process's peak RSS and the decode speed. Run it once per type inside a memory cgroup
(benchmarks/README.md: the recipe) to see which types fit: at 32,768 positions the
1.5B's f16 rows take 896 MiB, q8_0's 476 MiB, q4_0's 252 MiB.

Usage: PYTHONPATH=. python benchmarks/kv_long_context.py --kv q8_0 [-m PATH] [--ctx 32768]
"""

from __future__ import annotations

import argparse
import resource
import time
from pathlib import Path

import numpy as np

import edgerun

MODEL = Path.home() / ".cache/edgerun/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=str(MODEL))
    ap.add_argument("--kv", default="q8_0")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("-n", type=int, default=8, help="decode tokens after the filled context")
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args()
    model = edgerun.load(args.model, n_ctx=args.ctx, threads=args.threads, kv_type=args.kv)
    try:
        spec, tr = model.spec, model.transformer
        depth = args.ctx - args.n
        cache = tr.new_cache(args.ctx, args.kv)
        rng = np.random.default_rng(0)
        t0 = time.perf_counter()
        for layer in range(len(spec.attention_layers)):
            for p in range(0, depth, 1024):
                m = min(1024, depth - p)
                k, v = rng.standard_normal((2, m, spec.n_kv_heads, spec.head_dim), np.float32)
                cache.store(layer, p, k, v)
        cache.tokens[:] = rng.integers(0, spec.vocab_size, depth).tolist()
        fill = time.perf_counter() - t0
        tok, t0 = 1, time.perf_counter()
        for _ in range(args.n):
            tok = int(np.argmax(tr.forward([tok], cache)))
        dt = time.perf_counter() - t0
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{Path(args.model).name} kv {args.kv}: {depth} positions filled in {fill:.0f} s "
              f"(KV {cache.resident_bytes / 2**20:.0f} MiB resident), {args.n} tokens decoded "
              f"at {args.n / dt:.2f} tok/s; peak RSS {peak:.0f} MiB", flush=True)  # fmt: skip
    finally:
        model.close()


if __name__ == "__main__":
    main()
