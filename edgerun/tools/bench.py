"""`edgerun bench`: llama-bench style prefill (pp) and decode (tg) throughput.

Load and first-run JIT/cache time are reported apart from the timed runs.
Each test is repeated; the table gives the median and half the min-max spread.
A roofline line relates decode speed to the machine's measured memory
bandwidth: weight bytes read per token x tok/s / bandwidth.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy as np

from edgerun.api import Model
from edgerun.device.bandwidth import measure_bandwidth
from edgerun.model.kvcache import KVCache
from edgerun.ops.qmatvec import kernel_path, uses_amx
from edgerun.runtime.cpu_share import set_threads
from edgerun.runtime.progress import progress_bar
from edgerun.runtime.sysinfo import peak_rss_bytes


@dataclass
class BenchRow:
    threads: int
    test: str
    samples: list[float] = field(default_factory=list)  # tok/s per repetition
    io_s: list[float] = field(default_factory=list)  # offload read wait per token, per run

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        return (max(self.samples) - min(self.samples)) / 2


def _io_seconds(model: Model) -> float:
    st = model.loader.offload_stats()
    return float(st["io_s"]) if st else 0.0


def modelled_tok_s(tok_s: float, io_s_per_token: float, compute_scale: float) -> float:
    """A device profile's modelled tok/s: the compute part of a token's time divided by
    the profile's factor, the (already rate-limited) read wait kept as measured."""
    t = 1.0 / tok_s
    io = min(max(io_s_per_token, 0.0), t)
    return 1.0 / ((t - io) / compute_scale + io)


def weight_bytes_per_token(model: Model) -> int:
    """Bytes of weights a dense decode step streams: every layer matrix plus the output
    head, as the model file stores them (wherever the plan put them)."""
    tr, spec = model.transformer, model.spec
    total = tr.output.nbytes
    for i, layer in enumerate(tr.layers):
        total += sum(getattr(layer, s).nbytes for s in ("q", "k", "v", "o"))
        for role in ("ffn_gate", "ffn_up", "ffn_down"):
            total += model.file.tensor(spec.layer_tensor(role, i)).nbytes
    return total


def _time_prefill(model: Model, n: int, rng: np.random.Generator) -> float:
    ids = rng.integers(0, model.spec.vocab_size, n).tolist()
    cache = model.transformer.new_cache(n, model.kv_type)
    t0 = time.perf_counter()
    for i in range(0, n, 256):
        model.transformer.forward(ids[i : i + 256], cache)
    return n / (time.perf_counter() - t0)


def _time_decode(model: Model, n: int, rng: np.random.Generator, depth: int = 0) -> float:
    """Decode tok/s for n tokens after `depth` tokens already in the cache (untimed)."""
    cache = model.transformer.new_cache(depth + n + 1, model.kv_type)
    ids = rng.integers(0, model.spec.vocab_size, depth).tolist()
    for i in range(0, depth, 256):
        model.transformer.forward(ids[i : i + 256], cache)
    tok = int(rng.integers(0, model.spec.vocab_size))
    t0 = time.perf_counter()
    for _ in range(n):
        logits = model.transformer.forward([tok], cache)
        tok = int(np.argmax(logits))
    return n / (time.perf_counter() - t0)


# The text `--draft-model` decodes (with and without the draft): an edit of code in the
# prompt, where n-gram drafts find their continuations and a draft model agrees often
DRAFT_PROMPT = """Rewrite this code with total renamed to amount. Output only the code.

def order_total(lines, shipping):
    total = 0
    for line in lines:
        total += line.price * line.count
    if total > 50:
        shipping = 0
    total = total + shipping
    return total
"""


def _text_decoder(draft: str, seen: list) -> Callable[[Model, int, np.random.Generator], float]:
    """A timer of greedy decode tok/s on DRAFT_PROMPT with `draft` ("none": without);
    each run's stats go to `seen`."""

    def timer(model: Model, n: int, rng: np.random.Generator) -> float:
        text = [{"role": "user", "content": DRAFT_PROMPT}]
        ids = model.encode_chat(text) if model.chat_template else model.tokenize(DRAFT_PROMPT)
        model.generator.cache.clear()
        for _ in model.generate(ids, max_tokens=n, temperature=0.0, draft=draft):
            pass
        seen.append(model.stats)
        return model.stats.generate_tps

    return timer


def run(
    model: Model,
    n_prompt: int = 128,
    n_gen: int = 128,
    threads: list[int] | None = None,
    repeats: int = 5,
    bandwidth: bool = True,
    runtime_rss: int | None = None,
    progress: bool = True,
    predict: bool = True,
    draft: str | None = None,
) -> dict:
    """Run the pp/tg sweep and return a JSON-able report.

    runtime_rss: RSS measured before the model was loaded (interpreter, numpy,
    Numba), so the report can say how much of the peak the model itself costs.
    progress: a line (or bar) per timed run on stderr, never on stdout with the report.
    predict: add the placement planner's predicted decode tok/s per thread count (from
    calibrated device figures, device/calibration.py) to set against the measurement.
    draft: speculative decoding's drafter (as load's draft_model): adds greedy decode of
    a text (DRAFT_PROMPT) without it ("text" rows) and with it ("+draft" rows), and the
    drafts' acceptance and tokens per pass.
    """
    # Without a thread list, decode is timed on the threads `generate` decodes with: one
    # fewer where a streamed model leaves its reader a core (ThreadGovernor.decode_reserve)
    reserve = model.engine.governor.decode_reserve if threads is None else 0
    threads = threads or [model.threads]
    rng = np.random.default_rng(0)
    set_threads(threads[0])
    warm = model.warm_up()  # JIT compile or cache load, kept out of every timed run
    rows: list[BenchRow] = []
    tests = [(f"pp{n_prompt}", _time_prefill, n_prompt), (f"tg{n_gen}", _time_decode, n_gen)]
    drafted: list = []
    if draft is not None and n_gen:
        model.speculation(draft)  # load a draft model before the timed runs
        tests += [(f"tg{n_gen} text", _text_decoder("none", []), n_gen),
                  (f"tg{n_gen} text+draft", _text_decoder(draft, drafted), n_gen)]  # fmt: skip
    tests = [x for x in tests if x[2]]
    total = len(threads) * len(tests) * repeats
    with progress_bar("bench", total, unit="runs", enabled=progress) as advance:
        for t in threads:
            set_threads(t)
            _time_decode(model, 4, rng)  # warm the thread pool and caches
            for name, timer, n in tests:
                tn = max(1, t - reserve) if timer is _time_decode else t
                set_threads(tn)
                row = BenchRow(tn, name)
                for _ in range(repeats):
                    io0 = _io_seconds(model)
                    row.samples.append(timer(model, n, rng))
                    row.io_s.append((_io_seconds(model) - io0) / n)
                    advance(1, description=f"bench {name}, {t} threads")
                rows.append(row)
    wbytes = weight_bytes_per_token(model)
    peak_rss = peak_rss_bytes()  # before the bandwidth probe's buffer
    from edgerun.device.probe import probe

    system = probe()  # the machine these figures are from (cached; measured once)
    predicted = {}
    if predict:
        for t in sorted({r.threads for r in rows if r.test.startswith("tg")}):
            p = model.loader.predicted_plan(t, model.engine.governor.decode_reserve)
            predicted[str(t)] = {
                "tok_s": p.predicted_tok_s,
                "mode": p.mode,
                "split_s": p.time_split,
                "gpu_layers": len(p.gpu_ffn_layers),
            }
    bw = {t: measure_bandwidth(t) for t in sorted({r.threads for r in rows})} if bandwidth else {}
    prof = model.loader.device_profile
    modelled = None
    if prof is not None and prof.compute_scale:
        modelled = {
            "compute_scale": prof.compute_scale,
            "note": prof.compute_note,
            "rows": [
                {
                    "threads": r.threads,
                    "test": r.test,
                    "tok_s": modelled_tok_s(
                        r.median, statistics.median(r.io_s) if r.io_s else 0.0, prof.compute_scale
                    ),
                }
                for r in rows
            ],
        }
    set_threads(model.threads)
    formats = Counter()
    for name in model.file.tensor_names():
        t = model.file.tensor(name)
        formats[t.qtype.name] += t.rows * t.cols
    n_params = sum(formats.values())
    return {
        "model": model.path.name,
        "size_bytes": model.file.file_size,
        "params": n_params,
        "quant": "/".join(f for f, _ in formats.most_common()),
        "kernel_path": kernel_path(),
        "amx_prefill": uses_amx(),
        "interleaved_bytes": model.loader.interleaved_bytes,
        "interleave_note": model.loader.interleave_note,
        "auto_budget_note": model.loader.auto_budget_note,
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY") or "default",
        "load_seconds": model.load_seconds,
        "peak_rss_bytes": peak_rss,
        "runtime_rss_bytes": runtime_rss,
        "kv_bytes": KVCache.bytes_for(model.spec, max(n_prompt, n_gen + 1), model.kv_type),
        "first_run_seconds": warm.seconds,
        "kernels_compiled": warm.compiled,
        "weight_bytes_per_token": wbytes,
        "bandwidth_bytes_per_s": {str(t): b for t, b in bw.items()},
        "predicted": predicted,
        "system": system,
        "device_profile": prof.describe() if prof else None,
        "modelled": modelled,
        "offload": model.loader.offload_stats(),
        "gpu": [g.describe() for g in model.loader.gpu_placement or []],
        "rows": [{**asdict(r), "median": r.median, "spread": r.spread} for r in rows],
        "draft": None
        if not drafted
        else {
            "name": draft,
            "acceptance": statistics.median(s.acceptance_rate for s in drafted),
            "tokens_per_pass": statistics.median(s.tokens_per_pass for s in drafted),
        },
    }


def _memory_line(rep: dict) -> str:
    mib = 2**20
    peak, kv, size = rep["peak_rss_bytes"], rep["kv_bytes"], rep["size_bytes"]
    line = (
        f"peak RSS {peak / mib:.0f} MiB = {peak / (size + kv):.2f}x (file {size / mib:.0f} MiB + "
        f"KV cache {kv / mib:.1f} MiB)"
    )
    floor = rep.get("runtime_rss_bytes")
    if floor:
        line += (
            f"; runtime before load {floor / mib:.0f} MiB, above it "
            f"{(peak - floor) / mib:.0f} MiB = {(peak - floor) / (size + kv):.2f}x"
        )
    return line


def format_table(rep: dict) -> str:
    lines = [
        "| model | size | params | quant | threads | test | t/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rep["rows"]:
        lines.append(
            f"| {rep['model']} | {rep['size_bytes'] / 2**20:.1f} MiB | "
            f"{rep['params'] / 1e6:.1f} M | {rep['quant']} | {r['threads']} | {r['test']} | "
            f"{r['median']:.1f} ± {r['spread']:.1f} |"
        )
    lines.append("")
    compiled = rep.get("kernels_compiled")
    how = f"{compiled} functions compiled" if compiled else "kernels loaded from cache"
    lines.append(
        f"load {rep['load_seconds']:.2f} s; first run ({how}) "
        f"{rep['first_run_seconds']:.2f} s; kernels {rep['kernel_path']}"
        f"{' (prefill on AMX tiles)' if rep.get('amx_prefill') else ''}, OpenMP wait "
        f"{rep['omp_wait_policy']}"
    )
    if rep.get("interleaved_bytes"):
        lines.append(
            f"decode reads interleaved copies ({rep['interleaved_bytes'] / 2**20:.0f} MiB)"
        )
    elif rep.get("interleave_note"):
        lines.append(rep["interleave_note"])
    if rep.get("auto_budget_note"):
        lines.append(rep["auto_budget_note"])
    lines.append(_memory_line(rep))
    wb = rep["weight_bytes_per_token"]
    for r in rep["rows"]:
        bw = rep["bandwidth_bytes_per_s"].get(str(r["threads"]))
        if r["test"].startswith("tg") and bw:
            used = wb * r["median"]
            lines.append(
                f"roofline ({r['threads']} threads): {wb / 1e6:.1f} MB weights/token x "
                f"{r['median']:.1f} tok/s = {used / 1e9:.1f} GB/s of {bw / 1e9:.1f} GB/s measured "
                f"({100 * used / bw:.0f}%; bound {bw / wb:.0f} tok/s)"
            )
    for r in rep["rows"]:
        pr = rep.get("predicted", {}).get(str(r["threads"]))
        if r["test"].startswith("tg") and pr:
            split = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in pr["split_s"].items())
            lines.append(
                f"predicted ({pr['mode']} plan, {r['threads']} threads): "
                f"{pr['tok_s']:.1f} tok/s vs {r['median']:.1f} measured "
                f"(measured/predicted {r['median'] / pr['tok_s']:.2f}; predicted ms: {split})"
            )
    d = rep.get("draft")
    if d:
        lines.append(
            f"draft {d['name']}: acceptance {100 * d['acceptance']:.0f}%, "
            f"{d['tokens_per_pass']:.2f} tokens/pass (medians of the text+draft runs)"
        )
    for g in rep.get("gpu") or []:
        lines.append(f"gpu: {g}")
    if rep.get("device_profile"):
        lines.append(
            f"EMULATED device ({rep['device_profile']}). Threads, RAM and offloaded reads "
            "follow the profile; the compute is this machine's, not the device's."
        )
    mod = rep.get("modelled")
    if mod:
        figs = ", ".join(
            f"{r['test']} {r['tok_s']:.1f} tok/s ({r['threads']} threads)" for r in mod["rows"]
        )
        lines.append(
            f"MODELLED on the device (compute x{mod['compute_scale']:g}, a model, not a "
            f"measurement: {mod['note']}): {figs}"
        )
    sysp = rep.get("system")
    if sysp:
        c = sysp["cpu"]
        lines.append(
            f"machine: {c['model']}, {c['usable_cores']} cores, {', '.join(c['simd'])}; "
            f"{sysp['memory']['total_bytes'] / 2**30:.1f} GiB (`edgerun sysinfo`)"
        )
    return "\n".join(lines)
