"""Numba compiler switches, applied before numba is first imported.

Numba turns LLVM's SLP vectorizer off by default and its loop vectorizer
vectorizes across GGUF blocks with gathers; measured on Zen 4, SLP on and
loop-vectorize off gave 4-7x on our block kernels (../shared/PERF_NOTES.md).
These switches are not part of Numba's cache key, so our kernels get a cache
directory of their own. A user's explicit setting always wins.
"""

import os
import sys


def configure() -> None:
    if "numba" in sys.modules:
        return  # too late to change compiler flags; kernels still run correctly
    os.environ.setdefault("NUMBA_SLP_VECTORIZE", "1")
    os.environ.setdefault("NUMBA_LOOP_VECTORIZE", "0")
    # Numba's OpenMP layer spin-waits between parallel regions by default; with
    # another busy process on a 2-core machine every one of the ~200 regions per
    # token then waits a scheduler slice (decode measured 38 vs 96 tok/s under load).
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
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
