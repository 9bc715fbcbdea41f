"""The one thread that runs this process's model compute.

Numba's parallel kernels run on libgomp (its "omp" threading layer), which gives every
thread that starts parallel regions a pool of worker threads of its own. Once the pools
together hold more threads than there are CPUs, libgomp stops its workers spinning
between regions (its "throttled" spin count) and every region start becomes a futex
wake-up. A decode step has ~200 regions. On 2 vCPUs, SmolLM2-135M, 2 threads, with
two pools a decode step takes 20-27 ms from a second thread (a session's scheduler)
against 7.5-8.3 ms with one, a region start 30 us against 3 us (`python
benchmarks/concurrency.py -s 1` decodes through a session's scheduler thread). So every
forward pass, whatever thread asks for it, runs here: one pool
(tests/unit/test_compute_thread.py holds it to that). A caller that ran parallel kernels
itself (a kernel benchmark, a test) has its own pool released when it hands work over
(`omp_pause_resource_all`), and the compute thread frees its pool when idle, so two
pools are never alive for long.

This is process state by nature: the pools are the process's, so one instance serves
every model (`compute_thread()`).
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

# Idle this long, the compute thread frees its own pool, so that kernels a caller runs
# itself (a kernel benchmark, the planner's calibration) find no second pool either.
# Decode steps follow each other within a millisecond; re-creating the pool costs ~0.2 ms.
IDLE_RELEASE_S = 0.05

__all__ = ["ComputeThread", "compute_thread", "release_thread_pool"]


_OPENMP_LIBS = ("libgomp.so.1", "libomp.so", "libiomp5.so", "libomp.dylib")


def _pause_function() -> Callable[[], int] | None:
    """omp_pause_resource_all of the OpenMP runtime Numba's "omp" layer runs on (None on
    other layers, or where the runtime has none)."""
    import numba

    if numba.threading_layer() != "omp":
        return None
    for name in _OPENMP_LIBS:
        try:
            lib = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
        except OSError:
            continue
        fn = getattr(lib, "omp_pause_resource_all", None)
        if fn is not None:
            fn.argtypes = [ctypes.c_int]
            fn.restype = ctypes.c_int
            return lambda: fn(1)  # omp_pause_soft: free this thread's idle pool
    return None


_PAUSE: list = []  # [the pause function or None], once Numba's threads are up


def release_thread_pool() -> None:
    """Free the calling thread's OpenMP worker pool, if it has one (a no-op otherwise,
    and where the threading layer is not OpenMP). The pool comes back with the thread's
    next parallel kernel."""
    if not _PAUSE:
        try:
            fn = _pause_function()
        except ValueError:  # no parallel kernel has run yet: no pool to free
            return
        _PAUSE.append(fn)
    if _PAUSE[0] is not None:
        _PAUSE[0]()


class _Job:
    __slots__ = ("fn", "args", "kwargs", "threads", "done", "result", "error")

    def __init__(self, fn, args, kwargs, threads: int) -> None:
        self.fn, self.args, self.kwargs, self.threads = fn, args, kwargs, threads
        self.done = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None


class ComputeThread:
    """Runs callables on one long-lived daemon thread, one at a time, in order."""

    def __init__(self, name: str = "edgerun-compute") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """fn(*args, **kwargs) on the compute thread, with the caller's Numba thread count;
        its result, or its exception raised here. From the compute thread itself, a plain
        call. A Ctrl+C while waiting takes effect once fn returns (a forward pass is never
        left half done)."""
        if threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        import numba

        release_thread_pool()
        job = _Job(fn, args, kwargs, numba.get_num_threads())
        self._jobs.put(job)
        try:
            job.done.wait()
        except BaseException:
            while not job.done.is_set():
                try:
                    job.done.wait()
                except BaseException:  # noqa: BLE001 - a second Ctrl+C: keep waiting
                    continue
            raise
        if job.error is not None:
            raise job.error
        return job.result

    def close(self) -> None:
        """Stop the thread after the jobs already queued."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=30)

    def _serve(self) -> None:
        import numba

        while True:
            try:
                job = self._jobs.get(timeout=IDLE_RELEASE_S)
            except queue.Empty:  # idle: free the pool for kernels other threads run
                release_thread_pool()
                job = self._jobs.get()
            if job is None:
                return
            try:
                if numba.get_num_threads() != job.threads:
                    numba.set_num_threads(job.threads)
                job.result = job.fn(*job.args, **job.kwargs)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                job.error = e
            finally:
                job.done.set()
                # not held while waiting for the next job: its arguments (a dropped
                # session's KV cache) would stay alive until then
                job = None


_SHARED: dict[int, ComputeThread] = {}  # pid -> the process's thread (a fork starts anew)
_SHARED_LOCK = threading.Lock()


def compute_thread() -> ComputeThread:
    """This process's compute thread, started on first use."""
    pid = os.getpid()
    t = _SHARED.get(pid)
    if t is not None and t.alive:
        return t
    with _SHARED_LOCK:
        t = _SHARED.get(pid)
        if t is None or not t.alive:
            _SHARED.clear()
            t = _SHARED[pid] = ComputeThread()
        return t
