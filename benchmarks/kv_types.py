"""KV cache types q8_0 and q4_0 against f16: teacher-forced quality and decode speed.

Quality: each text (code: Python's argparse.py; prose: the pydoc topics of
edgerun.corpus) is fed through the model teacher-forced, `--step` tokens a forward pass
with every position's logits (the prefill kernels, which write the cache in its type and
attend on it as stored), from an empty cache of each type; then `--decode` more tokens
one at a time (the bound decode step and its fused attention kernel). Against the f16
cache's logits at the same positions it prints, per type: top-1 agreement, mean and max
KL(f16 || type) of the next-token distributions, and each type's mean NLL of the text.
Targets (issue 52): q8_0 top-1 >= 0.99 and mean KL <= 0.002; q4_0 top-1 >= 0.97.

Speed: decode tok/s after `--depth` positions (4,096) in the cache, whose rows are random
normal values stored in each type (attention's work does not depend on the values);
the types alternate within each round, medians over the rounds. On a shared machine
the spread (min..max) says how noisy the rounds were.

Usage: PYTHONPATH=. python benchmarks/kv_types.py [-m PATH ...] [--tokens 1100]
       [--types f16 q8_0 q4_0] [--rounds 5] [--no-speed] [--no-quality]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import numpy as np

import edgerun
from edgerun.corpus import evaluation_text
from edgerun.model.kvcache import KVCache

MODELS = [
    Path.home() / ".cache/edgerun/models/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    Path.home() / ".cache/edgerun/models/gemma-3-270m-q4_k_m.gguf",
]


def _texts() -> dict[str, str]:
    code = open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read()
    return {"code": code[5000:60000], "prose": evaluation_text()[:60000]}


def _logits(model, ids: list[int], kv_type: str, step: int, decode: int) -> np.ndarray:
    """float32 [len(ids) - 1, vocab]: the next-token logits after each of ids[:-1]: the
    first len(ids) - decode positions `step` at a time, the rest one at a time."""
    tr = model.transformer
    cache = tr.new_cache(len(ids), kv_type)  # quantised keys centred, as the engine's
    rows = []
    split = len(ids) - 1 - decode
    for i in range(0, split, step):
        rows.append(np.asarray(tr.forward(ids[i : min(i + step, split)], cache, all_logits=True)))
    for t in ids[split:-1]:
        rows.append(np.asarray(tr.forward([t], cache)).reshape(1, -1))
    return np.concatenate(rows).astype(np.float32)


def _log_softmax(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    a = a - a.max(axis=1, keepdims=True)
    return a - np.log(np.exp(a).sum(axis=1, keepdims=True))


def _compare(ref: np.ndarray, other: np.ndarray, targets: np.ndarray, rows: int = 64) -> tuple:
    """Per position (float64, `rows` positions at a time: a vocabulary of 150k makes
    whole arrays gigabytes): top-1 agreement, KL(ref || other), other's NLL, ref's NLL."""
    top1, kl, nll, nll_ref = [], [], [], []
    for i in range(0, len(targets), rows):
        r, o = _log_softmax(ref[i : i + rows]), _log_softmax(other[i : i + rows])
        t = targets[i : i + rows]
        top1.append(r.argmax(1) == o.argmax(1))
        kl.append((np.exp(r) * (r - o)).sum(axis=1))
        nll.append(-o[np.arange(len(t)), t])
        nll_ref.append(-r[np.arange(len(t)), t])
    return tuple(np.concatenate(x) for x in (top1, kl, nll, nll_ref))


def quality(model, types: list[str], n_tokens: int, step: int, decode: int) -> None:
    tok = model.tokenizer
    per: dict[str, list] = {t: [] for t in types}
    for name, text in _texts().items():
        ids = tok.encode(text, add_bos=False, parse_special=False)[:n_tokens]
        if getattr(tok, "add_bos", False):
            ids = [tok.bos_id] + ids[:-1]
        targets = np.asarray(ids[1:])
        t0 = time.perf_counter()
        ref = _logits(model, ids, "f16", step, decode)
        for t in types:
            per[t].append(_compare(ref, _logits(model, ids, t, step, decode), targets))
        print(f"  {name}: {len(ids)} tokens, {time.perf_counter() - t0:.0f} s", flush=True)
    n = sum(len(x[0]) for x in per[types[0]])
    nll_ref = np.concatenate([x[3] for x in per[types[0]]]).mean()
    print(f"  {n} positions scored ({decode} a text by one-token decode)")
    print(f"  {'type':<6} {'top-1':>7} {'mean KL':>10} {'max KL':>9} {'NLL':>8}  (f16 NLL "
          f"{nll_ref:.4f})")  # fmt: skip
    for t in types:
        top1, kl, nll, _ = (np.concatenate(x) for x in zip(*per[t]))
        print(f"  {t:<6} {top1.mean():7.4f} {kl.mean():10.6f} {kl.max():9.5f} {nll.mean():8.4f}",
              flush=True)  # fmt: skip


def speed(model, types: list[str], depth: int, n: int, rounds: int) -> None:
    spec, tr = model.spec, model.transformer
    rng = np.random.default_rng(0)
    caches = {}
    for t in types:
        c = caches[t] = tr.new_cache(depth + n + 1, t)
        for layer in range(spec.n_layers):
            for p in range(0, depth, 512):
                m = min(512, depth - p)
                k, v = rng.standard_normal((2, m, spec.n_kv_heads, spec.head_dim), np.float32)
                c.store(layer, p, k, v)
        c.tokens[:] = rng.integers(0, spec.vocab_size, depth).tolist()
    times: dict[str, list[float]] = {t: [] for t in types}
    cpu: dict[str, list[float]] = {t: [] for t in types}
    load = []
    for r in range(rounds + 1):  # round 0 warms the kernels up, untimed
        order = types if r % 2 else types[::-1]
        for t in order:
            c = caches[t]
            c.truncate(depth)
            tok = 1
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(n):
                tok = int(np.argmax(tr.forward([tok], c)))
            if r:
                times[t].append(n / (time.perf_counter() - t0))
                cpu[t].append(n / (time.process_time() - c0))
        load.append(os.getloadavg()[0])
    print(f"  decode tok/s at a {depth}-token context ({n} tokens a run, {rounds} rounds, "
          "median [min..max]; shared machine: noisy), and tokens per CPU second (with -t 1: "
          f"the time the process ran, less sensitive to the other load); load average "
          f"{min(load):.1f}..{max(load):.1f}")  # fmt: skip
    for t in types:
        s, u = times[t], cpu[t]
        kib = KVCache.bytes_for(spec, 1, t) / 1024
        ratio = KVCache.bytes_for(spec, 1, t) / KVCache.bytes_for(spec, 1, "f16")
        print(f"  {t:<6} {statistics.median(s):7.2f} [{min(s):.2f}..{max(s):.2f}]  CPU "
              f"{statistics.median(u):7.2f} [{min(u):.2f}..{max(u):.2f}]"
              f"  KV {kib:g} KiB/token ({ratio:.4f}x f16)", flush=True)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--models", nargs="+", default=[str(p) for p in MODELS])
    ap.add_argument("--types", nargs="+", default=["q8_0", "q4_0"])
    ap.add_argument("--tokens", type=int, default=1100, help="tokens of each text")
    ap.add_argument("--step", type=int, default=128, help="tokens a teacher-forced pass")
    ap.add_argument("--decode", type=int, default=64, help="last tokens fed one at a time")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--depth", type=int, default=4096)
    ap.add_argument("-n", type=int, default=16, help="decode tokens a timed run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-quality", action="store_true")
    ap.add_argument("--no-speed", action="store_true")
    args = ap.parse_args()
    for path in args.models:
        model = edgerun.load(path, n_ctx=args.depth + args.n + 1, threads=args.threads)
        print(f"{model.spec.name} ({Path(path).name}), {args.threads} threads", flush=True)
        try:
            if not args.no_quality:
                quality(model, args.types, args.tokens, args.step, args.decode)
            if not args.no_speed:
                speed(model, ["f16", *args.types], args.depth, args.n, args.rounds)
        finally:
            model.close()


if __name__ == "__main__":
    main()
