"""Speculative decoding: decode tok/s, acceptance and tokens per pass with and without a
draft, on the same loaded model, the same prompts, alternating runs (the host is shared
and noisy: medians over rounds), and the greedy output checked equal token for token.

Modes:
- speed (default): for each --case "TARGET:DRAFT:PROMPTS" (DRAFT: ngram, a registry
  name or path; PROMPTS: edit, code, prose) each round runs every prompt without a draft
  and with it, alternating; reports the medians of decode tok/s, the acceptance and the
  tokens per pass, and the speed-up (median of each round's ratio). --llama adds
  llama.cpp (llama-cpp-python) on the same prompt ids, without a draft and with its
  prompt-lookup decoding (LlamaPromptLookupDecoding) for n-gram cases, or its speculation
  with the same draft file (a LlamaDraftModel over a second Llama) for model drafts.
- --equality: every registry model x --tokens greedy tokens x the prompts of every kind,
  without a draft, with n-gram and with a model draft (qwen2.5-coder-0.5b for the 1.5B,
  the model itself for the others); any difference fails the run (exit 1).

Usage:
  python benchmarks/speculative.py [--case qwen2.5-coder-1.5b:ngram:edit ...] [-n 128]
      [-r 3] [-t 2] [--llama] [--ram-budget 800M [--cgroup]] [--json out.json]
  python benchmarks/speculative.py --equality [-n 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

CODE = """def compute_total(items, tax_rate):
    subtotal = 0
    for item in items:
        subtotal += item.price * item.quantity
    discount = 0
    if subtotal > 100:
        discount = subtotal * 0.05
    tax = (subtotal - discount) * tax_rate
    total = subtotal - discount + tax
    return round(total, 2)


def format_receipt(items, tax_rate):
    lines = []
    for item in items:
        lines.append(f"{item.name}: {item.quantity} x {item.price:.2f}")
    lines.append(f"Total: {compute_total(items, tax_rate):.2f}")
    return "\\n".join(lines)
"""

JSON_DOC = """{"users": [{"id": 1, "name": "Alice", "email": "alice@example.com", "active": true},
 {"id": 2, "name": "Bob", "email": "bob@example.com", "active": false},
 {"id": 3, "name": "Carol", "email": "carol@example.com", "active": true}]}"""

PROMPTS = {
    # continuations already in the prompt: n-gram drafts pay here
    "edit": [
        f"Rewrite this code with subtotal renamed to base_amount. Output only the code.\n\n{CODE}",
        f"Add type hints to every function in this code. Output only the code.\n\n{CODE}",
        f"Rewrite this JSON with the email field renamed to mail. Output only JSON.\n\n{JSON_DOC}",
    ],
    # new code: a draft model pays here
    "code": [
        "Write a Python function that parses an ISO 8601 date string without libraries.",
        "Write a Python class for a least-recently-used cache with get and put methods.",
        "Write a Python function that merges overlapping intervals, with a docstring.",
    ],
    # nothing to look up: the adaptive length must back off
    "prose": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain why the sky is blue to a ten year old.",
        "Describe the history of the bicycle in a few paragraphs.",
    ],
}

MODELS = ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"]
DEFAULT_CASES = [
    "qwen2.5-coder-1.5b:ngram:edit",
    "qwen2.5-coder-1.5b:qwen2.5-coder-0.5b:code",
    "qwen2.5-coder-0.5b:ngram:prose",
    "smollm2-135m:ngram:prose",
]


def _ids(model, prompt: str) -> list[int]:
    if model.chat_template:
        return model.encode_chat([{"role": "user", "content": prompt}])
    return model.tokenize(prompt)


def _ours(model, ids: list[int], n: int, draft) -> tuple[list[int], dict]:
    """Greedy decode of n tokens (EOS ends it); the tokens and the stats."""
    text = "".join(model.generate(ids, max_tokens=n, temperature=0.0, repeat_penalty=1.0,
                                  draft=draft))  # fmt: skip
    st = model.stats
    out = list(model.generator.cache.tokens[len(ids) :])
    return out, dict(
        text=text,
        tokens=st.generated_tokens,
        tps=st.generate_tps,
        acceptance=st.acceptance_rate,
        per_pass=st.tokens_per_pass,
        drafted=st.draft_tokens,
    )


def _llama(llm, ids: list[int], n: int) -> dict:
    """llama.cpp's greedy decode tok/s: tokens after the first over the time after it."""
    llm.reset()
    t_first, count = None, 0
    for _ in llm.create_completion(ids, max_tokens=n, temperature=0.0, top_k=1,
                                   repeat_penalty=1.0, stream=True):  # fmt: skip
        count += 1
        if t_first is None:
            t_first = time.perf_counter()
    dt = time.perf_counter() - t_first if t_first else 0.0
    return dict(tokens=count, tps=(count - 1) / dt if dt > 0 and count > 1 else 0.0)


def _llama_model_draft(path, k: int, threads: int, n_ctx: int):
    """llama-cpp-python's speculation with a draft model: a LlamaDraftModel that decodes k
    tokens greedily with another Llama after the text so far (Llama.generate reuses the
    longest cached prefix, as our ModelDrafter does)."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel

    class ModelDraft(LlamaDraftModel):
        def __init__(self) -> None:
            self.llm = Llama(model_path=str(path), n_ctx=n_ctx, n_threads=threads,
                             n_threads_batch=threads, verbose=False)  # fmt: skip

        def __call__(self, input_ids, /, **kwargs):
            import numpy as np

            out = []
            for tok in self.llm.generate(input_ids.tolist(), top_k=1, temp=0.0,
                                         repeat_penalty=1.0, reset=True):  # fmt: skip
                out.append(tok)
                if len(out) == k:
                    break
            return np.array(out, dtype=np.intc)

    return ModelDraft()


def _load(name: str, threads: int, ram_budget: str | None, n_ctx: int):
    import edgerun

    kw = {} if ram_budget is None else dict(ram_budget=ram_budget)
    m = edgerun.load(name, n_ctx=n_ctx, threads=threads, **kw)
    m.warm_up(("tokenizer", "prompt", "gemm", "decode", "batch"))
    return m


def speed(args) -> list[dict]:
    results = []
    loaded: dict[str, object] = {}
    for case in args.case:
        target, draft, kind = case.split(":")
        model = loaded.get(target)
        if model is None:
            model = loaded[target] = _load(target, args.threads, args.ram_budget, args.ctx)
        spec = model.speculation(draft, args.num_draft_tokens)
        spec.length.adaptive = not args.fixed
        if hasattr(spec.drafter, "engine"):
            spec.drafter.engine.warm_up(("prompt", "decode"))
        llms = {}
        if args.llama:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            base = dict(model_path=str(model.path), n_ctx=args.ctx, n_threads=args.threads,
                        n_threads_batch=args.threads, verbose=False)  # fmt: skip
            llms["llama.cpp"] = Llama(**base)
            if draft == "ngram":
                llms["llama.cpp+lookup"] = Llama(
                    **base, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=10)
                )
            else:  # the same draft file, k = our longest model draft
                k = spec.length.max_tokens
                path = spec.drafter.owner.path
                if path.is_dir():  # an edgerun pack (a draft form): llama.cpp gets its source GGUF
                    path = json.loads((path / "edgerun.json").read_text())["source"]["path"]
                llms["llama.cpp+draft"] = Llama(
                    **base, draft_model=_llama_model_draft(path, k, args.threads, args.ctx)
                )
        rows: dict[str, list[dict]] = {"none": [], "draft": [], **{k: [] for k in llms}}
        ratios, mismatches = [], 0
        for r in range(args.rounds):
            for p in PROMPTS[kind]:
                ids = _ids(model, p)
                # alternate which goes first each round
                order = ["none", "draft"] if r % 2 == 0 else ["draft", "none"]
                got = {}
                for which in order:
                    d = spec if which == "draft" else "none"
                    got[which] = _ours(model, ids, args.tokens, d)
                for name, llm in llms.items():
                    rows[name].append(_llama(llm, ids, args.tokens))
                mismatches += got["none"][0] != got["draft"][0]
                for which in ("none", "draft"):
                    rows[which].append(got[which][1])
                if got["none"][1]["tps"] > 0:
                    ratios.append(got["draft"][1]["tps"] / got["none"][1]["tps"])
                print(f"  round {r} {p[:40]!r}: none {got['none'][1]['tps']:.1f} tok/s, "
                      f"draft {got['draft'][1]['tps']:.1f} tok/s, accept "
                      f"{got['draft'][1]['acceptance']:.2f}, {got['draft'][1]['per_pass']:.2f}"
                      " tok/pass", file=sys.stderr, flush=True)  # fmt: skip

        def med(name, key, rows=rows):
            return statistics.median(x[key] for x in rows[name]) if rows[name] else 0.0

        res = dict(
            case=case,
            fixed=args.fixed,
            tokens=args.tokens,
            rounds=args.rounds,
            threads=args.threads,
            ram_budget=args.ram_budget,
            none_tps=med("none", "tps"),
            draft_tps=med("draft", "tps"),
            speedup=statistics.median(ratios) if ratios else 0.0,
            acceptance=med("draft", "acceptance"),
            tokens_per_pass=med("draft", "per_pass"),
            greedy_mismatches=mismatches,
            **{f"{k}_tps": med(k, "tps") for k in llms},
        )
        results.append(res)
        line = (
            f"{case}: none {res['none_tps']:.2f} tok/s, draft {res['draft_tps']:.2f} tok/s, "
            f"x{res['speedup']:.2f}, acceptance {res['acceptance']:.2f}, "
            f"{res['tokens_per_pass']:.2f} tok/pass, greedy mismatches {mismatches}"
        )
        for k in llms:
            line += f", {k} {res[k + '_tps']:.2f} tok/s"
        print(line, flush=True)
        spec.close()
    return results


def equality(args) -> list[dict]:
    results = []
    for name in MODELS:
        model = _load(name, args.threads, args.ram_budget, args.ctx)
        drafts = ["ngram", "qwen2.5-coder-0.5b" if name == "qwen2.5-coder-1.5b" else model]
        for kind, prompts in PROMPTS.items():
            for p in prompts[:2]:
                ids = _ids(model, p)
                plain, st0 = _ours(model, ids, args.tokens, "none")
                for d in drafts:
                    spec = model.speculation(d, args.num_draft_tokens)
                    got, st = _ours(model, ids, args.tokens, spec)
                    res = dict(model=name, kind=kind, draft=spec.name, tokens=len(plain),
                               equal=got == plain, acceptance=st["acceptance"],
                               per_pass=st["per_pass"])  # fmt: skip
                    results.append(res)
                    print(json.dumps(res), flush=True)
        for s in list((model._drafts or {}).values()):
            s.close()
    bad = [r for r in results if not r["equal"]]
    print(f"greedy equality: {len(results) - len(bad)}/{len(results)} runs equal", flush=True)
    return results


def in_cgroup(args: argparse.Namespace) -> int:
    """Run this script again, without --cgroup, as the only process of a new memory cgroup
    limited to the RAM budget + 5% (page cache included), after dropping the caches; report
    the group's peak, its limit hits and the exit status (137: OOM-killed)."""
    import os
    import subprocess

    from offload import _drop_caches, _make_cgroup  # benchmarks/offload.py

    from edgerun.offload.plan import parse_budget

    if args.ram_budget is None:
        print("--cgroup needs --ram-budget", file=sys.stderr)
        return 2
    limit = int(parse_budget(args.ram_budget) * 1.05)
    group = _make_cgroup(f"edgerun-speculative-{os.getpid()}", limit)
    _drop_caches()
    argv = [sys.executable, *[a for a in sys.argv if a != "--cgroup"]]

    def join() -> None:
        (group / "cgroup.procs").write_text(str(os.getpid()))

    rc = subprocess.run(argv, preexec_fn=join).returncode
    peak = int((group / "memory.max_usage_in_bytes").read_text())
    hits = int((group / "memory.failcnt").read_text())
    print(
        f"cgroup: limit {limit >> 20} MiB, peak {peak >> 20} MiB, limit hits {hits}, exit {rc}"
        + (" (OOM-killed)" if rc in (137, -9) else ""),
        flush=True,
    )
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", default=None, help="TARGET:DRAFT:PROMPTS")
    ap.add_argument("-n", "--tokens", type=int, default=128)
    ap.add_argument("-r", "--rounds", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("-c", "--ctx", type=int, default=1024)
    ap.add_argument("--num-draft-tokens", type=int, default=None)
    ap.add_argument("--ram-budget", default=None)
    ap.add_argument("--fixed", action="store_true", help="always draft the longest length")
    ap.add_argument("--llama", action="store_true", help="add llama.cpp (llama-cpp-python)")
    ap.add_argument("--equality", action="store_true", help="greedy equality on every model")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--cgroup",
        action="store_true",
        help="with --ram-budget: run in a memory cgroup of the budget + 5%% (cgroup v1, root), "
        "caches dropped first, so the budget is proven from outside; prints its peak",
    )
    args = ap.parse_args()
    if args.cgroup:
        return in_cgroup(args)
    if args.equality:
        results = equality(args)
        ok = all(r["equal"] for r in results)
    else:
        args.case = args.case or DEFAULT_CASES
        results = speed(args)
        ok = all(r["greedy_mismatches"] == 0 for r in results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
