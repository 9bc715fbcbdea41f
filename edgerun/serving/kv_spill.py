"""Idle KV caches moved to disk under a RAM budget, and read back when their turn comes.

Why: a session keeps its KV cache between turns so that its next message computes only
itself, but a budgeted plan reserves one context window of KV for all requests
(serving/batching.py), and idle sessions' pages fall outside it: ten idle
1,000-token chats of Qwen2.5-1.5B (f16, 28 KiB a position) hold 280 MiB past an 800 MiB
budget. llama-server saves a slot only when asked; Ollama unloads the whole model. Here
the scheduler writes the least recently used idle caches to disk when a request needs
their room, and reads one back when its session is admitted again: milliseconds for a
long conversation, where recomputing its prompt takes seconds.

A spilled cache's rows live in an unlinked file in the cache directory (nothing is left
behind if the process dies), written and read with the file's page cache dropped after
(a memory cgroup counts page cache against the budget); its pages are given back with
`KVCache.release`. Its token list stays in memory, so prefix reuse works unchanged.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError
from edgerun.model.kvcache import KVCache

__all__ = ["SpillFile", "restore", "spill", "write_rows"]


class SpillFile:
    """The rows [0, positions) of a spilled cache: per (layer, head) its keys, then its
    values, each `positions` rows of the cache's own (keys' or values') row bytes, in
    an unlinked file."""

    def __init__(self, directory: Path, positions: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.file = tempfile.TemporaryFile(dir=directory)  # unlinked at once on Linux
        self.positions = positions

    def close(self) -> None:
        self.file.close()


def _pieces(k: np.ndarray, v: np.ndarray, positions: int) -> Iterator:
    """The (layer, head) pieces of rows [0, positions) of k then v: the file's order."""
    for arr in (k, v):
        for layer in range(arr.shape[0]):
            for head in range(arr.shape[1]):
                yield arr[layer, head, :positions]


def _read_pieces(sf: SpillFile, pieces: Iterator) -> None:
    """Fill each piece (rows [0, n) of one layer and head) from its place in the file,
    where every piece holds sf.positions rows; OSError on a short read."""
    at = 0
    for piece in pieces:
        _read_piece(sf, at, piece)
        at += sf.positions * piece.shape[-1] * piece.itemsize


def _read_piece(sf: SpillFile, at: int, piece: np.ndarray) -> None:
    """Rows [0, len(piece)) of the piece at byte `at` of the file into piece (contiguous)."""
    got = os.preadv(sf.file.fileno(), [memoryview(piece).cast("B")], at)
    if got != piece.nbytes:
        raise OSError(f"short read ({got} of {piece.nbytes} bytes)")


def _drop_cached_pages(fd: int) -> None:
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def spill(cache: KVCache, directory: Path) -> int:
    """Write the cache's rows to a file under `directory` and give its pages back;
    returns the bytes freed (0 if there was nothing to free). No-op if already spilled."""
    with cache.lock:
        if cache.spilled is not None:
            return 0
        freed = cache.resident_bytes
        n = cache.length
        if n:
            sf = SpillFile(directory, n)
            try:
                for piece in _pieces(cache.k, cache.v, n):
                    sf.file.write(memoryview(piece).cast("B"))
                sf.file.flush()
                os.fsync(sf.file.fileno())  # written back, so the pages can be dropped
                _drop_cached_pages(sf.file.fileno())
            except OSError as e:
                sf.close()
                raise EdgerunError(
                    f"cannot move an idle KV cache to {directory}: {e.strerror or e}"
                ) from None
            cache.spilled = sf
        cache.release()
        return freed


def restore(cache: KVCache, positions: int | None = None) -> int:
    """Read a spilled cache's rows back (the first `positions` of them; the rest are
    forgotten, as truncate does) and delete the file; returns the positions restored.
    If the file cannot be read, the cache is emptied (its owner recomputes the prompt:
    slower, nothing lost) and a warning says why."""
    with cache.lock:
        sf = cache.spilled
        if sf is None:
            return 0
        n = sf.positions if positions is None else min(int(positions), sf.positions)
        try:
            _read_pieces(sf, _pieces(cache.k, cache.v, n))
            _drop_cached_pages(sf.file.fileno())
        except OSError as e:
            warnings.warn(
                f"an idle KV cache could not be read back from disk ({e}); "
                "its prompt is computed again",
                RuntimeWarning,
                stacklevel=2,
            )
            n = 0
        finally:
            sf.close()
            cache.spilled = None
        cache.mark_written(n)
        cache.truncate(cache.reusable(n))  # recurrent states go back only to kept positions
        return cache.length


def write_rows(cache: KVCache, out) -> int:
    """Write the cache's rows [0, length) to the binary file `out` as k then v, each in
    C order [layers, kv_heads, length, row] and the cache's own dtype: a piece (one
    layer and head) at a time, so that saving a session holds no copy of its KV cache. A
    spilled cache's pieces are copied from its file and it stays spilled. Call with
    cache.lock held (rows and tokens of one moment); returns the bytes written."""
    n = cache.length
    written = 0
    if cache.spilled is None:
        for piece in _pieces(cache.k, cache.v, n):
            written += out.write(memoryview(piece).cast("B"))
        return written
    sf = cache.spilled
    at = 0
    try:
        for piece in _pieces(cache.k, cache.v, n):
            buf = np.empty(piece.shape, piece.dtype)
            try:
                _read_piece(sf, at, buf)
            except OSError as e:
                raise EdgerunError(f"cannot read an idle KV cache back from disk: {e}") from None
            at += sf.positions * buf.shape[-1] * buf.itemsize
            written += out.write(memoryview(buf).cast("B"))
    finally:
        _drop_cached_pages(sf.file.fileno())
    return written
