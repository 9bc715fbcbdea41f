"""Rotary position embedding, interleaved-pair (llama.cpp NORM) or NeoX layout."""

from __future__ import annotations

import numpy as np
from numba import njit, prange


def yarn_ramp(
    rope_dim: int, base: float, orig_context: int, beta_fast: float, beta_slow: float
) -> np.ndarray:
    """YaRN's share of each frequency pair [rope_dim // 2] that keeps its original
    (extrapolated) frequency, 1 for the fast pairs down to 0 for the slow ones, as
    ggml's rope_yarn with ext_factor 1: the correction dims of ggml_rope_yarn_corr_dims
    (float32, floored / ceiled, clamped to 0..rope_dim - 1), then a linear ramp."""
    f32 = np.float32

    def corr_dim(n_rot: float) -> np.float32:
        num = f32(rope_dim) * np.log(f32(orig_context) / (f32(n_rot) * f32(2) * f32(np.pi)))
        return f32(num / (f32(2) * np.log(f32(base))))

    low = max(0.0, float(np.floor(corr_dim(beta_fast))))
    high = min(float(rope_dim - 1), float(np.ceil(corr_dim(beta_slow))))
    y = (np.arange(rope_dim // 2, dtype=np.float64) - low) / max(0.001, high - low)
    return 1.0 - np.clip(y, 0.0, 1.0)


def rope_tables(
    n_ctx: int,
    rope_dim: int,
    base: float | None,
    freq_factors: np.ndarray | None = None,
    mscale: float = 1.0,
    yarn: tuple[float, int, float, float] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables [n_ctx, rope_dim // 2], computed in float64 then rounded once.

    freq_factors [rope_dim // 2]: each frequency is divided by its factor (llama.cpp's
    ggml_rope_ext freq_factors: Llama 3's rope scaling, LongRoPE's short / long factors).
    mscale multiplies cos and sin, so q and k both carry it and the scores its square
    (LongRoPE's and YaRN's attention factor, llama.cpp's attn_factor times rope_yarn's
    own 1 + 0.1 ln(factor)). yarn (freq_scale, original context, beta_fast, beta_slow):
    each frequency blends its interpolated value (times freq_scale) with its original one
    by yarn_ramp. base None: the tables of no rotation (cos 1, sin 0), for a layer
    without RoPE."""
    half = rope_dim // 2
    if base is None:
        return np.ones((n_ctx, half), np.float32), np.zeros((n_ctx, half), np.float32)
    inv_freq = 1.0 / (base ** (np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim))
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    if yarn is not None:
        freq_scale, orig_context, beta_fast, beta_slow = yarn
        mix = yarn_ramp(rope_dim, base, orig_context, beta_fast, beta_slow)
        inv_freq = inv_freq * freq_scale * (1.0 - mix) + inv_freq * mix
    ang = np.arange(n_ctx, dtype=np.float64)[:, None] * inv_freq[None, :]
    return (np.cos(ang) * mscale).astype(np.float32), (np.sin(ang) * mscale).astype(np.float32)


def rope_reference(
    x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool
) -> np.ndarray:
    """x [n, heads, head_dim] -> rotated copy."""
    x = x.astype(np.float64).copy()
    half = cos.shape[1]
    c = cos[positions][:, None, :].astype(np.float64)
    s = sin[positions][:, None, :].astype(np.float64)
    if neox:
        a, b = x[..., :half].copy(), x[..., half : 2 * half].copy()
        x[..., :half] = a * c - b * s
        x[..., half : 2 * half] = a * s + b * c
    else:
        a, b = x[..., 0 : 2 * half : 2].copy(), x[..., 1 : 2 * half : 2].copy()
        x[..., 0 : 2 * half : 2] = a * c - b * s
        x[..., 1 : 2 * half : 2] = a * s + b * c
    return x.astype(np.float32)


@njit(cache=True, inline="always")
def _rope_token(x, p, cos, sin, neox):
    heads = x.shape[0]
    half = cos.shape[1]
    for h in range(heads):
        for j in range(half):
            c = cos[p, j]
            s = sin[p, j]
            if neox:
                i0 = j
                i1 = j + half
            else:
                i0 = 2 * j
                i1 = 2 * j + 1
            a = x[h, i0]
            b = x[h, i1]
            x[h, i0] = a * c - b * s
            x[h, i1] = a * s + b * c


@njit(cache=True, parallel=True, nogil=True)
def _rope_inplace(x, positions, cos, sin, neox):
    for t in prange(x.shape[0]):
        _rope_token(x[t], positions[t], cos, sin, neox)


@njit(cache=True, nogil=True)
def _rope_inplace_serial(x, positions, cos, sin, neox):
    for t in range(x.shape[0]):
        _rope_token(x[t], positions[t], cos, sin, neox)


def rope_inplace(
    x: np.ndarray, positions: np.ndarray, cos: np.ndarray, sin: np.ndarray, neox: bool
) -> None:
    """Rotate x [n, heads, head_dim] in place; positions int64 [n]."""
    kernel = _rope_inplace if x.shape[0] > 1 else _rope_inplace_serial
    kernel(x, positions, cos, sin, neox)
