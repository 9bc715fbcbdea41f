"""Numba compiler switches, applied before numba is first imported.

Numba turns LLVM's SLP vectorizer off by default and its loop vectorizer
vectorizes across GGUF blocks with gathers; measured on Zen 4, SLP on and
loop-vectorize off gave 4-7x on our block kernels.
These switches are not part of Numba's cache key, so our kernels get a cache
directory of their own. A user's explicit setting always wins.
"""

import os
import sys
from pathlib import Path


def wait_policy() -> str | None:
    """OpenMP wait policy for the ~200 parallel regions of one decode step.

    Measured on 2 cores, SmolLM2, 2 threads. Idle machine: libgomp's default
    (spin ~300k rounds, then sleep) decodes as fast as spinning forever
    ("active", 167-177 vs 164-181 tok/s) and far faster than sleeping at once
    ("passive", 63-74). One other busy process: active 2 tok/s (a spinning thread
    holds the core the working thread needs), default 62, passive 101; and with
    the threads cut to the free cores (cpu_share.ThreadGovernor) the default's
    bounded spin lets the unused pool thread fall asleep, where active keeps it
    spinning. So: the default, which the governor can steer, unless the CPUs are
    already more than half busy at start (a 50 ms sample): then passive, which
    does best with a fixed thread count under load.
    """
    try:
        import psutil

        busy = psutil.cpu_percent(interval=0.05)  # all CPUs, now (load averages lag)
    except Exception:  # noqa: BLE001 - no reading: assume an idle machine
        return None
    return "passive" if busy > 50.0 else None


def requested_kernels() -> str:
    """The kernel path EDGERUN_KERNELS asks for, lower-cased ("auto" when unset)."""
    return os.environ.get("EDGERUN_KERNELS", "auto").strip().lower() or "auto"


def configure() -> None:
    if "numba" in sys.modules:
        return  # too late to change compiler flags; kernels still run correctly
    os.environ.setdefault("NUMBA_SLP_VECTORIZE", "1")
    os.environ.setdefault("NUMBA_LOOP_VECTORIZE", "0")
    if "OMP_WAIT_POLICY" not in os.environ:
        policy = wait_policy()
        if policy:
            os.environ["OMP_WAIT_POLICY"] = policy
    if "NUMBA_CACHE_DIR" not in os.environ:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        name = cache_dir_name()
        os.environ["NUMBA_CACHE_DIR"] = kernel_cache_dir(os.path.join(base, "edgerun", name))


def cache_dir_name() -> str:
    """The kernel cache directory's name under ~/.cache/edgerun for this process.

    The generic "int8" kernels differ from the CPU-specific ones only inside their
    intrinsics, which Numba's cache key does not see: on x86, where they are asked for,
    they get a directory of their own. On ARM they are the only int8 kernels, so a child
    asked for them (warm_kernels) compiles into the directory its parent reads."""
    return "numba-int8" if requested_kernels() == "int8" and x86_host() else "numba"


def x86_host() -> bool:
    """Whether this process runs on a 64-bit x86 CPU (the x86 kernel paths' precondition)."""
    import platform

    return platform.machine().lower() in ("x86_64", "amd64")


def kernel_cache_dir(root: str) -> str:
    """The directory under root for the kernels of these ops sources.

    Numba's cache key is the file of the function itself, but a cached kernel also
    carries the code of every njit function and intrinsic it calls from other files:
    editing ops/_simd.py left attention.py's cached kernels running the old exp, and a
    changed attention_decode.py left token_step.py's running the old split. So each
    state of edgerun/ops (its files' sizes and mtimes) compiles into a directory of
    its own; those not used for KERNEL_CACHE_KEEP_DAYS are removed."""
    import hashlib
    import shutil
    import time

    digest = hashlib.sha1(sources_stamp("ops").encode()).hexdigest()[:12]
    path = os.path.join(root, digest)
    try:
        old = time.time() - KERNEL_CACHE_KEEP_DAYS * 86400
        for entry in os.scandir(root):
            if entry.is_dir() and entry.name != digest and entry.stat().st_mtime < old:
                shutil.rmtree(entry.path, ignore_errors=True)
        os.makedirs(path, exist_ok=True)
        os.utime(path)  # used now
    except OSError:  # an unwritable cache: Numba then compiles in memory
        pass
    return path


KERNEL_CACHE_KEEP_DAYS = 7


def kernel_cache_is_cold() -> bool:
    """True when no compiled kernel is cached yet (the first run compiles for a minute)."""
    cache = os.environ.get("NUMBA_CACHE_DIR")
    if not cache or not os.path.isdir(cache):
        return True
    for _root, _dirs, files in os.walk(cache):
        if any(f.endswith(".nbi") for f in files):
            return False
    return True


def sources_stamp(package: str = "") -> str:
    """Size and mtime of every edgerun source file (under the subpackage `package`, e.g.
    "ops"): a changed kernel means a new compile, and new speed figures."""
    root = Path(__file__).resolve().parents[1]  # the edgerun package
    parts = []
    for p in sorted((root / package).rglob("*.py")):
        st = p.stat()
        parts.append(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns}")
    return "|".join(parts)
