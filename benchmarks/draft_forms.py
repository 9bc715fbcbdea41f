"""Which form of a draft model speculates fastest: acceptance x cost, teacher-forced.

Target Qwen2.5-Coder-1.5B (Q4_K_M), draft Qwen2.5-Coder-0.5B (Q8_0 as shipped) in the
forms edgerun.generate.draft_forms makes (requantized copies, first L layers, both),
plus llama.cpp-quantized copies of the draft as a reference (`--llamacpp`: made with
llama_cpp.llama_model_quantize, loaded by edgerun; a reference, never a runtime path).

1. The target's greedy continuations (`--tokens` each) of code and prose chat prompts,
   made once per run (and kept in `--targets` between runs: keyed by the target file's
   identity, the prompts and the length).
2. Per form, teacher-forced on prompt + continuation: the draft's argmax at every
   continuation position against the target's token (top-1 agreement), and from those,
   exactly, the greedy speculative loop with draft length k = 1..8: a pass accepts the
   run of agreeing drafted tokens (at most k) plus the target's own next token, so
   tokens per pass = tokens / passes (teacher forcing is exact here: while the draft
   agrees, its history is the target's).
3. Cost, 2 threads, forms and target alternating within each round, medians over the
   rounds: the draft's decode step (ms per token) and the target's batched decode step
   with m = 1..9 rows (forward_batch over m caches: the rows a verification pass of
   k = m - 1 drafted tokens runs).
4. Expected speedup over plain target decoding for each k:
       tokens_per_pass(k) * T(1) / (k * D + T(k + 1))
   with D the draft's step and T(m) the target's m-row step; the best k per form.

Usage: PYTHONPATH=. python benchmarks/draft_forms.py [--tokens 192] [--rounds 7]
       [--forms source q4_0 ...] [--llamacpp q4_k q2_k ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import edgerun
from edgerun.generate.draft_forms import cheap_draft
from edgerun.model.kvcache import KVCache
from edgerun.registry import cache_dir
from edgerun.runtime.cpu_share import set_threads

MODELS = Path.home() / ".cache/edgerun/models"
TARGET = MODELS / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
DRAFT = MODELS / "qwen2.5-coder-0.5b-instruct.gguf"
PROMPTS = {
    "code": [
        "Write a Python function that parses an INI file into a dict of dicts, handling "
        "comments and quoted values. Include type hints and a docstring.",
        "Implement a thread-safe LRU cache class in Python with get, put and a max size, "
        "using OrderedDict and a lock.",
        "Write a C function that reverses a singly linked list in place and a main() that "
        "tests it on a list of 5 elements.",
        "Write a JavaScript function that debounces another function, then show how to use "
        "it with a window resize handler.",
        "Write a Rust function that counts word frequencies in a string and returns the "
        "top N words sorted by count, with unit tests.",
    ],
    "prose": [
        "Explain to a new programmer what a hash table is, how collisions are handled, and "
        "when to use one instead of a list.",
        "Write a short story (about 200 words) about a lighthouse keeper who finds a "
        "message in a bottle.",
    ],
}
# Qwen2.5-0.5B's d_model (896) is no multiple of 256: a K-quant form falls back to Q5_0
# on every matrix but ffn_down (llama.cpp's Q2_K / Q3_K to IQ4_NL), so the K-quants are
# left out; the G64 formats and the 32-blocks fit
FORMS = [
    "source",
    "q5_0",
    "q4_0",
    "q3_g64",
    "q2_g64",
    "keep:20",
    "keep:16",
    "q4_0:22",
    "q4_0:20",
]
LLAMACPP = {"iq4_nl": "LLAMA_FTYPE_MOSTLY_IQ4_NL"}
KS = range(1, 9)


def identity(p: Path) -> list:
    st = p.stat()
    return [str(p.resolve()), st.st_size, st.st_mtime_ns]


def target_continuations(target, n_tokens: int, store: Path) -> dict[str, list[tuple]]:
    """kind -> [(prompt ids, greedy continuation ids)], read from `store` when it holds
    this target's, prompts' and length's."""
    key = {"target": identity(TARGET), "prompts": PROMPTS, "tokens": n_tokens}
    if store.is_file():
        doc = json.loads(store.read_text())
        if doc.get("key") == key:
            return {k: [tuple(x) for x in v] for k, v in doc["runs"].items()}
    tr = target.transformer
    eos = set(target.tokenizer.eos_ids) if hasattr(target.tokenizer, "eos_ids") else set()
    runs: dict[str, list] = {}
    for kind, prompts in PROMPTS.items():
        runs[kind] = []
        for text in prompts:
            ids = target.encode_chat([{"role": "user", "content": text}])
            cache = KVCache(target.spec, len(ids) + n_tokens + 1, target.kv_type)
            logits = tr.forward(ids, cache)
            out: list[int] = []
            t0 = time.perf_counter()
            while len(out) < n_tokens:
                t = int(np.argmax(logits))
                out.append(t)
                if t in eos:
                    break
                logits = tr.forward([t], cache)
            dt = time.perf_counter() - t0
            print(f"  target {kind}: {len(out)} tokens in {dt:.1f} s", file=sys.stderr)
            runs[kind].append((ids, out))
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps({"key": key, "runs": runs}))
    return runs


def agreement(draft, runs: dict[str, list[tuple]]) -> dict[str, list[np.ndarray]]:
    """kind -> per prompt: bool [n] (the draft's argmax after prompt + cont[:i] is cont[i])."""
    out: dict[str, list[np.ndarray]] = {}
    for kind, items in runs.items():
        out[kind] = []
        for ids, cont in items:
            seq = list(ids) + list(cont[:-1])
            logits = draft.logits(seq)[len(ids) - 1 :]
            out[kind].append(np.argmax(logits, axis=1) == np.asarray(cont))
    return out


def tokens_per_pass(agree: list[np.ndarray], k: int) -> float:
    """The greedy speculative loop with draft length k over these continuations."""
    tokens = passes = 0
    for a in agree:
        n, pos = len(a), 0
        while pos < n:
            run = 0
            while run < k and pos + run < n and a[pos + run]:
                run += 1
            pos += run + 1
            passes += 1
        tokens += n
    return tokens / passes


def llamacpp_copy(fmt: str, out_dir: Path) -> Path:
    import llama_cpp

    out = out_dir / f"{DRAFT.stem}.llamacpp-{fmt}.gguf"
    if out.is_file() and out.stat().st_mtime_ns > DRAFT.stat().st_mtime_ns:
        return out
    out_dir.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMACPP[fmt])
    params.allow_requantize = True
    params.pure = True
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(DRAFT).encode(), str(out).encode(), params)
    if rc != 0:
        raise RuntimeError(f"llama_model_quantize {fmt}: rc {rc}")
    return out


def step_cost(model, n_rows: int, caches: list[KVCache], steps: int) -> float:
    """ms per decode step of n_rows sequences (forward for one, forward_batch for more)."""
    tr = model.transformer
    t0 = time.perf_counter()
    for _ in range(steps):
        if n_rows == 1:
            tr.forward([42], caches[0])
        else:
            tr.forward_batch([42] * n_rows, caches[:n_rows])
    return (time.perf_counter() - t0) * 1e3 / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=192)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=8, help="decode steps timed per round")
    ap.add_argument("--forms", nargs="*", default=FORMS)
    ap.add_argument("--llamacpp", nargs="*", default=list(LLAMACPP))
    ap.add_argument("--max-rows", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--targets", type=Path, default=cache_dir() / "drafts" / "bench-targets.json")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lines: list[str] = []

    def say(s: str = "") -> None:
        print(s, flush=True)
        lines.append(s)

    set_threads(args.threads)
    target = edgerun.load(str(TARGET), threads=args.threads, n_ctx=1024)
    print("target continuations", file=sys.stderr)
    runs = target_continuations(target, args.tokens, args.targets)
    n_tok = {k: sum(len(c) for _, c in v) for k, v in runs.items()}
    say(f"target {TARGET.name}, draft {DRAFT.name}, threads {args.threads}")
    say(f"continuations: {', '.join(f'{k} {len(v)} x ~{args.tokens}' for k, v in runs.items())}")

    paths: dict[str, Path] = {}
    for form in args.forms:
        t0 = time.perf_counter()
        paths[form] = cheap_draft(DRAFT, form, cache_dir=cache_dir() / "drafts", progress=True)
        print(f"  form {form}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    for fmt in args.llamacpp:
        paths[f"llama.cpp {fmt}"] = llamacpp_copy(fmt, cache_dir() / "drafts" / "llamacpp-ref")

    # agreement, one draft loaded at a time (kept in --targets' directory between runs:
    # keyed by the continuations and the draft file's identity)
    agree: dict[str, dict[str, list[np.ndarray]]] = {}
    sizes: dict[str, int] = {}
    store = args.targets.with_name(args.targets.stem + "-agreement.json")
    saved = json.loads(store.read_text()) if store.is_file() else {}
    for name, p in paths.items():
        d = edgerun.load(str(p), threads=args.threads, n_ctx=1024)
        sizes[name] = sum(b for *_, b in d.tensor_summary())
        t0 = time.perf_counter()
        key = json.dumps([identity(p), identity(args.targets)])
        if key in saved:
            agree[name] = {k: [np.asarray(a, bool) for a in v] for k, v in saved[key].items()}
        else:
            agree[name] = agreement(d, runs)
            saved[key] = {k: [a.tolist() for a in v] for k, v in agree[name].items()}
            store.write_text(json.dumps(saved))
        a = {k: float(np.concatenate(v).mean()) for k, v in agree[name].items()}
        print(f"  agreement {name}: {a} ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
        d.close()
        del d

    # cost: every model loaded, alternating within each round
    models = {"target": target}
    for name, p in paths.items():
        models[name] = edgerun.load(str(p), threads=args.threads, n_ctx=1024)
    prompt = runs["code"][0][0][:64]
    caches: dict[str, list[KVCache]] = {}
    n_ctx = len(prompt) + args.steps * (args.rounds + 1) + 8
    for name, m in models.items():
        rows = args.max_rows if name == "target" else 1
        caches[name] = []
        for _ in range(rows):
            c = KVCache(m.spec, n_ctx, m.kv_type)
            m.transformer.forward(prompt, c)
            caches[name].append(c)
    timings: dict[tuple[str, int], list[float]] = {}
    row_counts = range(1, args.max_rows + 1)
    for r in range(args.rounds + 1):  # round 0 warms up (kernels compiled, pages in)
        for name, m in models.items():
            for n in row_counts if name == "target" else (1,):
                for c in caches[name][:n]:
                    c.truncate(len(prompt))
                set_threads(args.threads)
                ms = step_cost(m, n, caches[name], args.steps)
                if r:
                    timings.setdefault((name, n), []).append(ms)
        print(f"  round {r} done", file=sys.stderr)
    med = {k: statistics.median(v) for k, v in timings.items()}
    spread = {k: (min(v), max(v)) for k, v in timings.items()}
    t1 = med[("target", 1)]

    say()
    say(
        f"target decode step, {args.threads} threads, medians of {args.rounds} rounds x "
        f"{args.steps} steps (min..max):"
    )
    say("  rows   ms/step   x one row   per row")
    for n in row_counts:
        lo, hi = spread[("target", n)]
        say(
            f"  {n:4d} {med[('target', n)]:8.1f} ({lo:.1f}..{hi:.1f}) "
            f"{med[('target', n)] / t1:6.2f}  {med[('target', n)] / n / t1:8.2f}"
        )
    say()
    header = (
        f"{'form':18s} {'MB':>5s} {'ms/tok':>7s} {'cost':>5s}  {'agree code':>10s} "
        f"{'prose':>6s}  tokens/pass code k=1..8"
    )
    say(header)
    best: dict[str, dict[str, tuple[float, int]]] = {}
    for name in paths:
        d = med[(name, 1)]
        lo, hi = spread[(name, 1)]
        a = {k: float(np.concatenate(v).mean()) for k, v in agree[name].items()}
        tpp = {kind: [tokens_per_pass(agree[name][kind], k) for k in KS] for kind in runs}
        say(
            f"{name:18s} {sizes[name] / 1e6:5.0f} {d:7.1f} {d / t1:5.2f}  {a['code']:10.3f} "
            f"{a['prose']:6.3f}  " + " ".join(f"{x:.2f}" for x in tpp["code"])
        )
        say(
            f"{'':18s} {'':5s} ({lo:.0f}..{hi:.0f}){'':>20s} prose k=1..8 "
            + " ".join(f"{x:.2f}" for x in tpp["prose"])
        )
        best[name] = {}
        for kind in runs:
            sp = [
                tpp[kind][k - 1] * t1 / (k * d + med[("target", k + 1)])
                for k in KS
                if ("target", k + 1) in med
            ]
            kb = int(np.argmax(sp))
            best[name][kind] = (sp[kb], kb + 1)
    say()
    say(
        "expected speedup over plain target decoding, best k (tokens/pass x T(1) / "
        "(k x draft + T(k+1)))"
    )
    say(f"{'form':18s} {'code':>12s} {'prose':>12s}")
    for name, b in sorted(best.items(), key=lambda kv: -kv[1]["code"][0]):
        say(f"{name:18s} " + " ".join(f"{b[k][0]:7.2f} k={b[k][1]}" for k in ("code", "prose")))
    say(f"(tokens: code {n_tok['code']}, prose {n_tok['prose']}; T(1) {t1:.1f} ms)")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
    for m in models.values():
        m.close()


if __name__ == "__main__":
    os.environ.setdefault("EDGERUN_THREADS", "2")
    main()
