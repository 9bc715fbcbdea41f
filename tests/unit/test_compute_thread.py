"""The process's compute thread: every forward pass runs on it, with the caller's thread
count, and a caller's own OpenMP pool is released when it hands work over."""

from __future__ import annotations

import os
import sys
import threading
import time

import numba
import numpy as np
import pytest

from edgerun.runtime.compute_thread import ComputeThread, compute_thread, release_thread_pool


def test_call_runs_on_one_thread_and_returns_or_raises():
    ct = ComputeThread(name="test-compute")
    try:
        names = {ct.call(lambda: threading.current_thread().name) for _ in range(3)}
        assert names == {"test-compute"}
        assert ct.call(lambda a, b=0: a + b, 2, b=3) == 5
        with pytest.raises(ZeroDivisionError):
            ct.call(lambda: 1 / 0)
        # the thread survives an error, and a call from the thread itself runs inline
        assert ct.call(lambda: ct.call(lambda: threading.current_thread().name)) == "test-compute"
    finally:
        ct.close()
    assert not ct.alive


def test_the_thread_keeps_no_reference_to_a_finished_calls_arguments():
    """A caller's arguments (a dropped session's KV cache) are freed when the caller lets
    go of them, not when the next call comes."""
    import weakref

    class Cache:
        pass

    ct = ComputeThread(name="test-compute")
    try:
        c = Cache()
        gone = weakref.ref(c)
        assert ct.call(lambda x: x is not None, c)
        del c
        assert gone() is None
    finally:
        ct.close()


def test_call_carries_the_callers_thread_count():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs a Numba pool of 2 threads")
    ct = ComputeThread()
    old = numba.get_num_threads()
    try:
        for n in (1, 2, 1):
            numba.set_num_threads(n)
            assert ct.call(numba.get_num_threads) == n
    finally:
        numba.set_num_threads(old)
        ct.close()


def test_callers_from_many_threads_are_served_in_turn():
    ct = compute_thread()
    seen: list[str] = []
    results = [0] * 8

    def work(i):
        results[i] = ct.call(lambda: (seen.append(threading.current_thread().name), i * i)[1])

    ts = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert results == [i * i for i in range(8)]
    assert set(seen) == {"edgerun-compute"}
    assert compute_thread() is ct


def test_model_forward_runs_on_the_compute_thread(monkeypatch):
    from edgerun.model.transformer import Transformer

    seen = []
    orig = Transformer._forward

    def spy(self, *a):
        seen.append(threading.current_thread().name)
        return orig(self, *a)

    monkeypatch.setattr(Transformer, "_forward", spy)
    import edgerun

    m = edgerun.load("smollm2-135m", threads=2, n_ctx=64)
    out = list(m.generate("The capital of France is", max_tokens=3))
    assert out and seen and set(seen) == {"edgerun-compute"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts /proc/self/task")
def test_release_frees_the_callers_openmp_workers():
    if numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs a Numba pool of 2 threads")
    from edgerun.ops.norm import PARALLEL_MIN, rmsnorm

    def tasks() -> set[str]:
        # Thread ids, not a count: other tests' detached workers may exit meanwhile.
        return set(os.listdir("/proc/self/task"))

    x = np.ones((PARALLEL_MIN, 64), np.float32)
    w = np.ones(64, np.float32)
    out: dict[str, set[str]] = {}

    def on_fresh_thread():  # a thread of our own: its pool is created and freed here
        numba.set_num_threads(2)
        before = tasks()
        rmsnorm(x, w, 1e-6)  # a parallel kernel: this thread now owns a worker
        workers = tasks() - before
        out["with_pool"] = workers
        release_thread_pool()
        for _ in range(100):  # the freed workers exit on their own (detached threads)
            if not workers & tasks():
                break
            time.sleep(0.01)
        out["released"] = workers & tasks()

    t = threading.Thread(target=on_fresh_thread)
    t.start()
    t.join()
    if numba.threading_layer() != "omp":
        pytest.skip(f"threading layer is {numba.threading_layer()}, not OpenMP")
    assert len(out["with_pool"]) >= 1, out
    assert not out["released"], out
