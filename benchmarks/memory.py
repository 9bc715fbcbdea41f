"""Peak resident memory while generating: edgerun vs llama.cpp, each in a fresh process.

Each run is a child process that imports the engine (its RSS then is the runtime
floor: interpreter, numpy, Numba/LLVM or libllama), loads the GGUF with a context
of C positions, prefills P prompt tokens and greedily decodes N more, then
reports its peak RSS (getrusage ru_maxrss). The KV cache is counted at what the
engine allocates for C positions: edgerun float32 K and V (f16 with --kv-type
f16), llama.cpp its default f16. The budget checked is peak <= 1.3 x (GGUF file
+ KV cache); the same ratio with the runtime floor taken out shows what the
model itself costs.
llama.cpp is skipped, with the reason and the install command printed, when
llama-cpp-python is not installed or its build crashes on this CPU (probed first in a
child, see llamacpp_ref.py):

    CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF" pip install llama-cpp-python==0.3.36

Usage: python benchmarks/memory.py [-m MODEL ...] [-c 2048] [-p 128] [-n 128] [-t 2] [-r 3]
                                  [--kv-type f32|f16] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llamacpp_ref import describe_exit, llama_cpp_unusable  # noqa: E402

BUDGET = 1.3


def _rss_now() -> int:
    import psutil

    return psutil.Process().memory_info().rss


def _peak_rss() -> int:
    import resource

    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb if sys.platform == "darwin" else kb * 1024


def _prompt_ids(vocab: int, n: int) -> list[int]:
    import random

    rng = random.Random(0)
    return [rng.randrange(1000, min(vocab, 30000)) for _ in range(n)]


def _child_edgerun(
    path: str, n_ctx: int, n_prompt: int, n_gen: int, threads: int, kv_type: str = "f32"
) -> dict:
    import numpy as np

    import edgerun  # noqa: F401  (configures Numba before anything compiles)
    from edgerun.api import load

    floor = _rss_now()
    model = load(path, n_ctx=n_ctx, threads=threads, kv_type=kv_type)
    gen = model.generator
    logits = gen.prefill(_prompt_ids(model.spec.vocab_size, n_prompt))
    for _ in range(n_gen):
        logits = model.transformer.forward([int(np.argmax(logits))], gen.cache)
    return {"floor": floor, "peak": _peak_rss(), "kv_bytes": gen.cache.nbytes}


def _child_llamacpp(path: str, n_ctx: int, n_prompt: int, n_gen: int, threads: int) -> dict:
    import numpy as np
    from llama_cpp import Llama

    floor = _rss_now()
    llm = Llama(path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, verbose=False)
    llm.eval(_prompt_ids(llm.n_vocab(), n_prompt))
    for _ in range(n_gen):
        # llama-cpp-python keeps no scores without logits_all: read the last row directly
        last = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))
        llm.eval([int(np.argmax(last))])
    return {"floor": floor, "peak": _peak_rss(), "kv_bytes": None}


CHILDREN = {"edgerun": _child_edgerun, "llama.cpp": _child_llamacpp}


def _run_child(engine: str, path: str, args) -> dict:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        engine,
        "-m",
        path,
        "-c",
        str(args.ctx),
        "-p",
        str(args.n_prompt),
        "-n",
        str(args.n_gen),
        "-t",
        str(args.threads),
        "--kv-type",
        args.kv_type,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(
            f"{engine} child failed ({describe_exit(out.returncode)}):\n{out.stderr[-2000:]}"
        )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _llamacpp_kv_bytes(spec, n_ctx: int) -> int:
    """llama.cpp's default KV cache: f16 K and V for every layer and position."""
    return 2 * spec.n_layers * n_ctx * spec.n_kv_heads * spec.head_dim * 2


def measure(model: str, args) -> list[dict]:
    from edgerun.api import resolve_model
    from edgerun.arch import spec_from_gguf
    from edgerun.formats.gguf import read_gguf

    path = resolve_model(model)
    gguf = read_gguf(path)
    spec = spec_from_gguf(gguf.metadata, str(path))
    n_ctx = min(args.ctx, spec.context_length)
    engines = ["edgerun"]
    why_not = llama_cpp_unusable(str(path))
    if why_not is None:
        engines.append("llama.cpp")
    else:
        print(f"measuring edgerun only: {why_not}", file=sys.stderr)
    runs: dict[str, list[dict]] = {e: [] for e in engines}
    for _ in range(args.repetitions):
        for e in engines:  # alternate, so both see the same machine state
            runs[e].append(_run_child(e, str(path), args))
    rows = []
    for e in engines:
        peak = statistics.median(r["peak"] for r in runs[e])
        floor = statistics.median(r["floor"] for r in runs[e])
        kv = runs[e][0]["kv_bytes"] or _llamacpp_kv_bytes(spec, n_ctx)
        base = gguf.file_size + kv
        rows.append(
            {
                "model": path.name,
                "engine": e,
                "n_ctx": n_ctx,
                "file_bytes": gguf.file_size,
                "kv_bytes": kv,
                "floor_bytes": floor,
                "peak_rss_bytes": peak,
                "ratio": peak / base,
                "ratio_above_floor": (peak - floor) / base,
            }
        )
    return rows


def format_rows(rows: list[dict], args) -> str:
    mib = 2**20
    lines = [
        f"peak RSS, prompt {args.n_prompt} + {args.n_gen} generated tokens, {args.threads} "
        f"threads, median of {args.repetitions} fresh processes; budget peak <= {BUDGET} x "
        "(file + KV)",
        "| model | engine | ctx | file | KV | runtime floor | peak RSS | peak/(file+KV) "
        "| (peak-floor)/(file+KV) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['engine']} | {r['n_ctx']} | {r['file_bytes'] / mib:.0f} MiB | "
            f"{r['kv_bytes'] / mib:.0f} MiB | {r['floor_bytes'] / mib:.0f} MiB | "
            f"{r['peak_rss_bytes'] / mib:.0f} MiB | {r['ratio']:.2f}x | "
            f"{r['ratio_above_floor']:.2f}x |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", action="append", default=None)
    ap.add_argument("-c", "--ctx", type=int, default=2048)
    ap.add_argument("-p", "--n-prompt", type=int, default=128)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-r", "--repetitions", type=int, default=3)
    ap.add_argument("--kv-type", choices=("f32", "f16"), default="f32", help="edgerun's KV cache")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        fn = CHILDREN[args.child]
        if args.child == "edgerun":
            res = fn(args.model[0], args.ctx, args.n_prompt, args.n_gen, args.threads, args.kv_type)
        else:
            res = fn(args.model[0], args.ctx, args.n_prompt, args.n_gen, args.threads)
        print(json.dumps(res))
        return 0
    rows = []
    for model in args.model or ["smollm2-135m"]:
        rows.extend(measure(model, args))
    print(json.dumps(rows, indent=1) if args.json else format_rows(rows, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
