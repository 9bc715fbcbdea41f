"""Process and machine facts the CLI, bench and TUI report."""

from __future__ import annotations

import os
import sys


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
