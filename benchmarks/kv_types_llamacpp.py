"""llama.cpp's own KV cache types on a GGUF, teacher-forced against its f16 cache.

The reference for benchmarks/kv_types.py: the same top-1 agreement and mean KL, computed on
llama.cpp (llama-cpp-python, flash attention on, as quantised V caches require) so edgerun's
q8_0 / q4_0 figures can be told apart from the formats' own loss. Needs llama-cpp-python (a
reference, never a dependency of edgerun).

    python benchmarks/kv_types_llamacpp.py -m path/to/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
"""

from __future__ import annotations

import argparse
import inspect

import numpy as np

GGML_TYPES = {"f16": 1, "q4_0": 2, "q8_0": 8}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def logits(path: str, ids: list[int], kv: str, threads: int) -> np.ndarray:
    import llama_cpp

    n = len(ids) + 8
    model = llama_cpp.Llama(
        model_path=path, n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, verbose=False,
        n_threads=threads, flash_attn=True, type_k=GGML_TYPES[kv], type_v=GGML_TYPES[kv],
    )  # fmt: skip
    model.eval(ids)
    return np.array(model.scores[: len(ids)], dtype=np.float64)


def main() -> None:
    import llama_cpp

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", "--tokens", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=1)
    args = ap.parse_args()
    text = inspect.getsource(argparse)
    vocab = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)
    ids = vocab.tokenize(text.encode(), add_bos=False)[: args.tokens]
    base = _log_softmax(logits(args.model, ids, "f16", args.threads))
    print(f"{args.model}: {len(ids)} tokens of argparse.py, llama.cpp {llama_cpp.__version__}")
    print(f"{'type':<6} {'top-1':>7} {'mean KL':>9} {'max KL':>8}")
    for kv in ("q8_0", "q4_0"):
        lq = _log_softmax(logits(args.model, ids, kv, args.threads))
        top1 = float((base.argmax(-1) == lq.argmax(-1)).mean())
        kl = (np.exp(base) * (base - lq)).sum(-1)
        print(f"{kv:<6} {top1:7.4f} {kl.mean():9.5f} {kl.max():8.3f}")


if __name__ == "__main__":
    main()
