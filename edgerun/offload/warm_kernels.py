"""Compile a model's kernels in a child process before a budgeted load.

Numba's first compile of the kernels holds a few hundred MB of LLVM memory for about
a minute, and no RAM plan counts it. Measured on a fresh machine: the first
`--ram-budget 800M` run of Qwen2.5-Coder-1.5B in an 840 MiB cgroup compiled beside
its held rows (823 MiB anonymous) and thrashed at the limit for over 20 minutes
(memory.failcnt 236 million) without a token. So before a budgeted load whose kernels
were never compiled, a child loads the model resident (mapped: its pages are clean
and the kernel reclaims them under the limit), compiles and caches every kernel the
model's formats use, and exits. The parent then loads them from Numba's disk cache.

The child itself must fit the budget too: Numba keeps what every compile allocated
until the process exits (Qwen2.5-Coder-0.5B: 664 MiB anonymous after all 173 kernels,
one of them 156 MiB), more than a 400 MiB budget holds, and such a child thrashed at
its cgroup's limit for over 5 minutes. So a child given a memory ceiling stops before
its next compile once its anonymous memory passes it (everything compiled so far is in
the cache by then) and exits with PARTIAL; the parent starts another, which loads those
kernels from the cache (little memory) and compiles on, until one finishes.

A marker in Numba's cache directory records that this model was warmed with these
kernel sources, kernel path and KV type, so later loads skip the children.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

from edgerun.offload.io import drop_page_cache
from edgerun.runtime.numba_env import sources_stamp

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


PARTIAL = 75  # a child's exit status: it stopped at its memory ceiling, run another
# What one compile may add to a child's anonymous memory, the first one's Numba and
# LLVM start-up included (measured: 156 MiB for qmatvec_vnni.mvb_q5_0 alone, 210 MiB
# as a process's first compile): a child stops while it has this much left.
COMPILE_HEADROOM_BYTES = 224 << 20
MAX_CHILDREN = 200  # each child compiles at least one function, so this bounds a bug


def ensure_kernels_compiled(
    path: str | os.PathLike, kv_type: str, kernels: str, memory_bytes: int | None = None
) -> bool:
    """Compile `path`'s kernels in children unless the marker says they are cached.

    memory_bytes: what the children may use (the RAM budget less what the caller holds);
    each child stops COMPILE_HEADROOM_BYTES short of it and another goes on. None: one
    child compiles everything. Returns True when the children ran and succeeded. A child
    that fails (no memory even for it, a broken install) is not fatal: the caller's own
    warm-up compiles then."""
    marker = warm_marker(path, kv_type, kernels)
    if marker is None or marker.exists():
        return False
    env = dict(os.environ, EDGERUN_KERNELS=kernels)
    cmd = [sys.executable, "-m", "edgerun.tools.warm_kernels", str(path), "--kv-type", kv_type]
    if memory_bytes is not None:
        ceiling = max(0, memory_bytes - COMPILE_HEADROOM_BYTES)
        cmd += ["--stop-above", str(ceiling)]
    compiled, seconds, children, rc = 0, 0.0, 0, PARTIAL
    while rc == PARTIAL and children < MAX_CHILDREN:
        r = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        drop_page_cache([path])  # the child's mapped pages would count against the budget
        children, rc = children + 1, r.returncode
        for line in r.stdout.splitlines():
            if line.startswith("compiled "):
                n, s = line.split()[1:3]
                compiled, seconds = compiled + int(n), seconds + float(s)
    if rc != 0:
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{compiled} functions compiled in {seconds:.1f} s by {children} processes\n")
    return True
