"""Gated FFN activations: silu(g) * u (SwiGLU) and gelu_tanh(g) * u (GeGLU)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange


def glu_reference(g: np.ndarray, u: np.ndarray, kind: str) -> np.ndarray:
    g64 = g.astype(np.float64)
    if kind == "silu":
        a = g64 / (1.0 + np.exp(-g64))
    elif kind == "gelu_tanh":
        a = 0.5 * g64 * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g64 + 0.044715 * g64**3)))
    else:
        raise ValueError(kind)
    return (a * u).astype(np.float32)


@njit(cache=True, parallel=True, fastmath=True)
def _silu_mul(g, u, out):
    n, d = g.shape
    for i in prange(n):
        for j in range(d):
            x = g[i, j]
            out[i, j] = x / (np.float32(1.0) + np.exp(-x)) * u[i, j]


@njit(cache=True, parallel=True, fastmath=True)
def _gelu_tanh_mul(g, u, out):
    n, d = g.shape
    k = np.float32(math.sqrt(2.0 / math.pi))
    for i in prange(n):
        for j in range(d):
            x = g[i, j]
            out[i, j] = (
                np.float32(0.5)
                * x
                * (np.float32(1.0) + np.tanh(k * (x + np.float32(0.044715) * x * x * x)))
                * u[i, j]
            )


def glu(g: np.ndarray, u: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
    """act(g) * u for g, u [n, d]."""
    if out is None:
        out = np.empty_like(g)
    if kind == "silu":
        _silu_mul(g, u, out)
    elif kind == "gelu_tanh":
        _gelu_tanh_mul(g, u, out)
    else:
        raise ValueError(f"unknown activation {kind!r}")
    return out
