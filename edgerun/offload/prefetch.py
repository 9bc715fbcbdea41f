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


class ChunkPipeline:
    """Streaming reads one chunk ahead: chunk k+1 (gate rows + records) is read on a
    background thread into the other of two buffer pairs while chunk k computes, and
    the last chunk of layer L starts the first of layer L+1. With the kernels nogil,
    the reads and the compute run at the same time."""

    def __init__(self, bundle: Bundle, chunk: int, gate_row_bytes: int, record_bytes: int):
        self.bundle = bundle
        self.bufs = [
            (
                aligned_empty(chunk * gate_row_bytes).reshape(chunk, gate_row_bytes),
                aligned_empty(chunk * record_bytes).reshape(chunk, record_bytes),
            )
            for _ in range(2)
        ]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="edgerun-stream")
        self._pending: tuple[int, int, int, int, Future] | None = None
        self._free = 0
        self.wait_s = 0.0

    def _read(self, layer: int, ids: np.ndarray, slot: int) -> None:
        g, r = self.bufs[slot]
        n = ids.size
        self.bundle.read_gate_rows(layer, ids, out=g[:n])
        self.bundle.read_records(layer, ids, out=r[:n])

    def start(self, layer: int, ids: np.ndarray) -> None:
        """Begin reading `ids` (a contiguous run) of `layer` into the free buffers."""
        if self._pending is not None or ids.size == 0:
            return
        slot = self._free
        fut = self._pool.submit(self._read, layer, ids, slot)
        self._pending = (layer, int(ids[0]), int(ids.size), slot, fut)

    def get(self, layer: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Gate rows and records of `ids`: the read started for them, or a read now."""
        p, self._pending = self._pending, None
        t0 = time.perf_counter()
        if p is not None:
            p[4].result()
            if p[:3] == (layer, int(ids[0]), int(ids.size)):
                self._free = 1 - p[3]
                self.wait_s += time.perf_counter() - t0
                g, r = self.bufs[p[3]]
                return g[: ids.size], r[: ids.size]
        slot = self._free
        self._read(layer, ids, slot)
        self._free = 1 - slot
        self.wait_s += time.perf_counter() - t0
        g, r = self.bufs[slot]
        return g[: ids.size], r[: ids.size]

    def close(self) -> None:
        if self._pending is not None:
            self._pending[4].result()
            self._pending = None
        self._pool.shutdown(wait=True)
