"""Memory streaming bandwidth: the roofline figure `edgerun bench` and the system probe
(probe.py) set decode speed against."""

from __future__ import annotations

import time

import numba
import numpy as np
from numba import njit, prange

from edgerun.ops._simd import stack16
from edgerun.runtime.cpu_share import set_threads

__all__ = ["measure_bandwidth"]


@njit(cache=True, parallel=True, fastmath=True)
def _stream_sum(a):
    """Sum of a float32 [chunks, n] array, chunks in parallel. 16 explicit lanes per
    chunk: with Numba's loop vectorizer off (our setting) a plain `s += row[i]` runs
    one scalar add at a time and measures the adder, not memory (~5 GB/s)."""
    chunks, n = a.shape
    n16 = n // 16
    sums = np.zeros(chunks, dtype=np.float32)
    for c in prange(chunks):
        row = a[c]
        lanes = numba.carray(stack16(), 16)  # registers once unrolled
        for l in range(16):
            lanes[l] = np.float32(0.0)
        for b in range(n16):
            blk = row[b * 16 : b * 16 + 16]
            for l in range(16):
                lanes[l] += blk[l]
        s = np.float32(0.0)
        for l in range(16):
            s += lanes[l]
        for i in range(n16 * 16, n):
            s += row[i]
        sums[c] = s
    return sums.sum()


def measure_bandwidth(threads: int, mbytes: int = 512, repeats: int = 5) -> float:
    """Streaming-read bandwidth in bytes/s with `threads` threads: the best of repeats.

    The best run is the machine's capability; on shared (virtualized) hosts the
    others are lowered by neighbours. On a virtual machine the figure also moves
    with where the host places the vCPUs (2 threads on 2 vCPUs: ~35 or 55-60 GB/s);
    `edgerun sysinfo` re-measures it.
    """
    set_threads(threads)
    a = np.ones((64, mbytes * 2**20 // 256), dtype=np.float32)
    _stream_sum(a)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        _stream_sum(a)
        times.append(time.perf_counter() - t0)
    return a.nbytes / min(times)
