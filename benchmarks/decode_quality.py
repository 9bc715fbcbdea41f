"""How far the int8 kernel path's decode logits are from float activations, teacher-forced.

Feeds the same text token by token through the decode step (one-token forwards, the
matvec kernels a chat runs) on the fastest kernel path and on the portable path, whose
activations stay float32, in one process, and prints per model: top-1 agreement, mean and
max KL divergence of the next-token distributions, the largest logit difference, and
both paths' mean negative log-likelihood of the text. The int8 paths quantize x to
two-level int8 (~15 bits) for every format, and to single-level int8 with power-of-two
refined scales for Q4_K off the vnni path (qmatvec_vnni.quantize_x_sb8).

Usage: python benchmarks/decode_quality.py [-m MODEL ...] [-n 200] [-t 2]
"""

from __future__ import annotations

import argparse
import os

import numpy as np

import edgerun
from edgerun.model.kvcache import KVCache
from edgerun.ops import qmatvec


def _text() -> str:
    """Text that ships with Python (argparse's source), as `edgerun perplexity` uses."""
    return open(os.path.join(os.path.dirname(os.__file__), "argparse.py")).read()[5000:40000]


def _decode_logits(model, ids: list[int], path: str, prompt: int) -> np.ndarray:
    """float64 [len(ids) - prompt, vocab]: next-token logits after a prompt of `prompt`
    tokens, then after each further token fed one at a time, on kernel path `path`."""
    old = qmatvec.set_kernel_path(path)
    try:
        cache = KVCache(model.spec, len(ids), "f32")
        tr = model.transformer
        rows = [np.asarray(tr.forward(ids[:prompt], cache)).reshape(-1)]
        rows += [np.asarray(tr.forward([t], cache)).reshape(-1) for t in ids[prompt:-1]]
    finally:
        qmatvec.set_kernel_path(old)
    return np.stack(rows).astype(np.float64)


def _log_softmax(a: np.ndarray) -> np.ndarray:
    a = a - a.max(axis=1, keepdims=True)
    return a - np.log(np.exp(a).sum(axis=1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--models", nargs="+", default=["qwen2.5-coder-1.5b"])
    ap.add_argument("-n", "--tokens", type=int, default=200)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=16)
    args = ap.parse_args()
    fast = qmatvec.available_paths()[-1]
    print(f"decode logits, {fast} path vs portable (float activations), teacher-forced")
    for name in args.models:
        model = edgerun.load(name, threads=args.threads)
        ids = model.tokenize(_text())[: args.tokens]
        ref_raw = _decode_logits(model, ids, "portable", args.prompt)
        got_raw = _decode_logits(model, ids, fast, args.prompt)
        ref, got = _log_softmax(ref_raw), _log_softmax(got_raw)
        target = np.asarray(ids[args.prompt :])
        kl = (np.exp(ref) * (ref - got)).sum(axis=1)
        agree = float((ref.argmax(axis=1) == got.argmax(axis=1)).mean())
        rows = np.arange(len(target))
        nll_ref = float(-ref[rows, target].mean())
        nll_got = float(-got[rows, target].mean())
        dlogit = float(np.abs(got_raw - ref_raw).max())
        print(
            f"{name}: {len(target)} tokens, top-1 agreement {agree * 100:.1f}%, KL mean "
            f"{kl.mean():.2e} max {kl.max():.2e}, max |dlogit| {dlogit:.3f}, NLL {nll_got:.4f} "
            f"({fast}) vs {nll_ref:.4f} (portable)"
        )


if __name__ == "__main__":
    main()
