"""RMSNorm and LayerNorm (mean-centred, no bias: Cohere) over the last axis."""

from __future__ import annotations

import numpy as np
from numba import njit, prange

PARALLEL_MIN = 1 << 15  # elements below which the serial kernel is faster


def rmsnorm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    inv = 1.0 / np.sqrt(np.mean(x64 * x64, axis=-1, keepdims=True) + eps)
    return (x64 * inv * w).astype(np.float32)


@njit(cache=True, fastmath=True, inline="always")
def _rmsnorm_row(x, w, eps, out):
    d = x.shape[0]
    s = 0.0
    for j in range(d):
        s += x[j] * x[j]
    inv = np.float32(1.0 / np.sqrt(s / d + eps))
    for j in range(d):
        out[j] = x[j] * inv * w[j]


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def _rmsnorm(x, w, eps, out):
    for i in prange(x.shape[0]):
        _rmsnorm_row(x[i], w, eps, out[i])


@njit(cache=True, fastmath=True, nogil=True)
def _rmsnorm_serial(x, w, eps, out):
    for i in range(x.shape[0]):
        _rmsnorm_row(x[i], w, eps, out[i])


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None) -> np.ndarray:
    """RMSNorm of each row of x [n, d] (or a vector [d]) with gain w [d]."""
    x2 = x.reshape(-1, x.shape[-1])
    if out is None:
        out = np.empty_like(x2)
    # a parallel region costs microseconds; one token's norm is smaller than that
    kernel = _rmsnorm if x2.size >= PARALLEL_MIN else _rmsnorm_serial
    kernel(x2, w, np.float64(eps), out.reshape(x2.shape))
    return out.reshape(x.shape)


def layernorm_reference(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    x64 = x.astype(np.float64)
    c = x64 - x64.mean(axis=-1, keepdims=True)
    inv = 1.0 / np.sqrt(np.mean(c * c, axis=-1, keepdims=True) + eps)
    return (c * inv * w).astype(np.float32)


@njit(cache=True, fastmath=True, inline="always")
def _layernorm_row(x, w, eps, out):
    d = x.shape[0]
    s = 0.0
    for j in range(d):
        s += x[j]
    mean = np.float32(s / d)
    v = 0.0
    for j in range(d):
        t = x[j] - mean
        v += t * t
    inv = np.float32(1.0 / np.sqrt(v / d + eps))
    for j in range(d):
        out[j] = (x[j] - mean) * inv * w[j]


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def _layernorm(x, w, eps, out):
    for i in prange(x.shape[0]):
        _layernorm_row(x[i], w, eps, out[i])


@njit(cache=True, fastmath=True, nogil=True)
def _layernorm_serial(x, w, eps, out):
    for i in range(x.shape[0]):
        _layernorm_row(x[i], w, eps, out[i])


def layernorm(
    x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray | None = None
) -> np.ndarray:
    """LayerNorm without bias of each row of x [n, d] (or a vector [d]) with gain w [d]:
    (x - mean) / sqrt(var + eps) * w."""
    x2 = x.reshape(-1, x.shape[-1])
    if out is None:
        out = np.empty_like(x2)
    kernel = _layernorm if x2.size >= PARALLEL_MIN else _layernorm_serial
    kernel(x2, w, np.float64(eps), out.reshape(x2.shape))
    return out.reshape(x.shape)
