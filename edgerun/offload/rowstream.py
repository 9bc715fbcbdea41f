"""Dense FFN streaming in the source file's own format, read ahead continuously.

Every FFN matrix is row-major, and a matvec's rows are independent, so any row range
of gate, up or down is computed on its own with the resident kernels. Dense streaming
(the paper's hybrid baseline) therefore needs no bundle: each matrix keeps rows
[0, held) in RAM and its other rows are read every token, as the GGUF stores them,
in pieces of about PIECE_BYTES. The results are bit-identical to the resident model.

The pieces a token needs are the same every token and come in the same order (layer
by layer: gate, up, down), so reader threads read them in that cycle, as far ahead
as its ring of buffers allows, across layer and token boundaries: the storage is
never idle while attention, the held rows or the sampler compute. Measured against
the bundled stream (one chunk ahead, down columns requantized to Q8_0) on
Qwen2.5-Coder-1.5B: benchmarks/results/offload_rowstream.txt.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from edgerun.errors import InvalidArgumentError
from edgerun.model.ffn import gaussian_topk
from edgerun.offload.io import ALIGN, DirectReader, aligned_empty
from edgerun.ops import qmatvec
from edgerun.ops.activations import glu
from edgerun.quant.formats import QuantTensor

__all__ = [
    "PIECE_BYTES",
    "READERS",
    "RING_SLOTS",
    "RowStream",
    "SplitMatrix",
    "StreamedFFN",
    "StreamedProjection",
    "StreamStats",
    "stream_ranges",
]

PIECE_BYTES = 2 << 20  # one read: large enough for the storage's full rate
RING_SLOTS = 4  # pieces read ahead (one of them is being computed)
READERS = 2  # pieces read at once (RowStream)
ROW_MULTIPLE = 64  # piece boundaries on multiples of the kernels' row tiles


@dataclass
class StreamStats:
    io_s: float = 0.0  # compute waiting for a piece
    compute_s: float = 0.0

    def reset(self) -> None:
        self.io_s = self.compute_s = 0.0


class RowStream:
    """Reader threads over a fixed cycle of file ranges, into a ring of buffers.

    `take(k)` returns piece k's bytes (valid until `release()`); the readers are by then
    reading the pieces after it. A consumer that asks out of order (an exception in the
    middle of a forward, a layer moved elsewhere) makes the ring drop what it read ahead
    and restart at the piece asked for: slower, never wrong.

    Several readers (READERS) each read a piece at a time, so one read's set-up overlaps
    another's transfer. Why: a piece costs a fixed ~0.3-0.4 ms beyond its bytes here, so
    one reader's rate fell with the piece size, and the KV loan (offload/kv_loan.py), which
    shortens every matrix's streamed rows, shrank the reads without making them faster.
    Measured on Qwen2.5-0.5B's stream at 400 MiB (72 pieces of ~1.2 MiB, 90 MB), no
    compute beside it: one reader 47 ms a cycle (1.9 GB/s), two 37-40 (2.2-2.4), three
    35-37; with 2 MiB pieces (135 MB) 74 -> 70 ms.
    """

    def __init__(
        self, reader: DirectReader, slots: int = RING_SLOTS, readers: int | None = None
    ) -> None:
        """readers: pieces read at once (default READERS, at most slots - 1: one buffer
        is the consumer's)."""
        if slots < 2:
            raise InvalidArgumentError(f"a row stream needs >= 2 buffers, got {slots}")
        if readers is None:
            readers = min(READERS, slots - 1)
        if not 1 <= readers < slots:
            raise InvalidArgumentError(
                f"a row stream needs 1 to {slots - 1} readers for {slots} buffers, got {readers}"
            )
        self.reader = reader
        self.slots = slots
        self.readers = readers
        self.ranges: list[tuple[int, int]] = []
        self._spans: list[tuple[int, int]] = []
        self.slot_bytes = 0
        self._bufs: list[np.ndarray] = []
        self._free: deque[int] = deque()
        self._ready: dict[int, int] = {}  # piece -> slot, read in this generation
        self._inflight: set[tuple[int, int]] = set()  # (piece, generation) being read
        self._next = 0
        self._gen = 0
        self._held: int | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self._threads: list[threading.Thread] = []

    def add(self, offset: int, nbytes: int) -> int:
        """Append a file range to the cycle (before the first take); its piece index."""
        if self._threads:
            raise InvalidArgumentError("row stream: ranges are fixed once reading started")
        a0 = offset - offset % ALIGN  # read as its aligned superset, straight in (O_DIRECT)
        a1 = min(-(-(offset + nbytes) // ALIGN) * ALIGN, self.reader.size)
        self.ranges.append((int(offset), int(nbytes)))
        self._spans.append((a0, a1))
        self.slot_bytes = max(self.slot_bytes, a1 - a0)
        return len(self.ranges) - 1

    def _start(self) -> None:
        if not self.ranges:
            raise InvalidArgumentError("a row stream needs at least one range")
        if len(self._bufs) != self.slots or any(b.size < self.slot_bytes for b in self._bufs):
            self._bufs = [aligned_empty(self.slot_bytes) for _ in range(self.slots)]
        self._free.extend(range(self.slots))
        self._threads = [
            threading.Thread(target=self._run, name=f"edgerun-rowstream-{i}", daemon=True)
            for i in range(self.readers)
        ]
        for t in self._threads:
            t.start()

    def _pending(self, k: int) -> bool:
        """Whether piece k of this generation is read or being read (not yet taken)."""
        return k in self._ready or (k, self._gen) in self._inflight

    def _run(self) -> None:
        cv = self._cv
        while True:
            with cv:
                # never a piece twice at once: a cycle shorter than the read-ahead waits
                while not self._closed and (not self._free or self._pending(self._next)):
                    cv.wait()
                if self._closed:
                    return
                slot = self._free.popleft()
                k, gen = self._next, self._gen
                self._next = (k + 1) % len(self.ranges)
                self._inflight.add((k, gen))
            try:
                a0, a1 = self._spans[k]
                self.reader.read_into([(a0, a1 - a0)], self._bufs[slot])
            except BaseException as e:  # handed to the consumer, which raises it
                with cv:
                    self._error = e
                    self._free.append(slot)
                    self._inflight.discard((k, gen))
                    cv.notify_all()
                return
            with cv:
                self._inflight.discard((k, gen))
                if gen == self._gen:
                    self._ready[k] = slot
                else:
                    self._free.append(slot)
                cv.notify_all()

    def take(self, k: int) -> np.ndarray:
        """Piece k's bytes (uint8, exactly the range asked for)."""
        cv = self._cv
        with cv:
            if not self._threads:
                self._start()
            if self._held is not None:
                raise InvalidArgumentError("row stream: release() the last piece first")
            while True:
                if self._error is not None:
                    raise self._error
                if k in self._ready:
                    slot = self._ready.pop(k)
                    break
                if (k, self._gen) not in self._inflight and self._next != k:
                    self._restart(k)  # out of order: drop the read-ahead
                cv.wait()
        self._held = slot
        off, n = self.ranges[k]
        a0 = self._spans[k][0]
        piece = self._bufs[slot][off - a0 : off - a0 + n]
        piece.flags.writeable = False  # the type mapped weights have (one compiled kernel)
        return piece

    def clear(self) -> None:
        """Forget the cycle's ranges, to add a new cycle (before the first take, or
        after close())."""
        with self._cv:
            if self._threads:
                raise InvalidArgumentError("row stream: close() it before changing its ranges")
            self.ranges.clear()
            self._spans.clear()
            self.slot_bytes = 0

    def _restart(self, k: int) -> None:
        self._free.extend(self._ready.values())
        self._ready.clear()
        self._gen += 1
        self._next = k
        self._cv.notify_all()

    def release(self) -> None:
        with self._cv:
            if self._held is not None:
                self._free.append(self._held)
                self._held = None
                self._cv.notify_all()

    def close(self, free_ring: bool = True) -> None:
        """Stop the reader threads and free the ring. A later take() starts both again,
        so closing an idle model's stream loses nothing.

        free_ring=False keeps the ring's buffers for the restart (a rebuilt cycle,
        DenseStreamStore.hold_more). Why: on this project's VMs (Firecracker, free page
        reporting) direct reads into buffers allocated after the load ran at 0.8 GB/s
        against 1.8-2.3 GB/s into the ones allocated at the first read, the same spans
        alternating between them; a stream rebuilt with new buffers decoded the 1.5B
        at 1.1-1.4 tok/s instead of 2.6-3.2 (the same stream before the rebuild)."""
        with self._cv:
            if self._held is not None:
                raise InvalidArgumentError("row stream: release() the last piece first")
            self._closed = True
            self._cv.notify_all()
            threads, self._threads = self._threads, []
        for t in threads:
            t.join()
        with self._cv:
            self._closed = False
            if free_ring:
                self._bufs = []
            self._free.clear()
            self._ready.clear()
            self._inflight.clear()
            self._next = 0
            self._gen += 1


@dataclass
class SplitMatrix:
    """A matrix whose first rows are in RAM and the rest stream as pieces.

    held: rows [0, held.rows); more: (first row, end row, rows) held after it (hold());
    pieces: (piece index in the stream, first row, end row)."""

    name: str
    template: QuantTensor  # the file's tensor: format, shape, row bytes
    held: QuantTensor | None
    pieces: list[tuple[int, int, int]] = field(default_factory=list)
    more: list[tuple[int, int, QuantTensor]] = field(default_factory=list)

    @property
    def rows(self) -> int:
        return self.template.shape[0]

    @property
    def held_rows(self) -> int:
        """The rows in RAM: [0, held_rows)."""
        if self.more:
            return self.more[-1][1]
        return 0 if self.held is None else self.held.shape[0]

    def hold(self, reader: DirectReader, offset: int, rows: int) -> tuple[int, list]:
        """Read rows [held_rows, rows') into RAM (rows' = rows rounded down to
        ROW_MULTIPLE unless it is all of them; `offset` is the matrix's in the file).
        Returns (bytes read, the row ranges still to stream); the caller gives those
        their stream pieces."""
        t = self.template
        r0, r1 = self.held_rows, self.hold_end(rows)
        if r1 <= r0:
            return 0, stream_ranges(t, r0)
        part = read_rows(reader, offset, t, r1, first=r0)
        self.attach(r1, part.data)
        return part.data.nbytes, stream_ranges(t, r1)

    def hold_end(self, rows: int) -> int:
        """The end row hold(rows) keeps: rows rounded down to ROW_MULTIPLE, unless all."""
        return self.rows if rows >= self.rows else rows // ROW_MULTIPLE * ROW_MULTIPLE

    def attach(self, r1: int, data: np.ndarray) -> None:
        """Hold rows [held_rows, r1) whose bytes the caller read into `data` (uint8
        [r1 - held_rows, row bytes], e.g. a view of one buffer shared by many matrices)."""
        t = self.template
        r0 = self.held_rows
        if data.shape != (r1 - r0, t.data.shape[1]):
            raise InvalidArgumentError(
                f"{self.name}: rows [{r0}, {r1}) need a [{r1 - r0}, {t.data.shape[1]}] buffer, "
                f"got {data.shape}"
            )
        data.flags.writeable = False  # the type mapped weights have (one compiled kernel)
        self.more.append((r0, r1, QuantTensor(t.name, t.qtype, (r1 - r0, t.shape[1]), data)))

    def detach(self, keep: int) -> None:
        """Forget the held parts after the first `keep` of `more` (their rows stream
        again once the caller rebuilds the pieces from held_rows)."""
        del self.more[keep:]

    def project(
        self, stream: RowStream | None, x: np.ndarray, stats: StreamStats, decode: bool = False
    ) -> np.ndarray:
        """x [n, cols] -> [n, rows], as qmatvec.project on the whole matrix computes it
        (decode: as qmatvec.matvec_batch does, each row a one-token matvec's)."""
        t = self.template
        mul = qmatvec.matvec_batch if decode else qmatvec.project
        out = np.empty((x.shape[0], self.rows), np.float32)
        t0 = time.perf_counter()
        parts = [] if self.held is None else [(0, self.held.shape[0], self.held)]
        parts += self.more
        if decode or x.shape[0] == 1:  # held parts (the plan's, deferred, lent) in few
            # launches with x quantized once per three: the same rows as one call each
            ys = qmatvec.matvec_batch_many([p for _, _, p in parts], x)
            for (r0, r1, _), y in zip(parts, ys, strict=True):
                out[:, r0:r1] = y
        else:
            for r0, r1, part in parts:
                out[:, r0:r1] = mul(part, x)
        t1 = time.perf_counter()
        stats.compute_s += t1 - t0
        rb = t.data.shape[1]
        for k, r0, r1 in self.pieces:
            t0 = time.perf_counter()
            buf = stream.take(k)
            t1 = time.perf_counter()
            try:
                piece = QuantTensor(t.name, t.qtype, (r1 - r0, t.shape[1]), buf.reshape(-1, rb))
                out[:, r0:r1] = mul(piece, x)
            finally:
                stream.release()
            stats.io_s += t1 - t0
            stats.compute_s += time.perf_counter() - t1
        return out


class StreamedProjection:
    """x -> W x for one split matrix on the stream: the output head under a budget."""

    def __init__(self, matrix: SplitMatrix, stream: RowStream, stats: StreamStats) -> None:
        self.matrix, self.stream, self.stats = matrix, stream, stats

    def __call__(self, x: np.ndarray) -> np.ndarray:
        return self.matrix.project(self.stream, x, self.stats)

    def decode_batch(self, x: np.ndarray) -> np.ndarray:
        """Several sequences' decode rows, each as its one-token call computes it."""
        return self.matrix.project(self.stream, x, self.stats, decode=True)

    def next_logits(self, x: np.ndarray) -> np.ndarray:
        """The logits a token is chosen from (x [1, cols]): every row, as __call__."""
        return self.matrix.project(self.stream, x, self.stats)


class StreamedFFN:
    """down(act(gate x) * up x) with each matrix split between RAM and the stream."""

    def __init__(
        self,
        gate: SplitMatrix,
        up: SplitMatrix,
        down: SplitMatrix,
        activation: str,
        stream: RowStream,
        stats: StreamStats,
        sparsity: float | None = None,
    ) -> None:
        self.gate, self.up, self.down = gate, up, down
        self.activation = activation
        self.sparsity = sparsity  # Gemma 3n's gate sparsity (model/ffn.gaussian_topk)
        self.stream = stream
        self.stats = stats
        self.d_ff, self.d_model = gate.template.shape

    def __call__(self, x: np.ndarray) -> np.ndarray:
        s, st = self.stream, self.stats
        g = self.gate.project(s, x, st)
        u = self.up.project(s, x, st)
        t0 = time.perf_counter()
        if self.sparsity is not None:
            g = gaussian_topk(g, self.sparsity)
        h = glu(g, u, self.activation)
        st.compute_s += time.perf_counter() - t0
        return self.down.project(s, h, st)

    def decode_batch(self, x: np.ndarray) -> np.ndarray:
        """Several sequences' decode rows in one pass over the stream, each row as its
        one-token call computes it. Without it batched decode ran the FFN row by row
        and streamed every row once per sequence: 4 concurrent requests on the 1.5B at
        800M decoded 1.09x one request's aggregate."""
        s, st = self.stream, self.stats
        g = self.gate.project(s, x, st, decode=True)
        u = self.up.project(s, x, st, decode=True)
        t0 = time.perf_counter()
        if self.sparsity is not None:
            g = gaussian_topk(g, self.sparsity)
        h = glu(g, u, self.activation)
        st.compute_s += time.perf_counter() - t0
        return self.down.project(s, h, st, decode=True)


def split_rows(
    t: QuantTensor, held: int, piece_bytes: int = PIECE_BYTES
) -> tuple[int, list[tuple[int, int]]]:
    """Rows [0, held') kept (held rounded down to ROW_MULTIPLE, so never more than the
    plan gave) and the streamed row ranges, each about piece_bytes and on ROW_MULTIPLE
    boundaries."""
    rows = t.shape[0]
    held = rows if held >= rows else max(0, held) // ROW_MULTIPLE * ROW_MULTIPLE
    return held, stream_ranges(t, held, piece_bytes)


def stream_ranges(
    t: QuantTensor, first: int, piece_bytes: int = PIECE_BYTES
) -> list[tuple[int, int]]:
    """Rows [first, rows) of t as streamed pieces of about piece_bytes, on ROW_MULTIPLE
    boundaries."""
    rows, rb = t.shape[0], t.data.shape[1]
    step = max(ROW_MULTIPLE, piece_bytes // rb // ROW_MULTIPLE * ROW_MULTIPLE)
    return [(r, min(rows, r + step)) for r in range(first, rows, step)]


def read_rows(
    reader: DirectReader, offset: int, t: QuantTensor, rows: int, first: int = 0
) -> QuantTensor:
    """Rows [first, rows) of tensor t (at file `offset`) read into anonymous memory, so
    they leave nothing in the page cache."""
    rb = t.data.shape[1]
    buf = np.empty((rows - first, rb), np.uint8)
    if rows > first:
        reader.read_into([(offset + first * rb, (rows - first) * rb)], buf)
    buf.flags.writeable = False  # the type mapped weights have (one compiled kernel)
    return QuantTensor(t.name, t.qtype, (rows - first, t.shape[1]), buf)
