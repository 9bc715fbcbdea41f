"""The output head under a RAM budget: its first rows held, a low-rank sketch of the
others choosing the few a token reads from flash.

Why: dense streaming treated an untied head as one more matrix of rows, so every token
read the head rows it did not hold: 93 of the 437 MiB Qwen2.5-Coder-1.5B read a token
at 800M (a Q6_K head of 151,936 rows). But a token needs the head only to choose the
next token, and the rows it can choose are few. So the rows the plan does not hold get
an int8 sketch in RAM, ~70 bytes a row: logits ~= (W U)(U^T x), U the top principal
directions of the final hidden states on calibration text. Each token scores every
flash row with it, reads the `candidates` best rows of each sequence exactly (4 KiB
reads) and computes their logits with the same kernels; the other flash rows get -inf.
Held rows and read rows carry the exact logits; a token is lost only when the sketch
ranks the true best flash row below the candidates while it also beats every held row.

A sketch of the head's own rows (SVD of W) ranks poorly: W's energy is spread (top 64
directions: 26%), the hidden states' is not (top 64: 82% on code). Measured on the 1.5B
(400 decode positions of code and prose, every other one held out): the true argmax
was a flash row (id >= 74,368, the 49% held at 800M) at 1% of positions; with rank 64
and 64 candidates every one of them was found (held + read rows cover 99.94% of the
probability mass). `python benchmarks/offload_quality.py` measures the agreement.

The sketch is fitted once per model and rows (the first run under that budget) and kept
in the cache directory beside the offload bundles:
`<stem>-<key>.head<first>r<rank>v<version>.npz`.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgerun.errors import InvalidArgumentError, ModelFormatError
from edgerun.offload.io import DirectReader, drop_page_cache
from edgerun.offload.rowstream import SplitMatrix, StreamStats, read_rows, stream_ranges
from edgerun.ops import qmatvec
from edgerun.ops.lowrank import int8_row_scores
from edgerun.quant.formats import QuantTensor
from edgerun.runtime.atomic import write_atomic

__all__ = [
    "CALIBRATION_TOKENS",
    "HEAD_CANDIDATES",
    "HEAD_HELD_ROWS",
    "HEAD_RANK",
    "CandidateHead",
    "HeadSketch",
    "fit_sketch",
    "load_sketch",
    "save_sketch",
    "sketch_bytes",
    "sketch_path",
]

HEAD_RANK = 64  # principal directions of the final hidden states
HEAD_CANDIDATES = 64  # flash rows read exactly per sequence and token
# The head rows held exactly: the first (most used) tokens. Measured on the 1.5B (512
# tokens each of held-out prose and code, teacher-forced, rank 64, 64 candidates): with
# the 1,024-token prose + code calibration, 49,152 rows held agree on 99.61% / 99.80% of
# argmaxes, as 74,368 (the share 800 MiB gave the head) did with 256 prose tokens;
# 32,768: 98.24% / 99.41%.
HEAD_HELD_ROWS = 49152
CALIBRATION_TOKENS = 1024  # hidden states the directions are fitted on: half prose, half code
FORMAT_VERSION = 2  # 2: the basis fitted on prose and code (1: prose only)


@dataclass
class HeadSketch:
    """Int8 low-rank rows [first, rows) of a head: logits[r] ~= scales[r] codes[r] . (x U)."""

    basis: np.ndarray  # [cols, rank] float32 (U)
    codes: np.ndarray  # [rows - first, rank] int8
    scales: np.ndarray  # [rows - first] float32
    first: int

    @property
    def rows(self) -> int:
        return self.first + self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return self.basis.nbytes + self.codes.nbytes + self.scales.nbytes

    def scores(self, x: np.ndarray, first: int) -> np.ndarray:
        """Approximate logits of rows [first, rows) for x [n, cols] -> [n, rows - first]."""
        if first < self.first:
            raise InvalidArgumentError(f"head sketch covers rows from {self.first}, asked {first}")
        k = first - self.first
        y = np.ascontiguousarray(x, np.float32) @ self.basis
        return int8_row_scores(self.codes[k:], self.scales[k:], y)


def sketch_bytes(rows: int, cols: int, rank: int = HEAD_RANK) -> int:
    """RAM a sketch of `rows` head rows takes (the planner counts it)."""
    return rows * (rank + 4) + cols * rank * 4


def fit_basis(hidden: np.ndarray, rank: int = HEAD_RANK) -> np.ndarray:
    """The top `rank` principal directions (uncentred) of hidden states [n, cols]: their
    right singular vectors. Found with a randomized range finder (Halko, Martinsson and
    Tropp 2011: a few products with a [cols, 2 rank] block and its QR, then the SVD of an
    [n, 2 rank] matrix), because LAPACK's SVD of the 1,024 x 1,536 calibration
    states needed ~30 MiB of copies and workspace at the first run under a budget, which
    peaked 874 MB against 839 (the cols x cols Gram matrix's eigensolver: ~60 MB)."""
    h = np.asarray(hidden, np.float32)
    if h.ndim != 2 or h.shape[0] < 2:
        raise InvalidArgumentError(f"head sketch: need >= 2 hidden states [n, cols], got {h.shape}")
    n, cols = h.shape
    basis = np.zeros((cols, rank), np.float32)  # fewer states than rank: zero columns
    k = min(rank, n, cols)
    p = 2 * k
    if p >= min(n, cols):  # small: the exact SVD costs nothing
        _, _, vt = np.linalg.svd(h, full_matrices=False)
        basis[:, :k] = vt[:k].T
        return basis
    q = np.random.default_rng(0).standard_normal((cols, p)).astype(np.float32)
    for _ in range(5):  # four power iterations past the first: the subspace of H^T H
        q = np.linalg.qr(h.T @ (h @ q))[0]
    _, _, vt = np.linalg.svd(h @ q, full_matrices=False)
    basis[:, :k] = (q @ vt.T)[:, :k]
    return basis


def fit_sketch(
    head: QuantTensor,
    reader: DirectReader,
    offset: int,
    hidden: np.ndarray,
    first: int,
    rank: int = HEAD_RANK,
) -> HeadSketch:
    """Sketch rows [first, rows) of `head` (the file's tensor at byte `offset`), read in
    pieces with `reader` (direct reads: nothing left in the page cache), on the principal
    directions of `hidden`. A piece's W U is the prefill GEMM with U's columns as tokens."""
    basis = fit_basis(hidden, rank)
    rows = head.shape[0]
    n = rows - first
    codes = np.empty((n, basis.shape[1]), np.int8)
    scales = np.empty(n, np.float32)
    ut = np.ascontiguousarray(basis.T)
    for r0, r1 in stream_ranges(head, first):
        piece = read_rows(reader, offset, head, r1, first=r0)
        a = qmatvec.project(piece, ut).T  # [r1 - r0, rank]
        s = np.abs(a).max(axis=1) / np.float32(127)
        s[s == 0] = 1.0
        codes[r0 - first : r1 - first] = np.rint(a / s[:, None]).astype(np.int8)
        scales[r0 - first : r1 - first] = s
        del piece, a
    return HeadSketch(basis, codes, scales, first)


def sketch_path(cache_dir: Path, source: Path, key: str, first: int, rank: int) -> Path:
    name = f"{source.stem}-{key}.head{first}r{rank}v{FORMAT_VERSION}.npz"
    return Path(cache_dir) / "offload" / name


def source_key(source: Path, sha256: str | None) -> str:
    """What ties a sketch to its model file: the registry's hash, else size and mtime
    (hashing a 1 GB file under a RAM budget would fill the page cache)."""
    if sha256:
        return sha256[:16]
    st = os.stat(source)
    return f"{st.st_size:x}-{st.st_mtime_ns:x}"


def save_sketch(path: Path, sketch: HeadSketch, head: QuantTensor) -> Path:
    meta = {
        "version": FORMAT_VERSION,
        "tensor": head.name,
        "shape": list(head.shape),
        "first": sketch.first,
        "rank": int(sketch.basis.shape[1]),
    }

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(
                f,
                meta=np.frombuffer(json.dumps(meta).encode(), np.uint8),
                basis=sketch.basis,
                codes=sketch.codes,
                scales=sketch.scales,
            )

    write_atomic(path, write)
    drop_page_cache([path])  # written pages count against the budget too
    return path


def load_sketch(path: Path, head: QuantTensor, first: int, rank: int) -> HeadSketch | None:
    """The saved sketch of these rows of `head`, or None when there is none. A file that
    does not match the head is a clear error (delete it to fit it again)."""
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(z["meta"].tobytes().decode())
            got = {k: meta.get(k) for k in ("version", "tensor", "shape", "first", "rank")}
            want = {
                "version": FORMAT_VERSION,
                "tensor": head.name,
                "shape": list(head.shape),
                "first": first,
                "rank": rank,
            }
            for k, v in want.items():
                if got[k] != v:
                    raise ModelFormatError(
                        f"{path}: field {k!r}: expected {v!r}, found {got[k]!r} "
                        "(a head sketch of another model or version; delete the file)"
                    )
            sketch = HeadSketch(z["basis"], z["codes"], z["scales"], first)
    except (OSError, ValueError, KeyError) as e:
        raise ModelFormatError(f"{path}: unreadable head sketch ({e}); delete the file") from None
    finally:
        drop_page_cache([path])
    n = head.shape[0] - first
    if sketch.codes.shape != (n, rank) or sketch.scales.shape != (n,):
        raise ModelFormatError(
            f"{path}: codes {sketch.codes.shape}, scales {sketch.scales.shape}: expected "
            f"({n}, {rank}) and ({n},); delete the file"
        )
    return sketch


class CandidateHead:
    """x -> logits of an untied head: rows [0, held) exact from RAM, the flash rows'
    `candidates` best by the sketch read and computed exactly, the rest -inf (decode);
    every row exact, read in pieces, when all logits are asked for (prompts, perplexity).
    """

    def __init__(
        self,
        matrix: SplitMatrix,
        sketch: HeadSketch,
        reader: DirectReader,
        offset: int,
        candidates: int,
        stats: StreamStats,
    ) -> None:
        if matrix.pieces:
            raise InvalidArgumentError(f"{matrix.name}: a sketched head streams no pieces")
        if candidates < 1:
            raise InvalidArgumentError(f"head candidates must be >= 1, got {candidates}")
        self.matrix, self.sketch, self.reader, self.offset = matrix, sketch, reader, offset
        self.candidates = candidates
        self.stats = stats
        self.rows_read = 0  # flash rows read for decode since the last reset

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Every row exact (x [n, cols] -> [n, rows])."""
        m, t = self.matrix, self.matrix.template
        out = m.project(None, x, self.stats)
        for r0, r1 in stream_ranges(t, m.held_rows):
            t0 = time.perf_counter()
            piece = read_rows(self.reader, self.offset, t, r1, first=r0)
            t1 = time.perf_counter()
            out[:, r0:r1] = qmatvec.project(piece, x)
            self.stats.io_s += t1 - t0
            self.stats.compute_s += time.perf_counter() - t1
        return out

    def next_logits(self, x: np.ndarray) -> np.ndarray:
        """Decode logits: held rows and each sequence's candidates exact, others -inf."""
        m, t = self.matrix, self.matrix.template
        held = m.held_rows
        out = m.project(None, x, self.stats, decode=True)
        if held >= m.rows:
            return out
        t0 = time.perf_counter()
        s = self.sketch.scores(x, held)
        k = min(self.candidates, s.shape[1])
        best = np.argpartition(-s, k - 1, axis=1)[:, :k] if k < s.shape[1] else None
        rows = np.arange(s.shape[1]) if best is None else np.unique(best)
        rows = rows + held
        rb = t.data.shape[1]
        buf = np.empty((rows.size, rb), np.uint8)
        t1 = time.perf_counter()
        self.reader.read_into([(self.offset + int(r) * rb, rb) for r in rows], buf)
        t2 = time.perf_counter()
        buf.flags.writeable = False
        part = QuantTensor(t.name, t.qtype, (rows.size, t.shape[1]), buf)
        y = qmatvec.matvec_batch(part, x)
        out[:, held:] = -np.inf
        out[:, rows] = y
        self.rows_read += int(rows.size)
        self.stats.io_s += t2 - t1
        self.stats.compute_s += (t1 - t0) + (time.perf_counter() - t2)
        return out

    def decode_batch(self, x: np.ndarray) -> np.ndarray:
        """Several sequences' decode logits (next_logits)."""
        return self.next_logits(x)
