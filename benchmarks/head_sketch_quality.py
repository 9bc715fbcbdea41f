"""What the sketched output head (edgerun/offload/head.py) changes, teacher-forced.

Loads a model with an untied head under a RAM budget (dense offloading: the head's
first rows held, a low-rank sketch picking the flash rows a token reads), runs real text
through it, and compares per position the decode logits (held rows + candidates exact,
the rest -inf) with every row's exact logits: argmax agreement, the probability mass
the finite rows carry, and how often the text's next token had no finite logit.

    python benchmarks/head_sketch_quality.py -m qwen2.5-coder-1.5b --budget 800M -n 512
"""

from __future__ import annotations

import argparse
import inspect
import json
import time

import numpy as np

import edgerun
from edgerun.corpus import evaluation_text
from edgerun.model.kvcache import KVCache


def texts() -> dict[str, str]:
    """Prose (the evaluation head of the built-in corpus; the sketch is calibrated on its
    last quarter) and code (a stdlib module the calibration never saw)."""
    import textwrap

    return {"prose": evaluation_text()[:20000], "code": inspect.getsource(textwrap)}


def measure(model, text: str, n: int, candidates: int) -> dict:
    head = model.transformer.head
    head.candidates = candidates
    ids = model.tokenizer.encode(text)[: n + 1]
    cache = KVCache(model.spec, len(ids), model.kv_type)
    step = model.engine.prefill_chunk
    hidden = np.concatenate(
        [
            model.transformer.final_hidden(ids[i : i + step], cache)
            for i in range(0, len(ids) - 1, step)
        ]
    )
    agree = missing = 0
    mass = []
    for i0 in range(0, len(hidden), 64):
        x = hidden[i0 : i0 + 64]
        exact = head(x)
        for j in range(len(x)):
            got = head.next_logits(x[j : j + 1])[0]
            e = exact[j]
            p = np.exp(e - e.max())
            p /= p.sum()
            fin = np.isfinite(got)
            agree += int(np.argmax(got) == np.argmax(e))
            mass.append(float(p[fin].sum()))
            missing += int(not fin[ids[i0 + j + 1]])
    t = len(hidden)
    return {
        "tokens": t,
        "argmax_agreement": agree / t,
        "mass_mean": float(np.mean(mass)),
        "mass_min": float(np.min(mass)),
        "next_token_without_logit": missing,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-m", "--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--budget", default="800M")
    ap.add_argument("-n", "--tokens", type=int, default=512)
    ap.add_argument("-k", "--candidates", default="16,64", help="comma-separated")
    ap.add_argument("--rank", type=int, default=None, help="the sketch's rank (default: edgerun's)")
    ap.add_argument("--json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    opts = {} if a.rank is None else {"head_rank": a.rank}
    model = edgerun.load(a.model, ram_budget=a.budget, n_ctx=a.tokens + 8, offload_options=opts)
    model.warm_up()  # fits (or loads) the sketch
    head = model.transformer.head
    if not hasattr(head, "sketch"):
        raise SystemExit(f"{a.model} at {a.budget}: the plan does not sketch the head")
    print(
        f"{a.model} at {a.budget}: {head.matrix.held_rows} of {head.matrix.rows} head rows held, "
        f"sketch rank {head.sketch.basis.shape[1]} ({head.sketch.nbytes / 2**20:.1f} MiB); "
        f"load {time.perf_counter() - t0:.1f} s"
    )
    out = []
    for k in (int(v) for v in a.candidates.split(",")):
        for name, text in texts().items():
            r = {"model": a.model, "budget": a.budget, "candidates": k, "text": name}
            r.update(measure(model, text, a.tokens, k))
            out.append(r)
            print(
                f"candidates {k:4d} {name:5s}: {r['tokens']} tokens, argmax agreement "
                f"{r['argmax_agreement']:.2%}, probability mass kept mean {r['mass_mean']:.5f} "
                f"min {r['mass_min']:.4f}, next token without a logit "
                f"{r['next_token_without_logit']}",
                flush=True,
            )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
