"""Compile a model's kernels in a child process before a budgeted load.

Numba's first compile of the kernels holds a few hundred MB of LLVM memory for about
a minute, and no RAM plan counts it. Measured on a fresh machine: the first
`--ram-budget 800M` run of Qwen2.5-Coder-1.5B in an 840 MiB cgroup compiled beside
its held rows (823 MiB anonymous) and thrashed at the limit for over 20 minutes
(memory.failcnt 236 million) without a token. So before a budgeted load whose kernels
were never compiled, a child loads the model resident (mapped: its pages are clean
and the kernel reclaims them under the limit), compiles and caches every kernel the
model's formats use, and exits. The parent then loads them from Numba's disk cache.

A marker in Numba's cache directory records that this model was warmed with these
kernel sources, kernel path and KV type, so later loads skip the child.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
from pathlib import Path

from edgerun._numba_env import sources_stamp
from edgerun.offload.io import drop_page_cache

__all__ = ["ensure_kernels_compiled", "warm_marker"]


def warm_marker(path: str | os.PathLike, kv_type: str, kernels: str) -> Path | None:
    """The marker file for this model, KV type and kernel path (None without a cache)."""
    cache = os.environ.get("NUMBA_CACHE_DIR")
    if not cache:
        return None
    p = Path(path).resolve()
    st = p.stat()
    text = f"{p}|{st.st_size}|{st.st_mtime_ns}|{kv_type}|{kernels}|{sources_stamp()}"
    return Path(cache) / "warm" / hashlib.sha256(text.encode()).hexdigest()[:20]


def ensure_kernels_compiled(path: str | os.PathLike, kv_type: str, kernels: str) -> bool:
    """Compile `path`'s kernels in a child unless the marker says they are cached.

    Returns True when a child ran and succeeded. A child that fails (no memory even
    for it, a broken install) is not fatal: the caller's own warm-up compiles then."""
    marker = warm_marker(path, kv_type, kernels)
    if marker is None or marker.exists():
        return False
    env = dict(os.environ, EDGERUN_KERNELS=kernels)
    cmd = [sys.executable, "-m", "edgerun.tools.warm_kernels", str(path), "--kv-type", kv_type]
    r = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    drop_page_cache([path])  # the child's mapped pages would count against the budget
    if r.returncode != 0:
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(r.stdout.strip() + "\n")
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="compile a model's kernels into Numba's cache")
    ap.add_argument("path")
    ap.add_argument("--kv-type", default="f16")
    a = ap.parse_args(argv)
    import edgerun

    m = edgerun.load(a.path, n_ctx=16, threads=1, kv_type=a.kv_type)
    w = m.warm_up()
    print(f"{w.compiled} functions compiled in {w.seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
