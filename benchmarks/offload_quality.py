"""Quality of offloaded FFNs against the resident model, on the same text.

For each model: teacher-forced next-token argmax agreement and perplexity over N tokens
of the built-in evaluation text (edgerun.corpus), resident vs offloaded (dense
streaming, and sparse at each sparsity given), plus how many tokens of a greedy
generation match the resident one.

Usage: python benchmarks/offload_quality.py [-m MODEL,...] [-n 256] [--sparsity 0,0.1,0.2]
                                            [--greedy 64]
"""

from __future__ import annotations

import argparse

import numpy as np


def _nll(logits: np.ndarray, targets: np.ndarray) -> float:
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z).sum(axis=1))
    return float(np.mean(lse - z[np.arange(len(targets)), targets]))


def _greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    from edgerun.model.kvcache import KVCache

    cache = KVCache(model.spec, len(prompt_ids) + n + 1)
    logits = model.transformer.forward(prompt_ids, cache)
    out = []
    for _ in range(n):
        t = int(np.argmax(logits))
        out.append(t)
        logits = model.transformer.forward([t], cache)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--models", default="smollm2-135m,qwen2.5-coder-0.5b,qwen2.5-coder-1.5b")
    ap.add_argument("-n", type=int, default=256, help="teacher-forced tokens")
    ap.add_argument("--sparsity", default="0,0.1,0.2")
    ap.add_argument("--greedy", type=int, default=64, help="greedy tokens compared")
    ap.add_argument("-t", "--threads", type=int, default=2)
    a = ap.parse_args()

    import edgerun
    from edgerun.corpus import evaluation_text

    print(
        "| model | FFN | argmax agreement | perplexity (resident -> offloaded) | "
        f"greedy tokens equal (of {a.greedy}) |"
    )
    print("|---|---|---|---|---|")
    for name in a.models.split(","):
        # the row kernels, as offloaded layers compute (not the interleaved copies)
        res = edgerun.load(name, n_ctx=a.n + a.greedy + 8, threads=a.threads, interleave=False)
        ids = res.tokenize(evaluation_text())[: a.n + 1]
        inp, tgt = ids[:-1], np.asarray(ids[1:])
        ref = res.logits(inp)
        ref_arg = ref.argmax(axis=1)
        ppl_ref = float(np.exp(_nll(ref, tgt)))
        prompt = ids[:32]
        ref_greedy = _greedy(res, prompt, a.greedy)
        configs = [("dense", "dense", {})] + [
            (f"sparse {float(s):.2f}", "sparse", {"sparsity": float(s)})
            for s in a.sparsity.split(",")
        ]
        for label, mode, opts in configs:
            off = edgerun.load(
                name,
                n_ctx=a.n + a.greedy + 8,
                threads=a.threads,
                offload=mode,
                offload_options=opts,
            )
            lg = off.logits(inp)
            agree = float((lg.argmax(axis=1) == ref_arg).mean())
            ppl = float(np.exp(_nll(lg, tgt)))
            g = _greedy(off, prompt, a.greedy)
            same = next((i for i, (x, y) in enumerate(zip(g, ref_greedy)) if x != y), a.greedy)
            print(
                f"| {name} | {label} | {agree:.1%} | {ppl_ref:.3f} -> {ppl:.3f} "
                f"({(ppl / ppl_ref - 1):+.1%}) | {same} |",
                flush=True,
            )
            del off


if __name__ == "__main__":
    main()
