"""edgerun vs llama.cpp (llama-cpp-python) on the same GGUF, same threads.

Speed: runs alternate (edgerun pp, llama.cpp pp, edgerun tg, llama.cpp tg, ...) so
both engines see the same machine noise; the ratio is the median of per-pair
ratios. llama-cpp-python is a benchmark-only dependency:

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36

Agreement (--agreement N): teacher-forced next-token argmax agreement with llama.cpp on
the same file, over N positions of code (argparse.py's source) and N of prose (pydoc's
topic texts), both shipped with Python. edgerun prefills --agreement-prompt tokens, then
decodes the rest one token at a time (the kernels a chat runs); llama.cpp evaluates the
whole text with logits for every position. Checks a new weight format end to end.

Usage: python benchmarks/vs_llamacpp.py [-m MODEL] [-p 128] [-n 128] [-t 1,2] [-r 5]
                                       [-d DEPTH] [--kv-type f32|f16] [--json]
                                       [--agreement N [--agreement-prompt 16]]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from llamacpp_ref import llama_cpp_unusable  # noqa: E402


def _hand_over() -> None:
    """Free edgerun's OpenMP pool before llama.cpp runs: llama.cpp's OpenMP threads start
    on this thread, and two live pools throttle each other's spinning
    (edgerun/runtime/compute_thread.py). edgerun frees this thread's pool itself on its next
    call."""
    from edgerun.runtime.compute_thread import compute_thread, release_thread_pool

    compute_thread().call(release_thread_pool)


def _llama_pp(llm, ids):
    _hand_over()
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids)
    return len(ids) / (time.perf_counter() - t0)


def _llama_tg(llm, first, n, context=()):
    _hand_over()
    llm.reset()
    if context:
        llm.eval(list(context))  # untimed: decode is measured at this depth
    tok = first
    t0 = time.perf_counter()
    for _ in range(n):
        llm.eval([tok])
        # without logits_all llama-cpp-python stores no scores: read the last row directly
        last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        tok = int(np.argmax(last))
    return n / (time.perf_counter() - t0)


def _texts() -> dict[str, str]:
    """Code and prose that ship with Python: argparse's source, pydoc's topic texts."""
    import argparse as code
    from pydoc_data.topics import topics

    prose = "\n\n".join(topics[k] for k in ("assert", "assignment", "exceptions", "import"))
    return {"code": Path(code.__file__).read_text()[5000:40000], "prose": prose}


def agreement(model, n: int, prompt: int = 16) -> dict[str, float]:
    """Per text of _texts(): the share of n teacher-forced positions where edgerun's
    decode argmax equals llama.cpp's on the same file (one thread each)."""
    from llama_cpp import Llama

    from edgerun.model.kvcache import KVCache

    out = {}
    for name, text in _texts().items():
        ids = model.tokenize(text)[: n + prompt + 1]
        if len(ids) < n + prompt + 1:
            raise SystemExit(f"{name}: {len(ids)} tokens, fewer than {n + prompt + 1}")
        cache = KVCache(model.spec, len(ids), "f32")
        tr = model.transformer
        mine = [int(np.argmax(tr.forward(ids[:prompt], cache)))]
        mine += [int(np.argmax(tr.forward([t], cache))) for t in ids[prompt:-2]]
        _hand_over()
        llm = Llama(
            str(model.path), n_ctx=len(ids) + 8, n_threads=1, n_threads_batch=1,
            n_batch=512, logits_all=True, verbose=False,
        )  # fmt: skip
        llm.eval(ids[:-1])
        ref = np.asarray(llm.scores[prompt - 1 : len(ids) - 2]).argmax(axis=1)
        del llm
        out[name] = float(np.mean(np.asarray(mine) == ref))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-t", "--threads", default="1,2")
    ap.add_argument("-r", "--repetitions", type=int, default=5)
    ap.add_argument(
        "-d", "--depth", type=int, default=0, help="tokens already in context for tg (untimed)"
    )
    ap.add_argument("--kv-type", choices=("f32", "f16"), default="f32", help="edgerun's KV cache")
    ap.add_argument("--json", action="store_true")
    ap.add_argument(
        "--agreement", type=int, default=0, metavar="N",
        help="teacher-forced argmax agreement over N positions of code and N of prose",
    )  # fmt: skip
    ap.add_argument("--agreement-prompt", type=int, default=16)
    args = ap.parse_args(argv)
    import edgerun
    from edgerun.runtime.cpu_share import set_threads
    from edgerun.tools.bench import _time_decode, _time_prefill

    threads = [int(t) for t in args.threads.split(",")]
    n_ctx = max(args.n_prompt, args.depth + args.n_gen) + 8
    model = edgerun.load(args.model, n_ctx=n_ctx, kv_type=args.kv_type)
    why_not = llama_cpp_unusable(str(model.path))
    if why_not is not None:
        print(f"no comparison: {why_not}")
        return 0
    from llama_cpp import Llama

    if args.agreement:
        set_threads(1)
        agree = agreement(model, args.agreement, args.agreement_prompt)
        if args.json:
            print(json.dumps({"model": model.path.name, "agreement": agree}))
        else:
            parts = ", ".join(f"{k} {v * 100:.1f}%" for k, v in agree.items())
            print(f"{model.path.name}: argmax agreement with llama.cpp over {args.agreement}")
            print(f"teacher-forced positions each: {parts}")
        return 0

    rng = np.random.default_rng(0)
    ids = rng.integers(0, model.spec.vocab_size, args.n_prompt).tolist()
    context = rng.integers(0, model.spec.vocab_size, args.depth).tolist()
    results = []
    for t in threads:
        llm = Llama(
            str(model.path),
            n_ctx=n_ctx,
            n_threads=t,
            n_threads_batch=t,
            n_batch=512,
            verbose=False,
            logits_all=False,
        )
        set_threads(t)
        _time_prefill(model, 16, rng)  # warm-up both engines
        _time_decode(model, 4, rng)
        _llama_pp(llm, ids[:16])
        _llama_tg(llm, ids[0], 4)
        pairs = {"pp": [], "tg": []}
        for _ in range(args.repetitions):
            e = _time_prefill(model, args.n_prompt, rng)
            ll = _llama_pp(llm, ids)
            pairs["pp"].append((e, ll))
            e = _time_decode(model, args.n_gen, rng, args.depth)
            ll = _llama_tg(llm, ids[0], args.n_gen, context)
            pairs["tg"].append((e, ll))
        for test, n in (("pp", args.n_prompt), ("tg", args.n_gen)):
            ps = pairs[test]
            at = f" @ d{args.depth}" if test == "tg" and args.depth else ""
            results.append(
                {
                    "threads": t,
                    "test": f"{test}{n}{at}",
                    "edgerun_tps": statistics.median(p[0] for p in ps),
                    "llamacpp_tps": statistics.median(p[1] for p in ps),
                    "ratio": statistics.median(p[0] / p[1] for p in ps),
                }
            )
        del llm
    if args.json:
        print(json.dumps({"model": model.path.name, "results": results}, indent=2))
        return 0
    print(f"model: {model.path.name}   (median of {args.repetitions} alternating pairs)")
    print("| threads | test | edgerun t/s | llama.cpp t/s | edgerun / llama.cpp |")
    print("|---|---|---|---|---|")
    for r in results:
        print(
            f"| {r['threads']} | {r['test']} | {r['edgerun_tps']:.1f} | {r['llamacpp_tps']:.1f} | "
            f"{r['ratio']:.2f}x |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
