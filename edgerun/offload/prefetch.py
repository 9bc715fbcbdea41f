"""Prefetch: read layer L+1's likely neurons while layer L (and L+1's attention) compute.

Consecutive tokens share most of their active neurons (the premise of windowing), so
the neurons layer L+1 used for the previous token are the prediction for this one.
When layer L's FFN is done, the neurons of L+1 that the prediction wants and the
cache does not hold are read on a background thread into a staging matrix; layer
L+1 takes the ones it really needs from there and reads only the rest. The reads
are positional syscalls that release the GIL, so they overlap the compute.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from edgerun.offload.bundle import Bundle
from edgerun.offload.io import aligned_empty

__all__ = ["Prefetcher"]


class Prefetcher:
    """One background read at a time into a staging matrix of `capacity` records."""

    def __init__(self, bundle: Bundle, capacity: int, record_bytes: int) -> None:
        self.bundle = bundle
        self.capacity = int(capacity)
        self.buf = aligned_empty(self.capacity * record_bytes).reshape(self.capacity, record_bytes)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgerun-prefetch")
        self._pending: tuple[int, np.ndarray, Future] | None = None
        self._lock = threading.Lock()
        self.hits = 0  # prefetched records a layer used
        self.wasted = 0  # prefetched records no layer used
        self.wait_s = 0.0  # time a layer waited for its prefetch to land

    def submit(self, layer: int, ids: np.ndarray) -> None:
        """Start reading `ids` (sorted, unique) of `layer`; drops a pending one unused."""
        self._drain()
        ids = np.asarray(ids, np.int32)[: self.capacity]
        if ids.size == 0:
            return
        fut = self._pool.submit(self.bundle.read_records, layer, ids, self.buf[: ids.size])
        with self._lock:
            self._pending = (layer, ids, fut)

    def take(self, layer: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids, their records) prefetched for `layer`, or None; waits for the read."""
        with self._lock:
            p, self._pending = self._pending, None
        if p is None:
            return None
        pl, ids, fut = p
        t0 = time.perf_counter()
        fut.result()
        self.wait_s += time.perf_counter() - t0
        if pl != layer:
            self.wasted += ids.size
            return None
        return ids, self.buf[: ids.size]

    def _drain(self) -> None:
        with self._lock:
            p, self._pending = self._pending, None
        if p is not None:
            p[2].result()
            self.wasted += p[1].size

    def close(self) -> None:
        self._drain()
        self._pool.shutdown(wait=True)
