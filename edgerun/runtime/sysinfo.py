"""Process and machine facts the CLI, bench and TUI report."""

from __future__ import annotations

import os
import sys
from pathlib import Path


def reset_peak_rss() -> bool:
    """Start this process's peak RSS (VmHWM) over from its current RSS, where Linux allows
    it (writing 5 to /proc/self/clear_refs, Linux 4.0+), so a measurement inside a
    longer-lived process (a test run, an app) reports its own peak. Returns whether it
    did."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def proc_status_bytes(field: str) -> int | None:
    """A kB figure of this process's /proc/self/status ("VmHWM", "RssAnon"), in bytes;
    None where Linux's /proc does not give it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (since reset_peak_rss, where it ran)."""
    hwm = proc_status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    try:
        import resource

        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return kb if sys.platform == "darwin" else kb * 1024
    except ImportError:  # Windows
        import psutil

        info = psutil.Process().memory_info()
        return int(getattr(info, "peak_wset", info.rss))


def current_rss_bytes() -> int:
    """Resident set size of this process now."""
    import psutil

    return int(psutil.Process().memory_info().rss)


def _group_limit(d: Path, names: tuple[str, str, str]) -> tuple[int, int] | None:
    """(limit, usage less page cache) of one cgroup directory, where it sets a limit."""
    try:
        limit_text = (d / names[0]).read_text().strip()
        usage = int((d / names[1]).read_text())
    except (OSError, ValueError):
        return None
    if not limit_text.isdigit() or int(limit_text) >= 1 << 60:
        return None  # "max", or v1's "unlimited"
    cache = 0
    try:
        for stat in (d / "memory.stat").read_text().splitlines():
            key, _, value = stat.partition(" ")
            if key == names[2]:
                cache = int(value)
    except (OSError, ValueError):
        pass
    return int(limit_text), max(0, usage - cache)


def _cgroup_memory(root: Path, proc_cgroup: Path) -> tuple[int, int] | None:
    """(limit, unreclaimable usage) in bytes of the tightest memory cgroup limit over
    this process: its own group's or an ancestor's (a container inside a limited slice),
    cgroup v2 (memory.max, memory.current less the memory.stat "file" pages) or v1
    (memory.limit_in_bytes, memory.usage_in_bytes less "total_cache"). Page cache is
    left out of the usage because a limit reclaims it. None where nothing limits it."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    best = None
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # v2: "0::/path"
            base, names = root, ("memory.max", "memory.current", "file")
        elif "memory" in controllers.split(","):  # v1: "N:memory:/path"
            base = root / "memory"
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
        else:
            continue
        parts = [p for p in path.split("/") if p]
        for k in range(len(parts), -1, -1):  # the group, then each ancestor
            got = _group_limit(base.joinpath(*parts[:k]), names)
            if got is not None and (best is None or got[0] - got[1] < best[0] - best[1]):
                best = got
    return best


def memory_headroom_bytes(
    root: Path = Path("/sys/fs/cgroup"), proc_cgroup: Path = Path("/proc/self/cgroup")
) -> int:
    """Bytes this process can still make resident without pushing the machine or its
    memory cgroup (a container's limit, `systemd-run -p MemoryMax=`) into reclaim of
    memory that cannot be paged out: the machine's available memory, capped by the
    cgroup's limit less what its processes hold outside the page cache."""
    import psutil

    free = int(psutil.virtual_memory().available)
    cg = _cgroup_memory(root, proc_cgroup)
    if cg is not None:
        free = min(free, cg[0] - cg[1])
    return max(0, free)


def anonymous_rss_bytes() -> int:
    """This process's resident anonymous memory (RssAnon: heap, stacks, copies; not its
    mapped files, which the kernel can drop and read again), or its RSS where /proc does
    not say."""
    anon = proc_status_bytes("RssAnon")
    return anon if anon is not None else current_rss_bytes()


def return_free_heap_to_os() -> bool:
    """Give the C heap's free pages back to the OS (glibc malloc_trim); whether it ran.

    Building Qwen2.5's 151k-token BPE tokenizer frees ~15 MiB of transient allocations
    that glibc keeps in the heap: RSS 160 -> 145 MiB after a trim. Loading calls this
    before it measures the runtime floor, so a RAM budget plans with that memory."""
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False  # not glibc
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    trim(0)
    return True


def default_threads() -> int:
    """CPUs this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)
