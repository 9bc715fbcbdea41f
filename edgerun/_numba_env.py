"""Numba compiler switches, applied before numba is first imported.

Numba turns LLVM's SLP vectorizer off by default and its loop vectorizer
vectorizes across GGUF blocks with gathers; measured on Zen 4, SLP on and
loop-vectorize off gave 4-7x on our block kernels (../shared/PERF_NOTES.md).
These switches are not part of Numba's cache key, so our kernels get a cache
directory of their own. A user's explicit setting always wins.
"""

import os
import sys


def wait_policy() -> str:
    """OpenMP wait policy for the ~200 parallel regions of one decode step.

    Measured on 2 cores (SmolLM2 decode, 2 threads): idle machine, spinning
    ("active") 188 tok/s vs sleeping ("passive") 74; with 3 other busy
    processes, active 21 vs passive 57 (spinning threads then wait out
    scheduler slices). libgomp's default (spin a while, then sleep) was worst
    under load. So spin when the CPUs are mostly idle at start, sleep when they
    are more than half busy (a 50 ms sample).
    """
    try:
        import psutil

        busy = psutil.cpu_percent(interval=0.05)  # all CPUs, now (load averages lag)
    except Exception:  # noqa: BLE001 - no reading: assume an idle machine
        return "active"
    return "passive" if busy > 50.0 else "active"


def configure() -> None:
    if "numba" in sys.modules:
        return  # too late to change compiler flags; kernels still run correctly
    os.environ.setdefault("NUMBA_SLP_VECTORIZE", "1")
    os.environ.setdefault("NUMBA_LOOP_VECTORIZE", "0")
    os.environ.setdefault("OMP_WAIT_POLICY", wait_policy())
    if "NUMBA_CACHE_DIR" not in os.environ:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        os.environ["NUMBA_CACHE_DIR"] = os.path.join(base, "edgerun", "numba")


def kernel_cache_is_cold() -> bool:
    """True when no compiled kernel is cached yet (the first run compiles for a minute)."""
    cache = os.environ.get("NUMBA_CACHE_DIR")
    if not cache or not os.path.isdir(cache):
        return True
    for _root, _dirs, files in os.walk(cache):
        if any(f.endswith(".nbi") for f in files):
            return False
    return True
