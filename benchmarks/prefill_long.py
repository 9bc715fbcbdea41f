"""Long-prompt prefill: the tiled prefill attention (attention_tiled) against the one-row
kernel, whole forward passes on a real model, alternating in one process, medians.

A prompt of --tokens tokens (the built-in evaluation text) is prefilled in the engine's
chunks (PREFILL_CHUNK) into a fresh KV cache, as `generate` does. Each run reports
prompt tok/s and the share of the time spent in attention (timed around every call).

Usage: python benchmarks/prefill_long.py [-m MODEL] [--tokens 1536] [-r 3] [-t 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def _prefill(model, ids, chunk) -> float:
    from edgerun.kvcache import KVCache

    cache = KVCache(model.spec, len(ids) + 8, model.kv_type)
    t0 = time.perf_counter()
    for i in range(0, len(ids), chunk):
        model.transformer.forward(ids[i : i + chunk], cache)
    return time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", action="append", default=None)
    ap.add_argument("--tokens", type=int, default=1536)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    args = ap.parse_args(argv)
    import edgerun
    from edgerun import model as model_mod
    from edgerun.corpus import evaluation_text
    from edgerun.engine import PREFILL_CHUNK
    from edgerun.ops import attention_tiled

    supports = attention_tiled.supports
    spent = [0.0]
    plain = model_mod.attention

    def timed(*a, **kw):
        t = time.perf_counter()
        try:
            return plain(*a, **kw)
        finally:
            spent[0] += time.perf_counter() - t

    model_mod.attention = timed
    print("| model | tokens | one-row tok/s | tiled tok/s | tiled / one-row | attention share |")
    print("|---|---|---|---|---|---|")
    for name in args.model or ["qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"]:
        model = edgerun.load(name, threads=args.threads, n_ctx=args.tokens + 64)
        model.warm_up()
        ids = model.tokenizer.encode(evaluation_text())[: args.tokens]
        runs = {"one-row": [], "tiled": []}
        for rep in range(args.repetitions + 1):  # the first round compiles, dropped
            for mode in runs:
                attention_tiled.supports = supports if mode == "tiled" else (lambda n, hd: False)
                spent[0] = 0.0
                dt = _prefill(model, ids, PREFILL_CHUNK)
                if rep:
                    runs[mode].append((len(ids) / dt, spent[0] / dt))
        attention_tiled.supports = supports
        one = statistics.median(r[0] for r in runs["one-row"])
        tiled = statistics.median(r[0] for r in runs["tiled"])
        ratio = statistics.median(b[0] / a[0] for a, b in zip(runs["one-row"], runs["tiled"]))
        share = {m: statistics.median(r[1] for r in rs) for m, rs in runs.items()}
        print(
            f"| {name} | {len(ids)} | {one:.1f} | {tiled:.1f} | {ratio:.2f}x | "
            f"{share['one-row']:.0%} -> {share['tiled']:.0%} |",
            flush=True,
        )
        model.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
