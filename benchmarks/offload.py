"""Offloaded decode under a RAM budget, proven from outside: each run in a memory cgroup.

For each model, budget and configuration, a fresh child process joins a cgroup v1
memory group limited to budget + 5% (page cache counted), after
`sync; echo 3 > /proc/sys/vm/drop_caches`, then prefills a short prompt and decodes
N tokens greedily. Reported: decode tok/s, MB read from flash per token, neuron-cache
hit rate, the I/O / cache-management / compute ms per token (LLM in a flash's
breakdown), the group's memory.max_usage_in_bytes and whether it was OOM-killed.

Configurations (all in the same code and I/O path):
  mmap        a load given no budget: resident where the model fits the memory left,
              else planned for what is left (offload/loader.Loader.auto_budget, dense offloading)
  mapped      the row kernels on the mapped GGUF, no budget (interleave=False): the kernel
              pages the file in and out (what `mmap` was before session 37)
  dense       --offload dense: what the budget does not hold is streamed every token
  sparse      gate-resident thresholding (or the predictor), no neuron cache
  window      sparse + windowed neuron cache
  full        sparse + window + prefetch of the next layer (every sparse config reads
              bundled [up | down] records)
  hotcold     sparse + half of each layer's cache pinned with the hottest neurons of the
              model's profile (`edgerun profile`), the other half windowed
  pinned      sparse + the whole cache pinned with the hottest neurons
  llama.cpp   llama-cpp-python (mmap) under the same limit, when installed

Needs root (cgroups, drop_caches). Usage:
  python benchmarks/offload.py -m qwen2.5-coder-1.5b --budgets 800M,560M,min \
      --configs mmap,dense,sparse,window,full,llama.cpp -n 64 -t 2 \
      --json benchmarks/results/offload.json --plot benchmarks/results/offload.png
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llamacpp_ref import llama_cpp_unusable  # noqa: E402

CGROUP_ROOT = Path("/sys/fs/cgroup/memory")
PROMPT = "Write a Python function that checks whether a number is prime."
MAPPED = {"mapped": True}
CONFIGS = {
    "mmap": None,
    "mapped": MAPPED,
    "dense": {"offload": "dense"},
    # dense, streaming every head row it does not hold (no sketch: the resident logits)
    "dense-exact": {"offload": "dense", "head_candidates": 0},
    # dense without lending the budget's unused memory to streamed rows (offload/kv_loan.py)
    "dense-noloan": {"offload": "dense", "kv_loan_tiers": 0},
    "sparse": {"offload": "sparse", "window": 0, "prefetch": False},
    "window": {"offload": "sparse", "window": 5, "prefetch": False, "hot": 0.0},
    "full": {"offload": "sparse", "window": 5, "prefetch": True, "hot": 0.0},
    # hot/cold (PowerInfer): the profile's hottest neurons pinned, the rest windowed
    "hotcold": {"offload": "sparse", "window": 5, "prefetch": False, "hot": 0.5},
    "pinned": {"offload": "sparse", "window": 5, "prefetch": False, "hot": 1.0},
}


# ----------------------------------------------------------------------------- child
def _join_cgroup(name: str | None) -> None:
    if name:
        (CGROUP_ROOT / name / "cgroup.procs").write_text(str(os.getpid()))


def _peak_mb(group: Path) -> float:
    """A memory cgroup's peak usage so far (page cache included), MB."""
    return int((group / "memory.max_usage_in_bytes").read_text()) / 1e6


def _run_peak_mb(args: dict) -> float | None:
    """The child's cgroup peak so far: the run's, before the child's bookkeeping after it
    (the planner's prediction re-reads the model's metadata and calibration)."""
    return _peak_mb(CGROUP_ROOT / args["cgroup"]) if args.get("cgroup") else None


def _child_edgerun(args: dict) -> dict:
    import edgerun

    t0 = time.perf_counter()
    kw = dict(n_ctx=args["ctx"], threads=args["threads"])
    if args["options"] == MAPPED:
        kw["interleave"] = False  # the row kernels on the mapping, and no automatic budget
    elif args["options"] is not None:
        opts = dict(args["options"])
        kw["ram_budget"] = args["budget"]
        kw["offload"] = opts.pop("offload")
        kw["offload_options"] = opts
    m = edgerun.load(args["path"], **kw)
    load_s = time.perf_counter() - t0
    ids = m.tokenize(m.render_chat([{"role": "user", "content": PROMPT}]))
    gen = m.generator
    it = m.generate(ids, max_tokens=args["n"], temperature=0.0)
    first = None
    t1 = time.perf_counter()
    n = 0
    for _ in it:
        n += 1
        if first is None:
            first = time.perf_counter()
            m.loader.reset_offload_stats()
    t2 = time.perf_counter()
    run_peak = _run_peak_mb(args)
    st = gen.stats
    decoded = max(1, st.generated_tokens - 1)
    out = {
        "load_s": load_s,
        "ttft_s": (first or t2) - t1,
        "tok_s": decoded / max(1e-9, t2 - (first or t2)),
        "tokens": st.generated_tokens,
        "decode_threads": st.threads,
        "run_peak_mb": run_peak,
    }
    s = m.loader.offload_stats()
    if s is not None:
        per = max(1, s.get("tokens", decoded))
        out.update(
            mb_per_token=s["bytes_read"] / per / 1e6,
            hit_rate=s.get("hit_rate", float("nan")),
            io_ms=1e3 * s["io_s"] / per,
            read_ms=1e3 * s.get("read_s", 0.0) / per,
            mm_ms=1e3 * s["mm_s"] / per,
            compute_ms=1e3 * s["compute_s"] / per,
            plan=s.get("plan", ""),
            pinned=s.get("pinned", 0),
            held_neurons=s.get("held_neurons"),
            lent_bytes=s.get("lent_bytes"),
        )
        for k in ("experts_needed", "expert_hits", "expert_cache"):  # experts mode
            if k in s:
                out[k] = s[k]
    if m.plan is not None:
        # The planner's prediction: device figures the parent measured at the start, and
        # the offload executors timed again here, just after this run (a few MB, direct
        # I/O), since this machine's storage speed drifts by up to 2x within minutes.
        bundle = getattr(m.store, "bundle", None)
        if bundle is not None:
            from edgerun.device.calibration import offload_figures

            offload_figures(Path(bundle.path), m.threads, refresh=True)
        pred = m.loader.predicted_plan(None, m.engine.governor.decode_reserve)
        out["predicted_tok_s"] = pred.predicted_tok_s
    return out


def _child_llamacpp(args: dict) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    from edgerun.runtime.sysinfo import default_threads

    threads = args["threads"] or default_threads()
    llm = Llama(args["path"], n_ctx=args["ctx"], n_threads=threads, verbose=False)
    load_s = time.perf_counter() - t0
    ids = llm.tokenize(PROMPT.encode())
    t1 = time.perf_counter()
    first = None
    n = 0
    for tok in llm.generate(ids, temp=0.0, top_k=1):
        n += 1
        if first is None:
            first = time.perf_counter()
        if n >= args["n"] or tok == llm.token_eos():
            break
    t2 = time.perf_counter()
    return {
        "run_peak_mb": _run_peak_mb(args),
        "load_s": load_s,
        "ttft_s": (first or t2) - t1,
        "tok_s": max(1, n - 1) / max(1e-9, t2 - (first or t2)),
        "tokens": n,
    }


def child_main(spec: str) -> None:
    args = json.loads(spec)
    _join_cgroup(args.get("cgroup"))
    fn = _child_llamacpp if args["engine"] == "llama.cpp" else _child_edgerun
    print("RESULT " + json.dumps(fn(args)), flush=True)


# ---------------------------------------------------------------------------- parent
def _drop_caches() -> None:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError as e:
        print(f"warning: cannot drop caches ({e}); runs start with a warm page cache")


def _make_cgroup(name: str, limit: int) -> Path:
    g = CGROUP_ROOT / name
    g.mkdir(exist_ok=True)
    for f in ("memory.memsw.limit_in_bytes", "memory.limit_in_bytes"):
        if (g / f).exists():
            (g / f).write_text("-1")
    (g / "memory.limit_in_bytes").write_text(str(limit))
    if (g / "memory.memsw.limit_in_bytes").exists():
        (g / "memory.memsw.limit_in_bytes").write_text(str(limit))
    (g / "memory.max_usage_in_bytes").write_text("0")
    return g


def run_one(engine: str, path: str, budget: int | None, options, a, cgroup: bool = True) -> dict:
    """One child run; with a budget, in a memory cgroup of the budget + 5% (unless
    `cgroup` is False: the budget is then edgerun's promise only)."""
    name = f"edgerun-bench-{os.getpid()}"
    g = None
    if budget is not None and cgroup:
        g = _make_cgroup(name, int(budget * 1.05))
    _drop_caches()
    spec = {
        "engine": engine,
        "path": path,
        "budget": budget,
        "options": options,
        "ctx": a.ctx,
        "n": a.n,
        "threads": a.threads,
        "cgroup": name if g else None,
    }
    return run_child(__file__, "--child", spec, a.timeout, g)


def run_child(script: str, flag: str, spec: dict, timeout: float, group: Path | None) -> dict:
    """`python script flag SPEC` (the child prints `RESULT {json}`), within `timeout`
    seconds: its result, wall time and exit status, an error where it failed (killed at
    the timeout, OOM-killed, its last stderr line), and the memory cgroup's peak and limit
    hits (the group is removed after)."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(
            [sys.executable, script, flag, json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:  # thrashing at its limit (llama.cpp at 560 MiB)
        p = None
    res: dict = {"wall_s": time.perf_counter() - t0, "rc": p and p.returncode}
    if p is None:
        res["error"] = f"no result in {timeout} s (killed)"
    else:
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                res.update(json.loads(line[7:]))
        if p.returncode != 0:
            lines = p.stderr.strip().splitlines() or [""]
            res["error"] = "OOM-killed" if p.returncode in (137, -9) else lines[-1][-300:]
    if group is not None:
        res["max_usage_mb"] = _peak_mb(group)
        res["failcnt"] = int((group / "memory.failcnt").read_text())
        for _ in range(50):  # the exited child can stay a member for a moment
            try:
                group.rmdir()
                break
            except OSError:
                time.sleep(0.1)
    return res


def _bundle_of(path: str):
    """The model's flash bundle when it exists (its first offloaded run makes it)."""
    from edgerun import registry
    from edgerun.offload.bundle import bundle_path, source_sha256

    m = registry.find_by_file(Path(path))
    p = bundle_path(path, getattr(m, "sha256", None) or source_sha256(path))
    return p if p.exists() else None


def _minimum_budget(path: str, ctx: int) -> int:
    """The smallest budget edgerun runs this model with (dense offloading's minimum,
    measured floor included)."""
    spec = {"path": path, "ctx": ctx}
    code = (
        "import json, sys; import edgerun; from edgerun.api import minimum_ram_budget; "
        f"s = json.loads({json.dumps(json.dumps(spec))}); "
        "print(minimum_ram_budget(s['path'], n_ctx=s['ctx'], mode='dense'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def _plot(rows: list[dict], out: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install edgerun[plot]); no plot written")
        return
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for model in sorted({r["model"] for r in rows}):
        for cfg in sorted({r["config"] for r in rows}):
            pts = sorted(
                (r["budget_mb"], r.get("tok_s", 0.0), r.get("mb_per_token"))
                for r in rows
                if r["model"] == model
                and r["config"] == cfg
                and r.get("budget_mb")
                and "error" not in r
                and r.get("tok_s")
            )
            if not pts:
                continue
            lbl = f"{model} {cfg}"
            ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=lbl)
            mb = [(p[0], p[2]) for p in pts if p[2] is not None]
            if mb:
                ax2.plot([p[0] for p in mb], [p[1] for p in mb], marker="o", label=lbl)
    ax1.set_yscale("log")
    ax1.set(xlabel="RAM budget (MB)", ylabel="decode tok/s (log)", title="speed under a RAM budget")
    ax2.set(xlabel="RAM budget (MB)", ylabel="MB read per token", title="flash reads")
    ax1.legend(fontsize=6)
    ax2.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    print(f"plot: {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("-m", "--models", default="qwen2.5-coder-1.5b")
    ap.add_argument("--budgets", default="800M,560M,min")
    ap.add_argument("--configs", default="mmap,dense,sparse,window,full,llama.cpp")
    ap.add_argument("-n", type=int, default=64, help="tokens to decode")
    ap.add_argument("-c", "--ctx", type=int, default=512)
    ap.add_argument(
        "-t",
        "--threads",
        type=int,
        default=None,
        help="compute threads (default: edgerun's automatic count, which leaves the "
        "offloaded weights' readers a core during decode; llama.cpp gets every CPU)",
    )
    ap.add_argument("-r", "--repeats", type=int, default=1, help="runs of a cell in a row")
    ap.add_argument(
        "--rounds", type=int, default=1, help="passes over all cells, alternated (medians)"
    )
    ap.add_argument("--timeout", type=int, default=900)
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--replot", help="only draw --plot from this saved --json file")
    a = ap.parse_args()
    if a.replot:
        _plot(json.loads(Path(a.replot).read_text()), a.plot or "offload.png")
        return
    if a.child:
        child_main(a.child)
        return
    from edgerun.api import resolve_model
    from edgerun.device.calibration import calibrate, offload_figures
    from edgerun.offload.plan import parse_budget

    # Measured now, outside the cgroups (the children read the cached figures): this
    # machine's speed drifts, so a prediction is only fair against figures of the same run.
    from edgerun.runtime.sysinfo import default_threads

    threads = a.threads or default_threads()
    calibrate(threads, refresh=True)
    if a.threads is None and threads > 1:  # dense decode steps' automatic thread count
        calibrate(threads - 1, refresh=True)
    for model in a.models.split(","):
        bundle = _bundle_of(str(resolve_model(model)))
        if bundle is not None:
            offload_figures(bundle, threads, refresh=True)
    # The calibration loaded kernels here, so this process maps LLVM's pages too, and a
    # child's MADV_PAGEOUT leaves pages another process maps: the child would free less
    # after its warm-up than a user's process does (and hold fewer rows). Give ours back.
    from edgerun.offload.io import can_page_out, page_out_large_libraries

    if can_page_out():
        page_out_large_libraries()
    why_no_llama: dict[str, str] = {}
    hdr = (
        f"{'model':<20} {'budget':>7} {'config':<9} {'tok/s':>6} {'MB/tok':>7} {'hit':>5} "
        f"{'io ms':>6} {'rd ms':>6} {'mm ms':>6} {'cmp ms':>6} {'max MB':>7} {'pred':>6} "
        f"{'meas/pred':>9}  note"
    )

    def line(r: dict) -> str:
        def f(k, fmt="{:.1f}"):
            return fmt.format(r[k]) if isinstance(r.get(k), (int, float)) else "-"

        peak = "run_peak_mb" if r.get("run_peak_mb") else "max_usage_mb"
        ratio = "-"
        if r.get("predicted_tok_s") and isinstance(r.get("tok_s"), (int, float)):
            ratio = f"{r['tok_s'] / r['predicted_tok_s']:.2f}"
        return (
            f"{r['model']:<20} {r['budget_mb']:>6.0f}M {r['config']:<9} {f('tok_s', '{:.2f}'):>6} "
            f"{f('mb_per_token'):>7} {f('hit_rate', '{:.2f}'):>5} {f('io_ms'):>6} "
            f"{f('read_ms'):>6} {f('mm_ms'):>6} {f('compute_ms'):>6} {f(peak, '{:.0f}'):>7} "
            f"{f('predicted_tok_s', '{:.2f}'):>6} {ratio:>9}  {r.get('error', '')[:100]}"
        )

    # Every cell once per round, rounds one after another: the machine's drift spreads
    # over all cells instead of landing on one; the summary takes each cell's medians.
    cells = []
    for model in a.models.split(","):
        path = str(resolve_model(model))
        for b in a.budgets.split(","):
            # the floor is measured per process and varies by a few MiB between runs
            budget = int(_minimum_budget(path, a.ctx) * 1.02) if b == "min" else parse_budget(b)
            for cfg in a.configs.split(","):
                if cfg == "llama.cpp":
                    why = llama_cpp_unusable(path)
                    if why is not None:
                        why_no_llama[model] = why
                        continue
                cells.append((model, path, b, budget, cfg))
    runs: dict[tuple, list[dict]] = {c: [] for c in cells}
    print(hdr)
    for rnd in range(a.rounds):
        if a.rounds > 1:
            print(f"-- round {rnd + 1} of {a.rounds}", flush=True)
        for c in cells:
            model, path, b, budget, cfg = c
            engine = "llama.cpp" if cfg == "llama.cpp" else "edgerun"
            for _ in range(a.repeats):
                r = run_one(engine, path, budget, CONFIGS.get(cfg), a)
                r.update(model=model, config=cfg, budget=b, budget_mb=budget / 1e6, round=rnd)
                runs[c].append(r)
                print(line(r), flush=True)
    rows = []
    for c in cells:
        ok = [r for r in runs[c] if "error" not in r]
        r = dict(ok[-1] if ok else runs[c][-1])
        for k in ("tok_s", "predicted_tok_s", "mb_per_token", "io_ms", "read_ms", "compute_ms"):
            vals = [x[k] for x in ok if isinstance(x.get(k), (int, float))]
            if vals:
                r[k] = statistics.median(vals)
        r["n_runs"] = len(ok)
        r["runs"] = runs[c]
        rows.append(r)
    if len(rows) and (a.rounds > 1 or a.repeats > 1):
        print("\nmedians of each cell's runs")
        print(hdr)
        for r in rows:
            print(line(r), flush=True)
    for model, why in why_no_llama.items():
        print(f"llama.cpp skipped for {model}: {why}")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(rows, indent=1))
    if a.plot:
        _plot(rows, a.plot)


if __name__ == "__main__":
    main()
