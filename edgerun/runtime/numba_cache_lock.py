"""Numba's disk cache written by several processes at once: one file lock per function.

Numba writes each cache file atomically (a temporary file, then a rename), so processes
that compile *different* functions into one cache directory never corrupt it. Two that
save different signatures of the *same* function can: each reads the function's index,
adds its own entry and writes it back (one entry is lost), and both pick the first free
data file name, so one signature's index entry can end up naming the other's machine code
(numba/core/caching.py, IndexDataCacheFile.save, as of Numba 0.68). So a process that
compiles beside others (offload/warm_kernels.py's children, and their parent while they
run) holds an exclusive lock on the function's `<index>.lock` file around
Dispatcher.compile. The lock also saves work: a process that waited for another's
compile of the same function finds it in the cache and loads it instead.

Locks are taken callee after caller, along the call graph, which has no cycles, so two
processes cannot wait for each other; a wait longer than LOCK_WAIT_S goes on unlocked.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["install", "installed", "lock_path"]

LOCK_WAIT_S = 900.0  # longer than any one kernel's compile on a loaded 2-core machine
_POLL_S = 0.05
_held = threading.local()  # lock path -> depth, for this thread (nested compiles re-enter)


def lock_path(dispatcher: object) -> str | None:
    """The lock file of a dispatcher's disk cache (None: it is not cached on disk)."""
    cache_file = getattr(getattr(dispatcher, "_cache", None), "_cache_file", None)
    index = getattr(cache_file, "_index_path", None)
    return None if index is None else index + ".lock"


@contextmanager
def _function_lock(path: str) -> Iterator[None]:
    depth: dict[str, int] = _held.__dict__.setdefault("depth", {})
    if depth.get(path):
        depth[path] += 1
        try:
            yield
        finally:
            depth[path] -= 1
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # an unwritable cache: Numba saves nothing there either
        yield
        return
    try:
        deadline = time.monotonic() + LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    break  # go on unlocked rather than wait forever
                time.sleep(_POLL_S)
        depth[path] = 1
        try:
            yield
        finally:
            depth[path] = 0
    finally:
        os.close(fd)  # releases the lock


def install() -> None:
    """Wrap Dispatcher.compile in this process with the per-function lock (once)."""
    from numba.core.dispatcher import Dispatcher

    if installed():
        return
    original = Dispatcher.compile

    def compile(self, sig):  # noqa: ANN001, ANN202 - Numba's own signature
        path = lock_path(self)
        if path is None:
            return original(self, sig)
        with _function_lock(path):
            return original(self, sig)

    compile.edgerun_locked = True  # type: ignore[attr-defined]
    Dispatcher.compile = compile


def installed() -> bool:
    """Whether this process compiles under the per-function lock."""
    from numba.core.dispatcher import Dispatcher

    return bool(getattr(Dispatcher.compile, "edgerun_locked", False))
