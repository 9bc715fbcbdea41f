"""Scores of int8 low-rank rows: out[v, r] = scales[r] * codes[r] . y[v].

The offloaded output head (offload/head.py) ranks its flash rows with a rank-64 sketch
of them held in RAM: one int8 code row per vocabulary row. A vocabulary of 151,936 rows
at rank 64 is ~10 M multiply-adds a token, a millisecond on two threads, against reading
the rows themselves (~90 MB a token on Qwen2.5-Coder-1.5B at 800M).
"""

from __future__ import annotations

from edgerun.runtime import numba_env

numba_env.configure()

import numpy as np  # noqa: E402
from numba import njit, prange  # noqa: E402

from edgerun.errors import InvalidArgumentError  # noqa: E402

__all__ = ["int8_row_scores", "warm"]

_ROW_TILE = 256  # rows a parallel task scores (all vectors), so y stays in L1


@njit(parallel=True, cache=True, nogil=True)
def _scores(codes, scales, y, out):  # pragma: no cover - compiled
    rows, rank = codes.shape
    n = y.shape[0]
    for t in prange((rows + _ROW_TILE - 1) // _ROW_TILE):
        r0 = t * _ROW_TILE
        r1 = min(rows, r0 + _ROW_TILE)
        for r in range(r0, r1):
            s = scales[r]
            for v in range(n):
                acc = np.float32(0.0)
                for k in range(rank):
                    acc += np.float32(codes[r, k]) * y[v, k]
                out[v, r] = acc * s


def int8_row_scores(codes: np.ndarray, scales: np.ndarray, y: np.ndarray) -> np.ndarray:
    """codes int8 [rows, rank], scales float32 [rows], y float32 [n, rank] -> [n, rows]."""
    if codes.dtype != np.int8 or codes.ndim != 2:
        raise InvalidArgumentError(
            f"codes must be int8 [rows, rank], got {codes.dtype} {codes.shape}"
        )
    y = np.ascontiguousarray(y, dtype=np.float32).reshape(-1, codes.shape[1])
    if scales.shape != (codes.shape[0],):
        raise InvalidArgumentError(
            f"scales: expected [{codes.shape[0]}] for {codes.shape[0]} rows, got {scales.shape}"
        )
    out = np.empty((y.shape[0], codes.shape[0]), np.float32)
    _scores(codes, np.ascontiguousarray(scales, np.float32), y, out)
    return out


def warm() -> None:
    """Load the kernel (a warm-up, before LLVM's pages are given back)."""
    int8_row_scores(np.zeros((2, 4), np.int8), np.ones(2, np.float32), np.zeros((1, 4), np.float32))
