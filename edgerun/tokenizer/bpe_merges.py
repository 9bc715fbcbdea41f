"""BPE merges in a few flat arrays: the merge table byte-level BPE encodes with.

Why our own: the ``tokenizers`` library's BPE model holds its vocabulary twice and its
merges in hash maps of strings, ~30 MiB for Qwen2.5's 151k tokens and 151k merges, in a
process whose RAM budget is every byte it holds (a byte the runtime floor takes is a
byte of weights read from flash every token, offload/). Here the merges are three sorted
arrays (2.4 MiB for Qwen2.5) and the merge loop is a Numba kernel; the library still
does what it is good at (added-token-free pre-tokenization: the split regexes and the
byte-level alphabet), and the results are its BPE model's, id for id (tests compare with
transformers on real vocabularies).

The merge order is the library's (and GPT-2's): the adjacent pair of lowest rank is
merged first, the leftmost of equal ranks; a priority queue of (rank, position) keeps a
word of n symbols at O(n log n), so a long run of text without a split is not quadratic.
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numpy as np  # noqa: E402
from numba import njit  # noqa: E402

__all__ = ["MergeTable", "merge_word"]


class MergeTable:
    """The merges (left id, right id) -> (rank, merged id), as sorted int64 keys
    (left << 32 | right) and two int32 columns. A pair listed twice keeps its last rank,
    as the library's map (built by inserting in file order) does."""

    __slots__ = ("keys", "ranks", "merged")

    def __init__(self, left: np.ndarray, right: np.ndarray, merged: np.ndarray) -> None:
        """Merge r joins ids left[r] and right[r] into merged[r]."""
        keys = (left.astype(np.int64) << 32) | right.astype(np.int64)
        ranks = np.arange(len(keys), dtype=np.int32)
        # sort by key, then keep each key's last rank (a stable sort keeps file order)
        order = np.argsort(keys, kind="stable")
        keys, ranks, merged = keys[order], ranks[order], merged.astype(np.int32)[order]
        last = np.ones(len(keys), dtype=bool)
        last[:-1] = keys[1:] != keys[:-1]
        self.keys = np.ascontiguousarray(keys[last])
        self.ranks = np.ascontiguousarray(ranks[last])
        self.merged = np.ascontiguousarray(merged[last])

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.ranks.nbytes + self.merged.nbytes

    def merge(self, ids: np.ndarray) -> np.ndarray:
        """The word whose symbols are `ids` (int32), merged."""
        return merge_word(ids, self.keys, self.ranks, self.merged)


@njit(cache=True, nogil=True)
def _find(keys, key):
    """Index of key in the sorted keys, or -1."""
    lo, hi = 0, keys.shape[0]
    while lo < hi:
        mid = (lo + hi) >> 1
        if keys[mid] < key:
            lo = mid + 1
        else:
            hi = mid
    if lo < keys.shape[0] and keys[lo] == key:
        return lo
    return -1


@njit(cache=True, nogil=True)
def _push(heap, n, item):
    heap[n] = item
    i = n
    while i > 0:
        p = (i - 1) >> 1
        if heap[p] <= heap[i]:
            break
        heap[p], heap[i] = heap[i], heap[p]
        i = p
    return n + 1


@njit(cache=True, nogil=True)
def _pop(heap, n):
    top = heap[0]
    n -= 1
    heap[0] = heap[n]
    i = 0
    while True:
        c = 2 * i + 1
        if c >= n:
            break
        if c + 1 < n and heap[c + 1] < heap[c]:
            c += 1
        if heap[i] <= heap[c]:
            break
        heap[c], heap[i] = heap[i], heap[c]
        i = c
    return top, n


@njit(cache=True, nogil=True)
def _queue_pair(heap, n, sym, nxt, pos, keys, ranks):
    """Queue the pair starting at symbol `pos` if it is a merge: key rank << 32 | pos."""
    j = nxt[pos]
    if j < 0:
        return n
    k = _find(keys, (np.int64(sym[pos]) << 32) | np.int64(sym[j]))
    if k < 0:
        return n
    return _push(heap, n, (np.int64(ranks[k]) << 32) | np.int64(pos))


@njit(cache=True, nogil=True)
def merge_word(ids, keys, ranks, merged):
    """BPE on one word: repeatedly join the adjacent pair of lowest rank (leftmost first)."""
    n = ids.shape[0]
    if n < 2:
        return ids.copy()
    sym = ids.astype(np.int32)
    prv = np.arange(-1, n - 1).astype(np.int64)
    nxt = np.arange(1, n + 1).astype(np.int64)
    nxt[n - 1] = -1
    alive = np.ones(n, np.bool_)
    heap = np.empty(2 * n + 2, np.int64)  # n initial pairs + at most 2 per merge, less pops
    h = np.int64(0)  # not the literal 0: its callees would compile a variant for it
    for i in range(n - 1):
        h = _queue_pair(heap, h, sym, nxt, i, keys, ranks)
    left = n
    while h > 0:
        top, h = _pop(heap, h)
        pos = top & 0xFFFFFFFF
        if not alive[pos]:
            continue
        j = nxt[pos]
        if j < 0:
            continue
        k = _find(keys, (np.int64(sym[pos]) << 32) | np.int64(sym[j]))
        if k < 0 or np.int64(ranks[k]) != (top >> 32):  # the pair changed since queued
            continue
        sym[pos] = merged[k]
        alive[j] = False
        nxt[pos] = nxt[j]
        if nxt[j] >= 0:
            prv[nxt[j]] = pos
        left -= 1
        if h + 2 > heap.shape[0]:  # never in practice; keeps the pushes in bounds
            bigger = np.empty(2 * heap.shape[0], np.int64)
            for i in range(h):  # a loop: a slice copy compiles Numba's shape-mismatch message
                bigger[i] = heap[i]
            heap = bigger
        if prv[pos] >= 0:
            h = _queue_pair(heap, h, sym, nxt, prv[pos], keys, ranks)
        h = _queue_pair(heap, h, sym, nxt, pos, keys, ranks)
    out = np.empty(left, np.int32)
    i, o = 0, 0
    while i >= 0:
        out[o] = sym[i]
        o += 1
        i = nxt[i]
    return out
