"""Time to first token in a fresh process: warm Numba cache (median of runs), or
--cold: the README's first command on an empty kernel cache, as a new user meets it.

Warm: each run starts a new Python process that imports edgerun, loads the model and
streams the first piece of an answer to a short prompt; the wall time from process
start to that piece is the figure a user waits for (interpreter exit is not counted).

--cold: runs `edgerun generate "What is the capital of France?"` (the README's first
command's generate step) with NUMBA_CACHE_DIR pointing at a new temporary directory
(no compiled kernel, no warm-up marker), then the same command again on that cache (a
warm run, for comparison). For each it reports the first token (process start -> first
byte on stdout), the total, the command's own peak RSS (its stats line), the peak of the
process tree's summed RSS (sampled every 50 ms with psutil: children included, a page
shared by two processes counted twice), each compile child's peak RSS, the CPU time of
the tree (user + sys: less sensitive to other load than wall time), the warm-up line and
the load average; and the CPU each process of the tree spent until the first token, whose
sum over the host's CPUs bounds the first token's wall time on a quiet host from below (a
busy host's wall times say little). Each compile child logs its compiles
(EDGERUN_COMPILE_LOG, tools/warm_kernels.py): --cold names the functions compiled before
the first token with their CPU seconds, by part, and any compiled by more than one process.

Usage: python benchmarks/ttft.py [-m MODEL] [-r 5]
       python benchmarks/ttft.py --cold [-m MODEL] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

CHILD = """
import sys, time
import edgerun
m = edgerun.load(sys.argv[1] if sys.argv[1] != "-" else None)
it = m.chat([{"role": "user", "content": "Hi!"}], stream=True, max_tokens=4, temperature=0)
next(it)
print("first-token", flush=True)
"""

README_PROMPT = "What is the capital of France?"
CGROUP_ROOT = Path("/sys/fs/cgroup/memory")


class MemoryGroup:
    """A cgroup v1 memory group without a limit that a run's process tree joins, to read
    what the tree holds counted once: a page shared by two processes (the interpreter's
    and LLVM's libraries) counts once, where the sum of RSS counts it in each. None from
    make() where this is not root on a cgroup v1 memory controller."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.anon_peak = 0  # sampled memory.stat rss: anonymous memory
        self.in_use_peak = 0  # sampled memory.stat rss + mapped_file

    @classmethod
    def make(cls, name: str) -> MemoryGroup | None:
        if not (CGROUP_ROOT / "cgroup.procs").exists() or os.geteuid() != 0:
            return None
        g = CGROUP_ROOT / name
        try:
            g.mkdir(exist_ok=True)
        except OSError:
            return None
        return cls(g)

    def join(self) -> None:
        """Move the calling process into the group (a child's preexec_fn, before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def sample(self) -> None:
        try:
            text = (self.path / "memory.stat").read_text()
        except OSError:  # removed as the run ended
            return
        stat = dict(line.split() for line in text.splitlines())
        self.anon_peak = max(self.anon_peak, int(stat["rss"]))
        self.in_use_peak = max(self.in_use_peak, int(stat["rss"]) + int(stat["mapped_file"]))

    def remove(self) -> None:
        """Remove the group (its processes have exited); its page cache goes to the parent."""
        try:
            (self.path / "memory.force_empty").write_text("0")
        except OSError:
            pass
        try:
            self.path.rmdir()
        except OSError as e:
            print(f"warning: cannot remove {self.path}: {e}", file=sys.stderr)


def warm_ttft(model: str, runs: int) -> None:
    subprocess.run([sys.executable, "-c", CHILD, model], check=True, capture_output=True)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        child = subprocess.Popen(
            [sys.executable, "-c", CHILD, model],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        line = child.stdout.readline()  # the moment the first piece exists, not process exit
        times.append(time.perf_counter() - t0)
        child.wait()
        if "first-token" not in line:
            raise RuntimeError(f"the child printed {line!r} instead of its first token")
    print(
        f"time to first token (fresh process, warm cache): median {statistics.median(times):.2f} s"
        f" (min {min(times):.2f}, max {max(times):.2f}, {runs} runs)"
    )


def _tree_rss(
    pid: int, cpu: dict[int, float] | None = None, peaks: dict[int, int] | None = None
) -> int:
    """The summed RSS of pid's process tree; cpu: each process's CPU seconds so far
    (user + sys) are noted in it by pid (an exited child keeps its last reading); peaks:
    each process's largest RSS sampled so far, by pid."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    total = 0
    for q in procs:
        try:
            rss = q.memory_info().rss
            total += rss
            if peaks is not None:
                peaks[q.pid] = max(peaks.get(q.pid, 0), rss)
            if cpu is not None:
                t = q.cpu_times()
                cpu[q.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def read_compile_log(path: str, until: float) -> list[dict]:
    """The compiles EDGERUN_COMPILE_LOG's file records that ended before `until` (the
    wall clock, time.time())."""
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            pid, end, depth, cpu, part, name = line.split(maxsplit=5)
            if float(end) <= until:
                rows.append(
                    dict(
                        pid=int(pid), depth=int(depth), cpu=float(cpu), part=part, name=name.strip()
                    )
                )
    return rows


def compile_summary(rows: list[dict], top: int = 12) -> list[str]:
    """Lines naming what compiled: CPU by part, the costliest functions, and functions
    that more than one process compiled (each paid for it)."""
    if not rows:
        return ["  compiles before the first token: none logged"]
    by_part: dict[str, list[float]] = {}
    for r in rows:
        by_part.setdefault(r["part"], []).append(r["cpu"])
    parts = ", ".join(f"{p} {sum(c):.1f} s/{len(c)}" for p, c in by_part.items())
    out = [
        f"  compiles before the first token: {len(rows)} ({sum(r['cpu'] for r in rows):.1f} s "
        f"CPU); by part (s/functions): {parts}"
    ]
    costly = sorted(rows, key=lambda r: -r["cpu"])[:top]
    out += [f"    {r['cpu']:5.1f} s  {r['part']:<9} {r['name']}" for r in costly]
    pids: dict[str, set] = {}
    for r in rows:
        pids.setdefault(r["name"], set()).add(r["pid"])
    twice = sorted(n for n, p in pids.items() if len(p) > 1)
    if twice:
        cost = sum(r["cpu"] for r in rows if r["name"] in twice)
        out.append(
            f"  compiled by more than one process ({cost:.1f} s CPU in all): " + ", ".join(twice)
        )
    return out


def generate_run(model: str | None, env: dict, extra: list[str]) -> dict:
    """One `edgerun generate` of the README prompt; its figures."""
    cmd = [sys.executable, "-m", "edgerun", "generate", README_PROMPT, *extra]
    if model is not None:
        cmd += ["-m", model]
    log = env.get("EDGERUN_COMPILE_LOG")
    if log is not None and os.path.exists(log):
        os.remove(log)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()
    group = MemoryGroup.make(f"edgerun-ttft-{os.getpid()}")
    join = None if group is None else group.join
    t0 = time.perf_counter()
    child = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=join
    )
    peak = [0]
    cpu: dict[int, float] = {}  # pid -> CPU seconds, sampled
    peaks: dict[int, int] = {}  # pid -> its largest RSS sampled
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(child.pid, cpu, peaks))
            if group is not None:
                group.sample()
            done.wait(0.05)

    threading.Thread(target=sample, daemon=True).start()
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(child.stderr.read()), daemon=True)
    reader.start()
    first = child.stdout.read(1)  # the first byte of the answer
    t_first = time.perf_counter() - t0
    wall_first = time.time()
    _tree_rss(child.pid, cpu)
    cpu_first = dict(cpu)  # each process's CPU until the first token
    out = first + child.stdout.read()
    rc = child.wait()
    total = time.perf_counter() - t0
    done.set()
    reader.join()
    if group is not None:
        group.remove()
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    stderr = err[0].decode(errors="replace")
    if rc != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {rc}:\n{stderr[-3000:]}")
    own = re.search(r"peak RSS: (\d+) MiB", stderr)
    warm = re.search(r"\[(warm-up: [^\]]*)\]", stderr)
    return dict(
        first_token_s=t_first,
        total_s=total,
        own_peak_mib=int(own.group(1)) if own else None,
        tree_peak_mib=peak[0] / 2**20,
        cgroup_anon_mib=None if group is None else group.anon_peak / 2**20,
        cgroup_in_use_mib=None if group is None else group.in_use_peak / 2**20,
        children_peak_mib=sorted(
            (v / 2**20 for k, v in peaks.items() if k != child.pid), reverse=True
        ),
        cpu_s=(after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        cpu_first_s=sum(cpu_first.values()),
        cpu_first_parent_s=cpu_first.get(child.pid, 0.0),
        cpu_first_children_s=sorted(
            (v for k, v in cpu_first.items() if k != child.pid), reverse=True
        ),
        warmup=warm.group(1) if warm else "",
        compiles=read_compile_log(log, wall_first) if log is not None else [],
        answer=out.decode(errors="replace").strip(),
        load=load,
        stderr=stderr,
    )


def cold_ttft(model: str | None, extra: list[str], show: bool) -> None:
    with tempfile.TemporaryDirectory(prefix="edgerun-cold-") as tmp:
        env = dict(
            os.environ,
            NUMBA_CACHE_DIR=os.path.join(tmp, "numba"),
            EDGERUN_COMPILE_LOG=os.path.join(tmp, "compiles.log"),
        )
        runs = {}
        for label in ("cold", "warm"):
            r = runs[label] = generate_run(model, env, extra)
            print(
                f"{label}: first token {r['first_token_s']:.1f} s, total {r['total_s']:.1f} s, "
                f"CPU (user+sys, all processes) {r['cpu_s']:.1f} s, "
                f"peak RSS {r['own_peak_mib']} MiB (the command), "
                f"{r['tree_peak_mib']:.0f} MiB (process tree, summed) | {r['warmup']} | "
                f"load average {r['load'][0]:.1f} on {os.cpu_count()} CPUs"
            )
            kids = ", ".join(f"{c:.1f}" for c in r["cpu_first_children_s"])
            quiet = max(r["cpu_first_s"] / (os.cpu_count() or 1), r["cpu_first_parent_s"])
            print(
                f"  until the first token: CPU {r['cpu_first_s']:.1f} s (the command "
                f"{r['cpu_first_parent_s']:.1f} s, its compile children {kids or '-'}); "
                f"on a quiet host of {os.cpu_count()} CPUs that is >= {quiet:.1f} s of wall time"
            )
            kids = ", ".join(f"{m:.0f}" for m in r["children_peak_mib"])
            print(f"  peak RSS of each compile child: {kids or '-'} MiB")
            if r["cgroup_anon_mib"] is not None:
                print(
                    f"  memory cgroup of the tree, peaks sampled every 50 ms: "
                    f"{r['cgroup_anon_mib']:.0f} MiB anonymous, "
                    f"{r['cgroup_in_use_mib']:.0f} MiB anonymous + mapped files"
                )
            if r["compiles"] or label == "cold":
                print("\n".join(compile_summary(r["compiles"])))
            print(f"  answer: {r['answer'][:100]!r}")
            if show:
                print("  stderr:\n    " + "\n    ".join(r["stderr"].strip().splitlines()))
        cold, warm = runs["cold"], runs["warm"]
        own = (
            f"{cold['own_peak_mib'] / warm['own_peak_mib']:.2f}x"
            if cold["own_peak_mib"] and warm["own_peak_mib"]
            else "-"
        )
        group = ""
        if cold["cgroup_anon_mib"] and warm["cgroup_anon_mib"]:
            group = (
                f", {cold['cgroup_anon_mib'] / warm['cgroup_anon_mib']:.2f}x (memory cgroup, "
                f"anonymous), {cold['cgroup_in_use_mib'] / warm['cgroup_in_use_mib']:.2f}x "
                "(memory cgroup, anonymous + mapped files)"
            )
        print(
            f"first run / warm run: peak RSS {own} (the command), "
            f"{cold['tree_peak_mib'] / warm['tree_peak_mib']:.2f}x (process tree, summed)"
            f"{group}"
        )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-r", "--runs", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="empty kernel cache, then warm")
    ap.add_argument("-t", "--threads", default=None, help="--cold: generate's -t")
    ap.add_argument("--show", action="store_true", help="--cold: print generate's stderr")
    args = ap.parse_args(argv)
    if args.cold:
        extra = [] if args.threads is None else ["-t", str(args.threads)]
        cold_ttft(args.model, extra, args.show)
    else:
        warm_ttft(args.model or "-", args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
