"""RMSNorm over the last axis."""

from __future__ import annotations

import numpy as np
from numba import njit, prange


def rmsnorm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * inv * w).astype(np.float32)


@njit(cache=True, parallel=True, fastmath=True)
def _rmsnorm(x, w, eps, out):
    n, d = x.shape
    for i in prange(n):
        s = 0.0
        for j in range(d):
            s += x[i, j] * x[i, j]
        inv = np.float32(1.0 / np.sqrt(s / d + eps))
        for j in range(d):
            out[i, j] = x[i, j] * inv * w[j]


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm of each row of x [n, d] (or a vector [d]) with gain w [d]."""
    x2 = x.reshape(-1, x.shape[-1])
    if out is None:
        out = np.empty_like(x2)
    _rmsnorm(x2, w, np.float64(eps), out.reshape(x2.shape))
    return out.reshape(x.shape)
