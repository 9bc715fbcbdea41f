"""edgerun's embeddings against llama.cpp's on the same GGUF, per pooling, and their speed.

llama.cpp (llama-cpp-python, `Llama(embedding=True, pooling_type=...)`) pools the final
hidden states after the output norm, as edgerun does (both with float32 keys and values:
llama.cpp's own f16 cache moves its vectors by up to ~7e-4 in cosine). This prints the
cosine of each text's two vectors (both L2-normalised) for mean and last pooling, and
edgerun's time to embed the texts batched against one by one. With --hf, both are also
held to transformers loading the same GGUF (gguf_file=, every tensor dequantized,
float32): the exact reference, which tells edgerun's rounding from llama.cpp's (its
matmuls quantize activations to 8 bits). Needs llama-cpp-python (a reference, never a
dependency), and torch + transformers for --hf.

    python benchmarks/embeddings_llamacpp.py --hf -m SmolLM2-135M-Instruct.Q4_1.gguf \\
        -m qwen2.5-coder-0.5b-instruct.gguf
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

TEXTS = [
    "The capital of France is Paris.",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Embeddings map a text to a vector; similar texts get nearby vectors.",
    "x",
    "Numbers like 12345 and symbols like {}[]() appear in code.",
    "A long sentence about edge devices, " * 12,
    "Rotary position embeddings rotate pairs of query and key features.",
    "<|im_start|> is taken as plain text here",
]
SHORT = [f"short text number {i}" for i in range(32)]
LLAMA_POOLING = {"mean": 1, "cls": 2, "last": 3}


def llama_cpp_vectors(path: str, texts: list[str], pooling: str, threads: int) -> np.ndarray:
    import llama_cpp

    model = llama_cpp.Llama(
        model_path=path, embedding=True, pooling_type=LLAMA_POOLING[pooling], n_ctx=1024,
        n_batch=1024, n_ubatch=1024, n_threads=threads, verbose=False, type_k=0, type_v=0,
    )  # fmt: skip
    out = np.array(model.embed(texts, normalize=True), dtype=np.float64)
    model.close()
    return out


def transformers_vectors(path: str, sequences: list[list[int]], pooling: str) -> np.ndarray:
    # this folder's kernels.py would shadow the `kernels` package transformers imports
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = path.rsplit("/", 1) if "/" in path else (".", path)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    out = []
    for ids in sequences:
        with torch.no_grad():
            h = model(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        v = h.double().numpy()
        v = v[-1] if pooling == "last" else v.mean(0)
        out.append(v / np.linalg.norm(v))
    return np.array(out)


def _cos(a: np.ndarray, b: np.ndarray) -> str:
    c = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
    return f"min {c.min():.6f}  mean {c.mean():.6f}"


def _timings(m, texts: list[str], reps: int = 3) -> tuple[float, float]:
    """The best of reps: all texts in one embed call, and one call per text (alternated,
    so other load on the machine hits both alike)."""
    batched, single = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        m.embed(texts)
        batched.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in texts:
            m.embed(t)
        single.append(time.perf_counter() - t0)
    return min(batched), min(single)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", required=True)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--hf", action="store_true", help="also against transformers (float32)")
    args = ap.parse_args()
    import edgerun
    from edgerun.generate.embedding import text_tokens

    for path in args.model:
        m = edgerun.load(path, n_ctx=1024, threads=args.threads)
        m.embed(TEXTS + SHORT)  # compile / load the kernels of every pass size
        for t in TEXTS + SHORT:
            m.embed(t)
        print(f"{m.name} ({path.rsplit('/', 1)[-1]}), file pooling {m.spec.pooling}")
        for pooling in ("mean", "last"):
            ours = m.embed(TEXTS, pooling=pooling).astype(np.float64)
            ref = llama_cpp_vectors(path, TEXTS, pooling, args.threads)
            print(f"  {pooling:5s} cosine, edgerun vs llama.cpp: {_cos(ours, ref)}")
            if args.hf:
                seqs = [text_tokens(m.tokenizer, t) for t in TEXTS]
                exact = transformers_vectors(path, seqs, pooling)
                print(f"  {pooling:5s} cosine, edgerun vs transformers: {_cos(ours, exact)}")
                print(f"  {pooling:5s} cosine, llama.cpp vs transformers: {_cos(ref, exact)}")
        for name, texts in (("these", TEXTS), ("short", SHORT)):
            batched, single = _timings(m, texts)
            n_tok = sum(len(m.tokenize(t, special=False)) for t in texts)
            print(f"  {len(texts)} {name} texts ({n_tok} tokens), {args.threads} threads: "
                  f"batched {batched * 1e3:.0f} ms, one by one {single * 1e3:.0f} ms "
                  f"({single / batched:.2f}x)")  # fmt: skip
        m.close()


if __name__ == "__main__":
    main()
