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
busy host's wall times say little).

A summed RSS counts a page that two processes share (the interpreter's and Numba's
libraries, a forked parent's heap) once per process, and per-process peaks at different
moments add up to more than was ever resident at once. So --cold also reports the tree's
summed PSS (proportional set size: a shared page split between its sharers; sampled with
the RSS sum) and, where this runs as root on a cgroup v1 memory controller, each run in a
memory cgroup of its own (no limit) whose memory.max_usage_in_bytes is the peak of the
memory the tree made resident, counted once, measured by the kernel: page cache included,
so the page cache is dropped before each run (cold and warm read the model and libraries
from disk alike; --no-drop-caches keeps it); the cgroup's anonymous + mapped-file peak
(memory.stat rss + mapped_file, sampled) leaves out the page cache the run only wrote or
read (the kernel cache files a cold run writes), and its anonymous peak (memory.stat rss)
is the part no other process on the host shares: on a busy host the file pages a run maps
may be charged to whichever group read them first, and a PSS shrinks with every process
outside the tree that maps the same libraries, so compare those within one run.

Usage: python benchmarks/ttft.py [-m MODEL] [-r 5]
       python benchmarks/ttft.py --cold [-m MODEL] [--threads N] [--no-drop-caches]
                                 [--limit 1.3]
--limit RATIO then makes a third run: a first run on a new empty cache in a memory cgroup
limited to RATIO x the warm run's cgroup peak, where the first run's compile plan
(offload/warm_kernels.compile_plan) sees that memory is short.
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


def _pss(pid: int) -> int:
    """pid's proportional set size in bytes (0 where /proc does not say)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree_rss(
    pid: int, cpu: dict[int, float] | None = None, peaks: dict[int, int] | None = None
) -> tuple[int, int]:
    """The summed RSS and PSS of pid's process tree; cpu: each process's CPU seconds so
    far (user + sys) are noted in it by pid (an exited child keeps its last reading);
    peaks: each process's largest RSS sampled so far, by pid."""
    import psutil

    try:
        p = psutil.Process(pid)
        procs = [p, *p.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0, 0
    total = pss = 0
    for q in procs:
        try:
            rss = q.memory_info().rss
            total += rss
            pss += _pss(q.pid)
            if peaks is not None:
                peaks[q.pid] = max(peaks.get(q.pid, 0), rss)
            if cpu is not None:
                t = q.cpu_times()
                cpu[q.pid] = t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total, pss


class MemoryGroup:
    """A cgroup v1 memory group without a limit that a run's process tree joins, to read
    the peak of what the tree made resident, counted once (None from make() where this
    is not root on a cgroup v1 memory controller)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.in_use_peak = 0  # sampled memory.stat rss + mapped_file
        self.anon_peak = 0  # sampled memory.stat rss: anonymous memory, counted once

    @classmethod
    def make(cls, name: str, limit: int | None = None) -> MemoryGroup | None:
        """The group (limit: its memory limit in bytes, swap included where the kernel
        counts it; None: none)."""
        if not (CGROUP_ROOT / "cgroup.procs").exists() or os.geteuid() != 0:
            return None
        g = CGROUP_ROOT / name
        try:
            g.mkdir(exist_ok=True)
            if limit is not None:
                (g / "memory.limit_in_bytes").write_text(str(limit))
                if (g / "memory.memsw.limit_in_bytes").exists():
                    (g / "memory.memsw.limit_in_bytes").write_text(str(limit))
            (g / "memory.max_usage_in_bytes").write_text("0")
        except OSError:
            return None
        return cls(g)

    def failcnt(self) -> int:
        """How often the group's usage hit its limit (reclaim under the limit)."""
        return int((self.path / "memory.failcnt").read_text())

    def join(self) -> None:
        """Move the calling process into the group (a child's preexec_fn, before exec)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def sample(self) -> None:
        try:
            text = (self.path / "memory.stat").read_text()
        except OSError:  # removed as the run ended
            return
        stat = dict(line.split() for line in text.splitlines())
        self.in_use_peak = max(self.in_use_peak, int(stat["rss"]) + int(stat["mapped_file"]))
        self.anon_peak = max(self.anon_peak, int(stat["rss"]))

    def peak(self) -> int:
        return int((self.path / "memory.max_usage_in_bytes").read_text())

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


def drop_page_cache() -> bool:
    """Write dirty pages and drop the page cache (root); whether it could."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def generate_run(
    model: str | None, env: dict, extra: list[str], group: MemoryGroup | None = None
) -> dict:
    """One `edgerun generate` of the README prompt (in `group` where given); its figures."""
    cmd = [sys.executable, "-m", "edgerun", "generate", README_PROMPT, *extra]
    if model is not None:
        cmd += ["-m", model]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    load = os.getloadavg()
    t0 = time.perf_counter()
    child = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=None if group is None else group.join,
    )
    peak = [0, 0]  # summed RSS, summed PSS
    cpu: dict[int, float] = {}  # pid -> CPU seconds, sampled
    peaks: dict[int, int] = {}  # pid -> its largest RSS sampled
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            rss, pss = _tree_rss(child.pid, cpu, peaks)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            if group is not None:
                group.sample()
            done.wait(0.05)

    threading.Thread(target=sample, daemon=True).start()
    err: list[bytes] = []
    reader = threading.Thread(target=lambda: err.append(child.stderr.read()), daemon=True)
    reader.start()
    first = child.stdout.read(1)  # the first byte of the answer
    t_first = time.perf_counter() - t0
    _tree_rss(child.pid, cpu)
    cpu_first = dict(cpu)  # each process's CPU until the first token
    out = first + child.stdout.read()
    rc = child.wait()
    total = time.perf_counter() - t0
    done.set()
    reader.join()
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
        tree_pss_peak_mib=peak[1] / 2**20,
        cgroup_peak_mib=None if group is None else group.peak() / 2**20,
        cgroup_in_use_peak_mib=None if group is None else group.in_use_peak / 2**20,
        cgroup_anon_peak_mib=None if group is None else group.anon_peak / 2**20,
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
        answer=out.decode(errors="replace").strip(),
        load=load,
        stderr=stderr,
    )


def _report(label: str, r: dict, group: MemoryGroup | None, dropped: bool, show: bool) -> None:
    print(
        f"{label}: first token {r['first_token_s']:.1f} s, total {r['total_s']:.1f} s, "
        f"CPU (user+sys, all processes) {r['cpu_s']:.1f} s | {r['warmup']} | "
        f"load average {r['load'][0]:.1f} on {os.cpu_count()} CPUs"
    )
    if group is None:
        cg = "memory cgroup: not available (needs root and cgroup v1)"
    else:
        cg = (
            f"memory cgroup {r['cgroup_peak_mib']:.0f} MiB (max_usage, page cache "
            f"{'dropped before' if dropped else 'as it was'}), "
            f"{r['cgroup_in_use_peak_mib']:.0f} MiB (rss + mapped_file, sampled), "
            f"{r['cgroup_anon_peak_mib']:.0f} MiB (rss: anonymous, sampled)"
        )
    print(
        f"  peak memory: {cg}; process tree {r['tree_peak_mib']:.0f} MiB summed RSS, "
        f"{r['tree_pss_peak_mib']:.0f} MiB summed PSS (sampled); "
        f"the command's own peak RSS {r['own_peak_mib']} MiB"
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
    print(f"  answer: {r['answer'][:100]!r}")
    if show:
        print("  stderr:\n    " + "\n    ".join(r["stderr"].strip().splitlines()))


def cold_ttft(
    model: str | None,
    extra: list[str],
    show: bool,
    drop_caches: bool = True,
    limit_ratio: float | None = None,
) -> dict:
    """The cold run and a warm run on its cache; with limit_ratio, another cold run on a
    new empty cache in a memory cgroup limited to limit_ratio x the warm run's cgroup
    peak (it must finish, and the first run's compile plan sees that memory is short).
    Their figures by label."""
    with tempfile.TemporaryDirectory(prefix="edgerun-cold-") as tmp:
        runs = {}
        labels = ["cold", "warm"] + (["cold-limited"] if limit_ratio else [])
        for label in labels:
            cache = os.path.join(tmp, "numba-limited" if label == "cold-limited" else "numba")
            env = dict(os.environ, NUMBA_CACHE_DIR=cache)
            limit = None
            if label == "cold-limited":
                if runs["warm"]["cgroup_peak_mib"] is None:
                    print("cold-limited: no memory cgroup here")
                    break
                limit = int(limit_ratio * runs["warm"]["cgroup_peak_mib"] * 2**20)
            group = MemoryGroup.make(f"edgerun-ttft-{os.getpid()}-{label}", limit)
            dropped = drop_caches and group is not None and drop_page_cache()
            try:
                r = runs[label] = generate_run(model, env, extra, group)
                if limit is not None:
                    r["failcnt"] = group.failcnt()
            except RuntimeError as e:
                print(f"{label}: in a {limit / 2**20:.0f} MiB cgroup it failed: {e}")
                break
            finally:
                if group is not None:
                    group.remove()
            _report(label, r, group, dropped, show)
            if limit is not None:
                print(
                    f"  in a memory cgroup limited to {limit / 2**20:.0f} MiB "
                    f"({limit_ratio} x the warm run's peak): memory.failcnt {r['failcnt']}"
                )
        cold, warm = runs["cold"], runs["warm"]

        def ratio(key: str) -> str:
            c, w = cold[key], warm[key]
            return f"{c / w:.2f}x" if c and w else "-"

        print(
            f"first run / warm run, peak memory: {ratio('cgroup_peak_mib')} (memory cgroup), "
            f"{ratio('cgroup_in_use_peak_mib')} (cgroup rss + mapped_file), "
            f"{ratio('cgroup_anon_peak_mib')} (cgroup anonymous), "
            f"{ratio('tree_pss_peak_mib')} (tree PSS), {ratio('tree_peak_mib')} (tree RSS, "
            f"summed), {ratio('own_peak_mib')} (the command's own)"
        )
        return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-m", "--model", default=None)
    ap.add_argument("-r", "--runs", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="empty kernel cache, then warm")
    ap.add_argument("-t", "--threads", default=None, help="--cold: generate's -t")
    ap.add_argument("--show", action="store_true", help="--cold: print generate's stderr")
    ap.add_argument(
        "--no-drop-caches",
        action="store_true",
        help="--cold: keep the page cache before each run (it counts in the cgroup's peak)",
    )
    ap.add_argument(
        "--limit",
        type=float,
        default=None,
        metavar="RATIO",
        help="--cold: then a first run on a new cache in a memory cgroup of RATIO x the "
        "warm run's peak (1.3: the first run's target)",
    )
    args = ap.parse_args(argv)
    if args.cold:
        extra = [] if args.threads is None else ["-t", str(args.threads)]
        cold_ttft(args.model, extra, args.show, not args.no_drop_caches, args.limit)
    else:
        warm_ttft(args.model or "-", args.runs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
