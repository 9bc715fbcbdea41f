"""A mixture-of-experts model larger than its RAM budget: routed experts streamed from
flash (offload/experts.py) against llama.cpp's mmap, each run in a memory cgroup.

For each synthetic qwen3moe file (benchmarks/make_moe_gguf.py: random routing, the
worst case for an expert cache, and Zipf-skewed routing, the realistic case) and each
budget (a share of the file), a fresh child process joins a cgroup v1 memory group of
the budget + 5% (page cache counted) after `sync; echo 3 > drop_caches`, prefills a
short prompt and decodes N tokens greedily (benchmarks/offload.py's children and cgroup
handling). Reported per run: decode tok/s, MB read per token, expert cache hit rate,
experts needed per token, I/O wait and compute ms per token, the group's peak and limit
hits, and whether it was OOM-killed; and the bound `storage bandwidth / bytes read per
token`, with the storage bandwidth measured here with direct reads of the file's own
experts (the same reader, threads and read sizes the expert stream uses).

Needs root (cgroups, drop_caches). Usage:
  python benchmarks/make_moe_gguf.py; python benchmarks/make_moe_gguf.py --zipf 1.0
  python benchmarks/moe_offload.py --cgroup [--budgets 25,40,60] [-n 32] [--rounds 1]
      [--models /work/models/qwen3moe-synth-9L-random-q4k.gguf,...] [--no-llama]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from offload import (  # noqa: E402  (benchmarks/offload.py)
    PROMPT,
    _drop_caches,
    _join_cgroup,
    _make_cgroup,
    _peak_mb,
    run_child,
    run_one,
)

MODELS = (
    "/work/models/qwen3moe-synth-9L-random-q4k.gguf",
    "/work/models/qwen3moe-synth-9L-zipf1-q4k.gguf",
)
RESULTS = Path(__file__).parent / "results"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


def storage_bandwidth(
    path: str, experts: int = 192, threads: int | None = None, seed: int = 0
) -> float:
    """Bytes/s of direct reads of random whole experts of the file (3 ranges each, one
    DirectReader call per 8 experts: a token's layer), as the expert stream reads them."""
    import numpy as np

    from edgerun.arch import spec_from_gguf
    from edgerun.formats.gguf import read_gguf
    from edgerun.offload.experts import expert_layers
    from edgerun.offload.io import IO_THREADS, DirectReader, aligned_empty

    f = read_gguf(path)
    spec = spec_from_gguf(f.metadata, path)
    layers = expert_layers(spec, f, path)
    rng = np.random.default_rng(seed)
    k = spec.n_expert_used
    buf = aligned_empty(k * layers[0].slot_bytes())
    total, seconds = 0, 0.0
    with DirectReader(path, threads=threads or IO_THREADS) as r:
        for _ in range(experts // k):
            ly = layers[int(rng.integers(len(layers)))]
            # block-aligned ranges into aligned places, as the expert cache reads them
            ranges = [
                (off, n)
                for e in rng.choice(spec.n_expert, k, replace=False)
                for off, n, _ in ly.aligned_ranges(int(e), r.size)
            ]
            t0 = time.perf_counter()
            total += r.read_into(ranges, buf)
            seconds += time.perf_counter() - t0
    return total / seconds


def measured_bandwidth(path: str, times: int = 5) -> float:
    """The median of `times` storage_bandwidth() measurements (the storage's speed drifts
    with the other work on the host)."""
    return statistics.median(storage_bandwidth(path, seed=i) for i in range(times))


def llama_child(spec: str) -> None:
    """llama.cpp (mmap) decoding greedily until `n` tokens or `seconds` of decode: under
    a small cgroup it pages experts in and out, and a token can take minutes, so it
    reports what it did in the time it had rather than nothing."""
    args = json.loads(spec)
    _join_cgroup(args.get("cgroup"))
    import llama_cpp.llama_cpp as ll
    from llama_cpp import Llama

    if not args["repack"]:
        # llama.cpp's CPU backend copies Q4_K weights into interleaved anonymous buffers
        # at load ("CPU_REPACK", on AVX2 machines): the whole model in anonymous memory,
        # which a cgroup smaller than the file OOM-kills. Off, every weight is read
        # through the mapping and paged through the page cache (mmap).
        default = ll.llama_model_default_params

        def no_repack():
            p = default()
            p.use_extra_bufts = False
            return p

        ll.llama_model_default_params = no_repack

    t0 = time.perf_counter()
    llm = Llama(args["path"], n_ctx=args["ctx"], n_threads=args["threads"], verbose=False)
    load_s = time.perf_counter() - t0
    ids = llm.tokenize(PROMPT.encode())
    t1 = time.perf_counter()
    first = last = None
    n = 0
    for _ in llm.generate(ids, temp=0.0, top_k=1):
        n += 1
        last = time.perf_counter()
        if first is None:
            first = last
        if n >= args["n"] or last - first > args["seconds"]:
            break
    out = {"load_s": load_s, "ttft_s": (first or t1) - t1, "tokens": n}
    if n > 1:
        out["tok_s"] = (n - 1) / (last - first)
    if args.get("cgroup"):
        out["run_peak_mb"] = _peak_mb(Path("/sys/fs/cgroup/memory") / args["cgroup"])
    print("RESULT " + json.dumps(out), flush=True)


def run_llama(path: str, budget: int, a) -> dict:
    """One llama.cpp child, in a memory cgroup of the budget + 5% with --cgroup."""

    name = f"edgerun-moe-llama-{os.getpid()}"
    g = _make_cgroup(name, int(budget * 1.05)) if a.cgroup else None
    _drop_caches()
    spec = {
        "path": path,
        "ctx": a.ctx,
        "n": a.llama_n,
        "seconds": a.llama_seconds,
        "threads": a.threads or os.cpu_count(),
        "repack": a.llama_repack,
        "cgroup": name if g else None,
    }
    res = run_child(__file__, "--llama-child", spec, a.timeout, g)
    if "error" not in res and "tok_s" not in res:
        res["error"] = f"{res.get('tokens', 0)} token(s) in {a.llama_seconds} s"
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--budgets", default="25,40,60", help="shares of the file, %%")
    ap.add_argument("-n", type=int, default=32, help="tokens to decode")
    ap.add_argument("--llama-n", type=int, default=16, help="tokens llama.cpp decodes")
    ap.add_argument(
        "--llama-seconds", type=float, default=90, help="llama.cpp stops decoding after this"
    )
    ap.add_argument("--llama-child", help=argparse.SUPPRESS)
    ap.add_argument(
        "--rebound", help="rewrite the report of this saved --json, storage measured now"
    )
    ap.add_argument(
        "--llama-repack",
        action="store_true",
        help="llama.cpp with its default CPU repacking of Q4_K (anonymous copies of the "
        "weights: OOM-killed in a cgroup smaller than the file); default: mmap only",
    )
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=1, help="passes over all cells (medians)")
    ap.add_argument("--timeout", type=int, default=600, help="seconds a run may take")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument(
        "--cgroup",
        action="store_true",
        help="run each child in a memory cgroup of the budget + 5%% (cgroup v1, root); "
        "without it the budgets are edgerun's promise only",
    )
    ap.add_argument("--out", default=str(RESULTS / "moe_offload.txt"))
    ap.add_argument("--plot", default=str(RESULTS / "moe_offload.png"))
    ap.add_argument("--json", default=str(RESULTS / "moe_offload.json"))
    a = ap.parse_args()
    if a.llama_child:
        llama_child(a.llama_child)
        return 0
    models = [m for m in a.models.split(",") if m]
    for m in models:
        if not Path(m).exists():
            print(f"{m}: not found; make it with benchmarks/make_moe_gguf.py", file=sys.stderr)
            return 2
    if a.rebound:  # the saved rows again, with the storage measured now
        saved = json.loads(Path(a.rebound).read_text())
        bw = measured_bandwidth(models[0])
        run_args = argparse.Namespace(**saved["args"]) if "args" in saved else a
        text = _report(saved["rows"], bw, run_args)
        Path(a.out).write_text(text)
        Path(a.json).write_text(json.dumps({**saved, "bandwidth": bw}, indent=1))
        print(text)
        _plot(saved["rows"], a.plot)
        return 0
    bw = measured_bandwidth(models[0])
    print(f"storage: {bw / 1e6:,.0f} MB/s direct reads of whole experts; CPU: {cpu_name()}")
    cells = []
    for m in models:
        for b in a.budgets.split(","):
            share = float(b)
            budget = int(os.path.getsize(m) * share / 100)
            cells.append((m, share, budget, "edgerun"))
            if not a.no_llama:
                cells.append((m, share, budget, "llama.cpp"))
    runs: dict[tuple, list[dict]] = {c: [] for c in cells}
    for rnd in range(a.rounds):
        for c in cells:
            m, share, budget, engine = c
            if engine == "llama.cpp":
                r = run_llama(m, budget, a)
            else:
                ns = argparse.Namespace(ctx=a.ctx, n=a.n, threads=a.threads, timeout=a.timeout)
                r = run_one(engine, m, budget, {"offload": None}, ns, cgroup=a.cgroup)
            r.update(model=Path(m).name, share=share, budget_mb=budget / 1e6, engine=engine)
            r["round"] = rnd
            runs[c].append(r)
            print(_line(r, bw), flush=True)
    rows = []
    for c in cells:
        ok = [r for r in runs[c] if "error" not in r]
        r = dict(ok[-1] if ok else runs[c][-1])
        for k in ("tok_s", "mb_per_token", "hit_rate", "io_ms", "compute_ms", "experts_needed"):
            vals = [x[k] for x in ok if isinstance(x.get(k), (int, float))]
            if vals:
                r[k] = statistics.median(vals)
        r["runs"] = len(runs[c])
        rows.append(r)
    bw = statistics.median([bw, measured_bandwidth(models[0])])  # before and after the runs
    text = _report(rows, bw, a)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(text)
    saved_args = {k: getattr(a, k) for k in ("n", "llama_n", "llama_seconds", "llama_repack")}
    saved_args |= {"ctx": a.ctx, "cgroup": a.cgroup, "rounds": a.rounds}
    saved = {"bandwidth": bw, "args": saved_args, "rows": rows}
    Path(a.json).write_text(json.dumps(saved, indent=1))
    print(text)
    _plot(rows, a.plot)
    return 0


def _line(r: dict, bw: float) -> str:
    def f(k, fmt="{:.1f}"):
        return fmt.format(r[k]) if isinstance(r.get(k), (int, float)) else "-"

    bound = "-"
    if isinstance(r.get("mb_per_token"), (int, float)) and r["mb_per_token"] > 0:
        bound = f"{bw / (r['mb_per_token'] * 1e6):.2f}"
    err = r.get("error", "") or r.get("note", "")
    fails = r.get("failcnt")
    return (
        f"{r['model'][:34]:<34} {r['share']:>4.0f}% {r['budget_mb']:>6.0f}M {r['engine']:<9} "
        f"{f('tok_s', '{:.2f}'):>6} {f('mb_per_token'):>7} {f('hit_rate', '{:.2f}'):>5} "
        f"{f('experts_needed', '{:.0f}'):>4} {f('io_ms'):>7} {f('compute_ms'):>7} "
        f"{bound:>6} {f('run_peak_mb', '{:.0f}'):>6} {f('max_usage_mb', '{:.0f}'):>7} "
        f"{fails if fails is not None else '-':>5} "
        f"{str(r.get('rc')):>4}  {err[:80]}"
    )


HEADER = (
    f"{'model':<34} {'share':>5} {'budget':>7} {'engine':<9} {'tok/s':>6} {'MB/tok':>7} "
    f"{'hit':>5} {'need':>4} {'io ms':>7} {'cmp ms':>7} {'bound':>6} {'run MB':>6} {'peak MB':>7} "
    f"{'fails':>5} {'rc':>4}  note"
)


def _report(rows: list[dict], bw: float, a) -> str:
    lines = [
        "MoE experts on flash under a RAM budget (benchmarks/moe_offload.py)",
        f"CPU: {cpu_name()}, {os.cpu_count()} logical CPUs (shared with other work: noisy)",
        f"storage: {bw / 1e6:,.0f} MB/s, direct reads of whole experts (3 x 0.9 MB ranges)",
        f"decode {a.n} tokens (llama.cpp {'with' if a.llama_repack else 'without'} CPU "
        f"repacking: {a.llama_n}, or what it decodes in "
        f"{a.llama_seconds:.0f} s), context {a.ctx}, "
        f"{'cgroup of budget + 5%' if a.cgroup else 'no cgroup'}, caches dropped before "
        f"each run, medians of {a.rounds} round(s)",
        "bound = storage bandwidth / MB read per token (tok/s the reads alone allow); "
        "hit = expert cache hit rate; need = experts a token routes to (all layers); "
        "run = the cgroup's peak when decoding ended; peak = memory.max_usage_in_bytes at "
        "exit (the page cache the process leaves is reclaimed at the limit); fails = "
        "memory.failcnt; rc 137/-9 = OOM-killed",
        "",
        HEADER,
    ]
    lines += [_line(r, bw) for r in rows]
    lines.append("")
    for r in rows:
        if r["engine"] != "edgerun" or not isinstance(r.get("tok_s"), (int, float)):
            continue
        ll = next(
            (
                x
                for x in rows
                if x["engine"] == "llama.cpp"
                and x["model"] == r["model"]
                and x["share"] == r["share"]
            ),
            None,
        )
        parts = [f"{r['model']} at {r['share']:.0f}%: {r['tok_s']:.2f} tok/s"]
        if isinstance(r.get("mb_per_token"), (int, float)) and r["mb_per_token"] > 0:
            bound = bw / (r["mb_per_token"] * 1e6)
            parts.append(f"{r['tok_s'] / bound:.0%} of the read bound {bound:.2f}")
        if ll and isinstance(ll.get("tok_s"), (int, float)) and ll["tok_s"] > 0:
            parts.append(f"{r['tok_s'] / ll['tok_s']:.1f}x llama.cpp ({ll['tok_s']:.2f})")
        elif ll:
            parts.append(f"llama.cpp: {ll.get('error', 'no result')}")
        lines.append("  " + "; ".join(parts))
    return "\n".join(lines) + "\n"


def _plot(rows: list[dict], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed; no plot written")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for model in sorted({r["model"] for r in rows}):
        tag = "zipf" if "zipf" in model else "random"
        for engine in ("edgerun", "llama.cpp"):
            pts = sorted(
                (r["share"], r["tok_s"], r.get("mb_per_token"))
                for r in rows
                if r["model"] == model
                and r["engine"] == engine
                and isinstance(r.get("tok_s"), (int, float))
            )
            if not pts:
                continue
            lbl = f"{engine}, {tag} routing"
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lbl)
            mb = [(p[0], p[2]) for p in pts if isinstance(p[2], (int, float))]
            if mb:
                ax2.plot([p[0] for p in mb], [p[1] for p in mb], marker="o", label=lbl)
    ax1.set(xlabel="RAM budget (% of the 3.5 GB file)", ylabel="decode tok/s", title="speed")
    ax2.set(xlabel="RAM budget (% of the file)", ylabel="MB read per token", title="flash reads")
    ax1.legend(fontsize=7)
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


if __name__ == "__main__":
    sys.exit(main())
