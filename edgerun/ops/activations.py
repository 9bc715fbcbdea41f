"""Gated FFN activations: silu(g) * u (SwiGLU) and gelu_tanh(g) * u (GeGLU)."""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from edgerun.ops._simd import GELU_C, GELU_K2, glu16


def glu_reference(g: np.ndarray, u: np.ndarray, kind: str) -> np.ndarray:
    g64 = g.astype(np.float64)
    if kind == "silu":
        with np.errstate(over="ignore"):  # exp(-g) -> inf gives the right limit, 0
            a = g64 / (1.0 + np.exp(-g64))
    elif kind == "gelu_tanh":
        a = 0.5 * g64 * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (g64 + 0.044715 * g64**3)))
    else:
        raise ValueError(kind)
    return (a * u).astype(np.float32)


@njit(cache=True, fastmath=True, inline="always")
def _silu_mul_row(g, u, out, start):
    for j in range(start, g.shape[0]):
        x = g[j]
        out[j] = x / (np.float32(1.0) + np.exp(-x)) * u[j]


@njit(cache=True, fastmath=True, inline="always")
def _gelu_tanh_mul_row(g, u, out, start):
    # 0.5 * (1 + tanh(z)) == sigmoid(2z): one exp, as in SiLU, instead of tanh, which
    # Numba leaves a scalar libm call (Gemma 3 prefill: 18 -> ~4 ns per element).
    k2 = np.float32(GELU_K2)
    c = np.float32(GELU_C)
    for j in range(start, g.shape[0]):
        x = g[j]
        z2 = k2 * (x + c * x * x * x)
        out[j] = x / (np.float32(1.0) + np.exp(-z2)) * u[j]


@njit(inline="always")
def _glu_row(gelu, g, u, out):
    # 16 lanes at a time with a vector exp (_simd.glu16): libm's scalar expf made the
    # GLU ~2 ns an element (Qwen2.5-0.5B, 4 decode rows: ~1 ms of a 23 ms step)
    n16 = g.shape[0] - g.shape[0] % 16
    if gelu:
        for j in range(0, n16, 16):
            glu16(True, g, u, out, j)
        _gelu_tanh_mul_row(g, u, out, n16)
    else:
        for j in range(0, n16, 16):
            glu16(False, g, u, out, j)
        _silu_mul_row(g, u, out, n16)


@njit(cache=True, parallel=True, fastmath=True, nogil=True)
def _glu_rows(gelu, g, u, out):
    for i in prange(g.shape[0]):
        _glu_row(gelu, g[i], u[i], out[i])


@njit(cache=True, fastmath=True, nogil=True)
def _glu_rows_serial(gelu, g, u, out):
    for i in range(g.shape[0]):
        _glu_row(gelu, g[i], u[i], out[i])


_GELU = {"silu": False, "gelu_tanh": True}  # activation name -> the kernels' switch
PARALLEL_MIN = 1 << 15  # elements below which the serial kernel is faster


def glu(g: np.ndarray, u: np.ndarray, kind: str, out: np.ndarray | None = None) -> np.ndarray:
    """act(g) * u for g, u [n, d] (float32)."""
    gelu = _GELU.get(kind)
    if gelu is None:
        raise ValueError(f"unknown activation {kind!r}")
    g, u = np.ascontiguousarray(g, np.float32), np.ascontiguousarray(u, np.float32)
    if out is None:
        out = np.empty_like(g)
    elif not out.flags.c_contiguous or out.dtype != np.float32 or out.shape != g.shape:
        raise ValueError(f"glu: out must be C-contiguous float32 {g.shape}")
    (_glu_rows if g.size >= PARALLEL_MIN else _glu_rows_serial)(gelu, g, u, out)
    return out
