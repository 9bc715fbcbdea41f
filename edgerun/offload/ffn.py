"""The sparse FFN executor over a flash bundle (CATS + windowing).

It computes down(act(gate x) * up x) of one layer with the up rows and down columns
read from the bundle (edgerun/offload/bundle.py) instead of a resident matrix:

- `SparseFFN`: the gate rows are resident, so g = gate x is exact; neurons with
  |act(g)| below the layer's calibrated threshold are skipped (CATS); the others'
  records come from the layer's NeuronCache (windowing), and only the missing ones
  are read. Threshold 0 keeps every neuron: the dense FFN through the same path.
Dense streaming (LLM in a flash's "hybrid" baseline) needs no bundle: it streams the
file's own rows (offload/rowstream.py).

The I/O, cache bookkeeping and compute times are counted in one OffloadStats per model
(the paper's per-token breakdown).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from edgerun.offload.bundle import Bundle
from edgerun.offload.cache import NeuronCache
from edgerun.offload.prefetch import Prefetcher
from edgerun.ops import qmatvec
from edgerun.ops import sparse_ffn as sf
from edgerun.ops.activations import glu
from edgerun.quant.formats import QuantTensor

__all__ = ["OffloadStats", "SparseFFN"]


@dataclass
class OffloadStats:
    """Per-model counters; bytes come from the bundle's reader."""

    io_s: float = 0.0
    mm_s: float = 0.0
    compute_s: float = 0.0
    active: int = 0  # neurons computed (decode)
    neurons: int = 0  # neurons considered (decode)

    def reset(self) -> None:
        self.io_s = self.mm_s = self.compute_s = 0.0
        self.active = self.neurons = 0


def _glu(g: np.ndarray, u: np.ndarray, activation: str) -> np.ndarray:
    """act(g) * u for a vector or a [n, d] matrix (the kernel takes rows)."""
    if g.ndim == 1:
        return glu(g.reshape(1, -1), u.reshape(1, -1), activation).reshape(-1)
    return glu(g, u, activation)


def _act(g: np.ndarray, activation: str) -> np.ndarray:
    """act(g) elementwise."""
    return _glu(g, np.ones_like(g), activation)


class SparseFFN:
    """One layer's FFN: resident gate, thresholded neurons, records via a NeuronCache."""

    def __init__(
        self,
        bundle: Bundle,
        layer: int,
        gate: QuantTensor,
        threshold: float,
        activation: str,
        cache: NeuronCache | None,
        scratch: np.ndarray,
        stats: OffloadStats,
        prefetcher: Prefetcher | None = None,
    ) -> None:
        ly = bundle.layer(layer)
        self.bundle, self.layer, self.ly = bundle, layer, ly
        self.prefetcher = prefetcher
        self.next: SparseFFN | None = None  # the layer to prefetch for when this one is done
        self.last_ids: np.ndarray | None = None
        self.gate = gate
        self.threshold = np.float32(threshold)
        self.activation = activation
        self.cache = cache
        self.scratch = scratch  # uint8 [chunk, record_bytes], shared by all layers
        self.stats = stats
        self.d_model, self.d_ff = ly.d_model, ly.d_ff

    # ------------------------------------------------------------------ decode
    def _decode(self, x: np.ndarray) -> np.ndarray:
        st, ly = self.stats, self.ly
        t0 = time.perf_counter()
        a = _act(qmatvec.matvec(self.gate, x), self.activation)
        ids = np.flatnonzero(np.abs(a) >= self.threshold).astype(np.int32)
        out = np.zeros(self.d_model, np.float32)
        st.active += ids.size
        st.neurons += self.d_ff
        t1 = time.perf_counter()
        st.compute_s += t1 - t0
        pre = self.prefetcher.take(self.layer) if self.prefetcher is not None else None
        t2 = time.perf_counter()
        st.io_s += t2 - t1
        cache = self.cache
        if cache is None:
            missing, room, fill = ids, 0, None
        else:
            present, missing = cache.lookup(ids)
            # The cache takes the missing neurons it has room for this token; the rest
            # (a token that needs more than the cache holds) are computed from scratch.
            room = max(0, min(missing.size, cache.capacity - cache.n_pinned - present.size))
            fill = cache.admit(missing[:room])
        t3 = time.perf_counter()
        st.mm_s += t3 - t2
        chunk_n = self.scratch.shape[0]
        for c0 in range(0, missing.size, chunk_n):
            m = missing[c0 : c0 + chunk_n]
            buf = self.scratch[: m.size]
            t4 = time.perf_counter()
            self._fetch(m, buf, pre)
            t5 = time.perf_counter()
            st.io_s += t5 - t4
            n_take = int(np.clip(room - c0, 0, m.size))
            if n_take:
                cache.parts["record"][fill[c0 : c0 + n_take]] = buf[:n_take]
            t6 = time.perf_counter()
            st.mm_s += t6 - t5
            if n_take < m.size:
                rest, rbuf = m[n_take:], buf[n_take:]
                up = sf.matvec_rows(ly.up_format, self.d_model, rbuf, None, x)
                sf.accumulate_q8_0_rows(rbuf, a[rest] * up, out, None, offset=ly.up_row_bytes)
            st.compute_s += time.perf_counter() - t6
        if cache is not None:
            t7 = time.perf_counter()
            rec = cache.parts["record"]
            slots = cache.id_to_slot[ids]
            held = slots >= 0
            idx = slots[held].astype(np.int32)
            if idx.size:
                up = sf.matvec_rows(ly.up_format, self.d_model, rec, idx, x)
                sf.accumulate_q8_0_rows(rec, a[ids[held]] * up, out, idx, offset=ly.up_row_bytes)
            cache.step()
            st.compute_s += time.perf_counter() - t7
        self.last_ids = ids
        if self.next is not None:
            self.next.start_prefetch()
        return out

    def start_prefetch(self) -> None:
        """Read this layer's likely neurons (the last token's, minus the cached) ahead."""
        if self.prefetcher is None or self.last_ids is None:
            return
        ids = self.last_ids
        if self.cache is not None:
            ids = ids[self.cache.id_to_slot[ids] < 0]
        self.prefetcher.submit(self.layer, ids)

    def _fetch(self, ids: np.ndarray, out: np.ndarray, pre) -> None:
        """Records of sorted `ids` into out: from the prefetched ones, the rest from flash."""
        if pre is None:
            self.bundle.read_records(self.layer, ids, out=out)
            return
        pids, pbuf = pre
        pos = np.minimum(np.searchsorted(pids, ids), max(0, pids.size - 1))
        found = pids[pos] == ids if pids.size else np.zeros(ids.size, bool)
        nf = int(found.sum())
        self.prefetcher.hits += nf
        if nf:
            out[found] = pbuf[pos[found]]
        if nf < ids.size:
            out[~found] = self.bundle.read_records(self.layer, ids[~found])

    # ----------------------------------------------------------------- prefill
    def _prefill(self, x: np.ndarray) -> np.ndarray:
        """Several tokens: read the union of their active neurons once, bypassing the cache."""
        st, ly = self.stats, self.ly
        if self.prefetcher is not None:
            self.prefetcher.take(self.layer)  # a decode-time guess; not used here
        t0 = time.perf_counter()
        a = _act(qmatvec.matmul(self.gate, x), self.activation)  # [n, d_ff]
        keep = np.abs(a) >= self.threshold
        ids = np.flatnonzero(keep.any(axis=0)).astype(np.int32)
        coeff_all = np.where(keep, a, np.float32(0.0))
        out = np.zeros((x.shape[0], self.d_model), np.float32)
        st.compute_s += time.perf_counter() - t0
        for c0 in range(0, ids.size, self.scratch.shape[0]):
            chunk = ids[c0 : c0 + self.scratch.shape[0]]
            t0 = time.perf_counter()
            buf = self.scratch[: chunk.size]
            self.bundle.read_records(self.layer, chunk, out=buf)
            t1 = time.perf_counter()
            up_rows = np.ascontiguousarray(buf[:, : ly.up_row_bytes])
            up = qmatvec.matmul(
                QuantTensor("up", ly.up_format, (chunk.size, self.d_model), up_rows), x
            )
            coeff = np.ascontiguousarray(coeff_all[:, chunk] * up)
            sf.accumulate_q8_0_rows_many(buf, coeff, out, None, offset=ly.up_row_bytes)
            st.io_s += t1 - t0
            st.compute_s += time.perf_counter() - t1
        return out

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if x.shape[0] == 1:
            return self._decode(x[0]).reshape(1, -1)
        return self._prefill(x)
