"""`edgerun bench --suite`: a standard matrix on the machine it runs on.

Cells: installed registry models x formats (the model's own, and packs converted to
q8_0, q4_k_m, q3_g64_m, q2_g64_m) x threads 1..n x modes (resident, and offloaded with
the default strategy at two RAM budgets: 75% and 50% of what the model needs resident,
never below its minimum), each timing pp, tg and the time to the first token of a chat
prompt. Every cell runs in a fresh child process (a clean peak RSS, one model in
memory) and its row is appended to `rows.jsonl` as soon as it is done, so an
interrupted suite resumes where it stopped. The report (`report.md`, `suite.json`,
PNG plots with the extra edgerun[plot]) is written from all rows, with the system
probe (`edgerun sysinfo`) of the machine and, with a device profile, the emulation
clearly labelled.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from edgerun.errors import EdgerunError

__all__ = ["Cell", "default_cells", "run_suite", "write_report"]

FORMATS = ("own", "q8_0", "q4_k_m", "q3_g64_m", "q2_g64_m")
BUDGET_SHARES = (0.75, 0.5)
PROMPT = "Write a Python function that checks whether a number is prime."


@dataclass(frozen=True)
class Cell:
    model: str
    fmt: str  # "own" or a convert preset
    threads: int
    mode: str  # "resident" | "budget75" | "budget50"
    n_prompt: int = 128
    n_gen: int = 128
    repeats: int = 2
    profile: str | None = None

    @property
    def key(self) -> str:
        return f"{self.model}|{self.fmt}|{self.threads}|{self.mode}|{self.profile or ''}"


def default_cells(
    models: list[str] | None = None,
    formats: tuple[str, ...] = FORMATS,
    threads: list[int] | None = None,
    n_prompt: int = 128,
    n_gen: int = 128,
    repeats: int = 2,
    profile: str | None = None,
    max_resident_bytes: int = 600 << 20,
    offload_n_gen: int = 32,
) -> list[Cell]:
    """The standard matrix. Models above `max_resident_bytes` run offloaded only and in
    their own format (converting them takes longer than the rest of the suite).
    Offloaded cells generate at most `offload_n_gen` tokens: they decode at 0.7-14 tok/s,
    so tg128 there alone would take the suite past its 30 minutes; the report's pp/tg
    column says which lengths each row ran."""
    from edgerun import registry
    from edgerun.runtime.sysinfo import default_threads

    ms = (
        [m for m in registry.manifests() if registry.is_installed(m)]
        if models is None
        else [registry.find(n) for n in models]
    )
    ts = threads or list(range(1, default_threads() + 1))
    cells = []
    for m in ms:
        big = m.size > max_resident_bytes
        for fmt in ("own",) if big else formats:
            modes = ("budget75", "budget50") if big else ("resident",)
            if fmt == "own" and not big:
                modes = ("resident", "budget75", "budget50")
            for t in ts:
                for mode in modes:
                    gen = n_gen if mode == "resident" else min(n_gen, offload_n_gen)
                    cells.append(Cell(m.name, fmt, t, mode, n_prompt, gen, repeats, profile))
    return cells


def _pack(model: str, fmt: str) -> Path:
    """The model converted to `fmt`, made once in the cache directory."""
    from edgerun.registry import cache_dir
    from edgerun.tools.convert import convert

    out = cache_dir() / "suite" / f"{model}-{fmt}"
    if not (out / "edgerun.json").exists():
        convert(model, out, quant=fmt, method="rtn", progress=False)
    return out


def run_cell(cell: Cell) -> dict:
    """One cell, in this process (the suite calls it in a child)."""
    import edgerun
    from edgerun.api import Model, resolve_model
    from edgerun.runtime.sysinfo import current_rss_bytes, peak_rss_bytes
    from edgerun.tools import bench

    src = resolve_model(cell.model) if cell.fmt == "own" else _pack(cell.model, cell.fmt)
    ctx = cell.n_prompt + cell.n_gen + 64
    kw: dict = {"n_ctx": ctx, "threads": cell.threads}
    budget = None
    if cell.mode != "resident":
        from edgerun.api import runtime_floor_bytes
        from edgerun.model.kvcache import KVCache

        probe_model = Model(Path(src), n_ctx=ctx, interleave=False)
        # Above the runtime's floor the model needs its file and KV cache resident; the
        # budget gives it a share of that, never less than the offloading minimum. The
        # floor is the one the real load below will measure (this process, now).
        need = Path(src).stat().st_size + KVCache.bytes_for(probe_model.spec, ctx, "f32")
        least = probe_model.loader.minimum_ram_budget()
        del probe_model
        share = int(cell.mode.removeprefix("budget")) / 100
        floor = runtime_floor_bytes() + (8 << 20)
        # never below the minimum plus 8%: the real load measures its floor again, a few
        # MiB above this one (Qwen2.5-0.5B at 50%: 439 MiB asked, 441 needed)
        budget = max(floor + int(share * need), int(least * 1.08))
        kw.update(ram_budget=budget, offload="dense")
    if cell.profile:
        kw["device_profile"] = cell.profile
    runtime = current_rss_bytes()
    m = edgerun.load(src, **kw)
    rep = bench.run(
        m,
        cell.n_prompt,
        cell.n_gen,
        [m.threads],
        cell.repeats,
        bandwidth=False,
        runtime_rss=runtime,
        progress=False,
        predict=False,
    )
    # a chat prompt where the model has a template; a base model (Gemma 3 270M) gets it raw
    chat = m.chat_template is not None
    ids = m.encode_chat([{"role": "user", "content": PROMPT}]) if chat else m.tokenize(PROMPT)
    t0 = time.perf_counter()
    for _ in m.generate(ids, max_tokens=1, temperature=0.0):
        break
    ttft = time.perf_counter() - t0
    rows = {r["test"][:2]: r["median"] for r in rep["rows"]}
    mod = rep.get("modelled") or {}
    modelled = {r["test"][:2]: r["tok_s"] for r in mod.get("rows", [])}
    return {
        **asdict(cell),
        "key": cell.key,
        "file_bytes": rep["size_bytes"],
        "params": rep["params"],
        "bits_per_weight": 8 * rep["size_bytes"] / max(1, rep["params"]),
        "quant": rep["quant"],
        "kernel_path": rep["kernel_path"],
        "budget_bytes": budget,
        "plan": m.plan.mode if m.plan is not None else "resident",
        "pp_tok_s": rows.get("pp"),
        "tg_tok_s": rows.get("tg"),
        "ttft_s": ttft,
        "ttft_prompt": "chat" if chat else "raw",
        "weight_bytes_per_token": rep["weight_bytes_per_token"],
        "peak_rss_bytes": peak_rss_bytes(),
        "device_profile": rep.get("device_profile"),
        "compute_scale": mod.get("compute_scale"),
        "pp_modelled_tok_s": modelled.get("pp"),
        "tg_modelled_tok_s": modelled.get("tg"),
    }


def _done(rows_file: Path) -> dict[str, dict]:
    out = {}
    if rows_file.exists():
        for line in rows_file.read_text().splitlines():
            try:
                r = json.loads(line)
                if "error" not in r:  # a failed cell runs again
                    out[r["key"]] = r
            except (ValueError, KeyError):
                continue  # a line cut by an interruption: that cell runs again
    return out


def run_suite(
    cells: list[Cell], out_dir: Path, timeout_s: int = 1800, real: list[dict] | None = None
) -> list[dict]:
    """Run the cells not yet in out_dir/rows.jsonl, each in a child; then the report
    (with a real device's rows beside, when given)."""
    from edgerun.runtime.progress import progress_bar

    out_dir.mkdir(parents=True, exist_ok=True)
    rows_file = out_dir / "rows.jsonl"
    done = _done(rows_file)
    todo = [c for c in cells if c.key not in done]
    t_start = time.perf_counter()
    with progress_bar("bench suite", len(cells), unit="cells") as advance:
        advance(len(cells) - len(todo))
        for i, c in enumerate(todo):
            elapsed = time.perf_counter() - t_start
            eta = elapsed / i * (len(todo) - i) if i else float("nan")
            advance.update(
                len(cells) - len(todo) + i,
                description=f"{c.model} {c.fmt} t{c.threads} {c.mode}"
                + (f" (ETA {eta / 60:.0f} min)" if i else ""),
            )
            r = subprocess.run(
                [sys.executable, "-m", "edgerun.tools.bench_suite", json.dumps(asdict(c))],
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
            lines = [ln for ln in r.stdout.splitlines() if ln.startswith("ROW ")]
            if r.returncode != 0 or not lines:
                err = (r.stderr.strip().splitlines() or ["no output"])[-1]
                row = {**asdict(c), "key": c.key, "error": err}
            else:
                row = json.loads(lines[-1][4:])
            with open(rows_file, "a") as f:
                f.write(json.dumps(row) + "\n")
            done[c.key] = row
        advance.update(len(cells))
    rows = [done[c.key] for c in cells if c.key in done]  # the last try of each cell
    write_report(rows, out_dir, real)
    return rows


def _table(rows: list[dict]) -> list[str]:
    scaled = any(r.get("compute_scale") for r in rows)
    lines = [
        "| model | format | bits/weight | threads | mode | pp/tg | pp tok/s | tg tok/s | "
        "TTFT s | peak RSS MiB |" + (" modelled pp / tg tok/s |" if scaled else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if scaled else ""),
    ]

    f = _num
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['model']} | {r['fmt']} | - | {r['threads']} | {r['mode']} | "
                f"| error: {r['error'][:60]} | | | |"
            )
            continue
        mode = r["mode"]
        if r.get("budget_bytes"):
            mode += f" ({r['budget_bytes'] / 2**20:.0f} MiB, {r['plan']})"
        lines.append(
            f"| {r['model']} | {r['fmt']} ({r['quant']}) | {f(r['bits_per_weight'], '{:.2f}')} "
            f"| {r['threads']} | {mode} | {r.get('n_prompt', '-')}/{r.get('n_gen', '-')} "
            f"| {f(r['pp_tok_s'])} "
            f"| {f(r['tg_tok_s'])} | "
            f"{f(r['ttft_s'], '{:.2f}')} | {f(r['peak_rss_bytes'] / 2**20, '{:.0f}')} |"
            + (
                f" {f(r.get('pp_modelled_tok_s'))} / {f(r.get('tg_modelled_tok_s'))} |"
                if scaled
                else ""
            )
        )
    return lines


def load_real_rows(path: Path) -> list[dict]:
    """Rows of a suite run on a real device: its suite.json, rows.jsonl, or a directory
    holding either (e.g. benchmarks/results/devices/rpi5/)."""
    p = Path(path)
    if p.is_dir():
        p = next((p / n for n in ("suite.json", "rows.jsonl") if (p / n).exists()), p)
    if not p.is_file():
        raise EdgerunError(f"{path}: no suite.json or rows.jsonl of a real device's suite run")
    try:
        if p.suffix == ".jsonl":
            rows = [json.loads(x) for x in p.read_text().splitlines() if x.strip()]
        else:
            rows = json.loads(p.read_text())["rows"]
    except (ValueError, KeyError, TypeError) as e:
        raise EdgerunError(f"{p}: not a suite result ({e})") from None
    need = ("model", "fmt", "threads", "mode")
    bad = [r for r in rows if not isinstance(r, dict) or any(k not in r for k in need)]
    if bad:
        raise EdgerunError(f"{p}: a row lacks one of the fields {', '.join(need)}")
    return [r for r in rows if "error" not in r]


def _num(v, fmt: str = "{:.1f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else "-"


def _real_beside(rows: list[dict], real: list[dict]) -> list[str]:
    """The real device's decode beside the emulation's, cell by cell."""
    key = ("model", "fmt", "threads", "mode")
    mine = {tuple(r[k] for k in key): r for r in rows if "error" not in r}
    lines = [
        "## Real device beside the emulation",
        "",
        "| model | format | threads | mode | real tg tok/s | emulated tg | modelled tg | "
        "real / modelled |",
        "|---|---|---|---|---|---|---|---|",
    ]
    n = 0
    for r in real:
        e = mine.get(tuple(r[k] for k in key))
        if e is None:
            continue
        n += 1
        mod = e.get("tg_modelled_tok_s")
        real_tg = r.get("tg_tok_s")
        ratio = f"{real_tg / mod:.2f}" if mod and real_tg else "-"
        lines.append(
            f"| {r['model']} | {r['fmt']} | {r['threads']} | {r['mode']} | {_num(real_tg)} | "
            f"{_num(e.get('tg_tok_s'))} | {_num(mod)} | {ratio} |"
        )
    if not n:
        lines.append("| (no cell of the real run matches this one) | | | | | | | |")
    return lines + [""]


def write_report(rows: list[dict], out_dir: Path, real: list[dict] | None = None) -> Path:
    """suite.json, report.md and (with matplotlib) plots from the rows; with `real` (a
    real device's rows, load_real_rows) a table sets them beside this run's."""
    from edgerun.device.probe import format_probe, probe

    sysp = probe()
    (out_dir / "suite.json").write_text(json.dumps({"system": sysp, "rows": rows}, indent=1))
    md = ["# edgerun bench --suite", "", "Machine (`edgerun sysinfo`):", "", "```"]
    md += format_probe(sysp).splitlines() + ["```", ""]
    emulated = {r.get("device_profile") for r in rows if r.get("device_profile")}
    for e in sorted(emulated):
        md += [
            f"**Emulated device** ({e}): threads, RAM and offloaded reads follow the "
            "profile; the compute is this machine's, a model of the device, not a "
            "measurement on it.",
            "",
        ]
    for scale in sorted({r["compute_scale"] for r in rows if r.get("compute_scale")}):
        md += [
            f"**Modelled** columns scale this machine's compute by x{scale:g} "
            f"(the profile's factor, from published figures; the rate-limited reads are "
            "kept as measured): a model of the device, not a measurement on it.",
            "",
        ]
    md += _table(rows) + [""]
    if real:
        md += _real_beside(rows, real)
    plots = _plots(rows, sysp, out_dir)
    md += [f"![{p.stem}]({p.name})" for p in plots]
    path = out_dir / "report.md"
    path.write_text("\n".join(md) + "\n")
    return path


def _plots(rows: list[dict], sysp: dict, out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []  # the report says nothing is plotted; pip install 'edgerun[plot]'
    ok = [r for r in rows if "error" not in r and r.get("tg_tok_s")]
    out = []

    def save(fig, name):
        p = out_dir / f"{name}.png"
        fig.tight_layout()
        fig.savefig(p, dpi=110)
        plt.close(fig)
        out.append(p)

    fig, ax = plt.subplots(figsize=(6, 4))
    for (model, fmt), grp in _groups(ok, ("model", "fmt"), mode="resident").items():
        grp.sort(key=lambda r: r["threads"])
        ax.plot(
            [r["threads"] for r in grp], [r["tg_tok_s"] for r in grp], "o-", label=f"{model} {fmt}"
        )
    ax.set(xlabel="threads", ylabel="decode tok/s", title="decode vs threads (resident)")
    ax.legend(fontsize=7)
    save(fig, "threads")

    tmax = max((r["threads"] for r in ok), default=1)
    fig, ax = plt.subplots(figsize=(6, 4))
    for (model,), grp in _groups(ok, ("model",), mode="resident", threads=tmax).items():
        grp.sort(key=lambda r: r["bits_per_weight"])
        ax.plot(
            [r["bits_per_weight"] for r in grp], [r["tg_tok_s"] for r in grp], "o-", label=model
        )
    ax.set(
        xlabel="bits per weight", ylabel="decode tok/s", title=f"decode vs bits ({tmax} threads)"
    )
    ax.legend(fontsize=7)
    save(fig, "bits")

    fig, ax = plt.subplots(figsize=(6, 4))
    for (model,), grp in _groups(ok, ("model",), fmt="own", threads=tmax).items():
        pts = sorted(
            ((r.get("budget_bytes") or r["peak_rss_bytes"]) / 2**20, r["tg_tok_s"]) for r in grp
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=model)
    ax.set(xlabel="RAM budget MiB (resident: its peak RSS)", ylabel="decode tok/s")
    ax.set_title("decode vs RAM budget")
    ax.legend(fontsize=7)
    save(fig, "budget")

    bw = sysp.get("bandwidth_bytes_per_s", {})
    fig, ax = plt.subplots(figsize=(6, 4))
    res = [r for r in ok if r["mode"] == "resident"]
    ax.scatter(
        [r["threads"] for r in res],
        [r["weight_bytes_per_token"] * r["tg_tok_s"] / 1e9 for r in res],
        label="achieved (weights/token x tok/s)",
    )
    if bw:
        ts = sorted(int(t) for t in bw)
        ax.plot(ts, [bw[str(t)] / 1e9 for t in ts], "k--", label="measured bandwidth")
    ax.set(xlabel="threads", ylabel="GB/s", title="roofline")
    ax.legend(fontsize=7)
    save(fig, "roofline")
    return out


def _groups(rows: list[dict], by: tuple[str, ...], **where) -> dict:
    out: dict = {}
    for r in rows:
        if all(r.get(k) == v for k, v in where.items()):
            out.setdefault(tuple(r[k] for k in by), []).append(r)
    return out


if __name__ == "__main__":  # one cell, in a child: python -m edgerun.tools.bench_suite CELL_JSON
    try:
        row = run_cell(Cell(**json.loads(sys.argv[1])))
    except EdgerunError as e:
        print(f"edgerun: error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print("ROW " + json.dumps(row), flush=True)
