"""Mamba-2's mixer core over one sequence's rows, with its state: the causal depthwise conv
over the x, B, C channels, the selective scan, the D skip and the grouped gated RMSNorm.

Per token, from its in_proj row [z (d_inner) | x B C (conv channels) | dt (heads)]:
    xBC = SiLU(bias + sum_j w[:, j] * window[j])   window: the last L - 1 inputs, then this
    x [heads, P], B, C [groups, N] = split(xBC)
    per head h (group g = h // (heads / groups)):
        dt = softplus(dt[h] + dt_bias[h]);  dA = exp(dt * A[h])   (A = -exp(A_log) <= 0)
        S[h] = dA * S[h] + outer(x[h] * dt, B[g])                  (S [P, N])
        y[h] = S[h] . C[g] + D[h] * x[h]
    y = RMSNorm(y * SiLU(z)) per group of d_inner / groups channels, times the gain
(llama.cpp's ggml_ssm_conv / ggml_ssm_scan and build_mamba2_layer; transformers'
GraniteMoeHybridMambaLayer computes the same scan in chunks of mamba_chunk_size, which
equals it up to rounding.)

The state per sequence: "conv" [L - 1, conv channels] (the last inputs, oldest first) and
"ssm" [heads, P, N]. The scan runs the tokens in turn (no chunked form: one token's scan is
heads x P x N multiply-adds, and a prompt costs its tokens' worth). One token takes a
serial kernel and a prompt its twin with the heads on the threads; both run the same
per-(token, head) code, so a token's bits do not depend on how its rows were split into
calls, whether it ran alone or batched, or was replayed after a rollback.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from edgerun.ops._simd import stack16

# --------------------------------------------------------------------------------------------
# reference (float64 numpy, token by token as llama.cpp computes it)


def mamba2_reference(
    proj: np.ndarray,
    conv_w: np.ndarray,
    conv_b: np.ndarray,
    dt_bias: np.ndarray,
    a: np.ndarray,
    d: np.ndarray,
    norm_w: np.ndarray,
    groups: int,
    eps: float,
    conv_state: np.ndarray,
    ssm_state: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """proj [n, 2 d_inner + 2 groups N + heads] (in_proj's rows), conv_w [C, L], conv_b [C],
    dt_bias, a (-exp(A_log)), d [heads], norm_w [d_inner], conv_state [L - 1, C],
    ssm_state [heads, P, N] -> (y [n, d_inner] before out_proj, conv state, ssm state)."""
    heads, p_dim, n_state = ssm_state.shape
    d_inner = heads * p_dim
    c_all = conv_w.shape[0]
    n = proj.shape[0]
    z = proj[:, :d_inner].astype(np.float64)
    xbc = proj[:, d_inner : d_inner + c_all].astype(np.float64)
    dt = proj[:, d_inner + c_all :].astype(np.float64)
    window = np.concatenate([conv_state.astype(np.float64), xbc])
    taps = conv_w.shape[1]
    conv = np.stack(
        [(window[t : t + taps] * conv_w.T.astype(np.float64)).sum(0) for t in range(n)]
    ) + conv_b.astype(np.float64)
    conv = conv / (1.0 + np.exp(-conv))
    x = conv[:, :d_inner].reshape(n, heads, p_dim)
    b = conv[:, d_inner : d_inner + groups * n_state].reshape(n, groups, n_state)
    c = conv[:, d_inner + groups * n_state :].reshape(n, groups, n_state)
    per = heads // groups
    g_of = np.arange(heads) // per
    s = ssm_state.astype(np.float64).copy()
    y = np.zeros((n, heads, p_dim))
    for t in range(n):
        v = dt[t] + dt_bias
        dts = np.where(v > 20.0, v, np.log1p(np.exp(np.minimum(v, 20.0))))
        da = np.exp(dts * a)
        bt, ct = b[t, g_of], c[t, g_of]  # [heads, N]
        s = s * da[:, None, None] + (x[t] * dts[:, None])[:, :, None] * bt[:, None, :]
        y[t] = np.einsum("hpn,hn->hp", s, ct) + d[:, None] * x[t]
    y = y.reshape(n, d_inner) * (z / (1.0 + np.exp(-z)))
    yg = y.reshape(n, groups, d_inner // groups)
    yg = yg / np.sqrt((yg * yg).mean(-1, keepdims=True) + eps)
    out = yg.reshape(n, d_inner) * norm_w
    k = taps - 1
    return (
        out.astype(np.float32),
        window[window.shape[0] - k :].astype(np.float32),
        s.astype(np.float32),
    )


# --------------------------------------------------------------------------------------------
# kernels


@njit(cache=True, fastmath=True, nogil=True)
def _conv_silu(proj, d_inner, conv_t, conv_b, conv_state, xbc):
    """xbc[t] = SiLU(bias + the conv over [state rows, rows' x B C]) for the n rows (their
    x B C after z, d_inner wide); the state becomes the last L - 1 inputs."""
    n = proj.shape[0]
    taps, c_all = conv_t.shape
    k = taps - 1
    for t in range(n):
        row = proj[t]
        out = xbc[t]
        for ch in range(c_all):
            acc = conv_b[ch]
            for j in range(k):
                tt = t - k + j  # an earlier row of this call, else the state
                v = proj[tt, d_inner + ch] if tt >= 0 else conv_state[k + tt, ch]
                acc += conv_t[j, ch] * v
            acc += conv_t[k, ch] * row[d_inner + ch]
            out[ch] = acc / (np.float32(1.0) + np.exp(-acc))
    if n >= k:
        conv_state[:] = proj[n - k :, d_inner : d_inner + c_all]
    else:
        conv_state[: k - n] = conv_state[n:].copy()
        conv_state[k - n :] = proj[:, d_inner : d_inner + c_all]


@njit(cache=True, fastmath=True, inline="always")
def _scan_head(xbc, dt, dt_bias, a, d, groups, t, h, ssm, y, bb, cc):
    """Token t's scan step on head h's state ssm[h] [P, N] and its outputs y[t, h's P];
    bb, cc: [N] buffers for the group's B and C (copies the state's stores cannot alias,
    so the SLP vectorizer packs the lanes)."""
    heads, p_dim, n_state = ssm.shape
    d_inner = heads * p_dim
    g = h // (heads // groups)
    b0 = d_inner + g * n_state
    c0 = d_inner + groups * n_state + g * n_state
    xt = xbc[t]
    for i in range(n_state):
        bb[i] = xt[b0 + i]
        cc[i] = xt[c0 + i]
    v = dt[t, h] + dt_bias[h]
    dts = v if v > np.float32(20.0) else np.log1p(np.exp(v))
    da = np.exp(dts * a[h])
    whole = n_state - n_state % 16
    acc = numba.carray(stack16(), 16)
    for p in range(p_dim):
        xv = xt[h * p_dim + p]
        xdt = xv * dts
        s = ssm[h, p]
        for lane in range(16):
            acc[lane] = np.float32(0.0)
        for i0 in range(0, whole, 16):  # 16 lanes of the state row (the SLP vectorizer's)
            for lane in range(16):
                si = s[i0 + lane] * da + bb[i0 + lane] * xdt
                s[i0 + lane] = si
                acc[lane] += si * cc[i0 + lane]
        total = np.float32(0.0)
        for lane in range(16):
            total += acc[lane]
        for i in range(whole, n_state):
            si = s[i] * da + bb[i] * xdt
            s[i] = si
            total += si * cc[i]
        y[t, h * p_dim + p] = total + d[h] * xv


@njit(cache=True, fastmath=True, nogil=True)
def _scan_serial(xbc, dt, dt_bias, a, d, groups, ssm, y):
    bb, cc = np.empty(ssm.shape[2], np.float32), np.empty(ssm.shape[2], np.float32)
    for h in range(ssm.shape[0]):
        for t in range(xbc.shape[0]):
            _scan_head(xbc, dt, dt_bias, a, d, groups, t, h, ssm, y, bb, cc)


@njit(cache=True, fastmath=True, nogil=True, parallel=True)
def _scan_parallel(xbc, dt, dt_bias, a, d, groups, ssm, y):
    for h in prange(ssm.shape[0]):
        bb, cc = np.empty(ssm.shape[2], np.float32), np.empty(ssm.shape[2], np.float32)
        for t in range(xbc.shape[0]):
            _scan_head(xbc, dt, dt_bias, a, d, groups, t, h, ssm, y, bb, cc)


@njit(cache=True, fastmath=True, nogil=True)
def _gate_norm(z, norm_w, groups, eps, y):
    """y = RMSNorm(y * SiLU(z)) over each group of channels, times the gain, per row."""
    n, d_inner = y.shape
    gsize = d_inner // groups
    for t in range(n):
        yt = y[t]
        for ch in range(d_inner):
            zc = z[t, ch]
            yt[ch] = yt[ch] * (zc / (np.float32(1.0) + np.exp(-zc)))
        for g in range(groups):
            ss = np.float32(0.0)
            for ch in range(g * gsize, (g + 1) * gsize):
                ss += yt[ch] * yt[ch]
            inv = np.float32(1.0) / np.sqrt(ss / np.float32(gsize) + eps)
            for ch in range(g * gsize, (g + 1) * gsize):
                yt[ch] = yt[ch] * inv * norm_w[ch]


def mamba2_rows(
    proj: np.ndarray,
    conv_t: np.ndarray,
    conv_b: np.ndarray,
    dt_bias: np.ndarray,
    a: np.ndarray,
    d: np.ndarray,
    norm_w: np.ndarray,
    groups: int,
    eps: float,
    conv_state: np.ndarray,
    ssm: np.ndarray,
    y: np.ndarray,
) -> None:
    """The mixer core over one sequence's n rows (the reference's arithmetic in float32):
    proj [n, 2 d_inner + 2 groups N + heads] float32, conv_t [L, C] (taps, tap L - 1 on the
    newest input), conv_b [C], dt_bias, a, d [heads], norm_w [d_inner]; conv_state
    [L - 1, C] and ssm [heads, P, N] are updated in place to the states after the rows;
    y [n, d_inner] receives the gated, normed outputs (before out_proj).

    One token takes the serial scan (a parallel region costs more than one token's
    heads), a prompt spreads the heads over the threads: the same per-(token, head) code."""
    n = proj.shape[0]
    heads, p_dim = ssm.shape[0], ssm.shape[1]
    d_inner, c_all = heads * p_dim, conv_t.shape[1]
    if proj.shape[1] != d_inner + c_all + heads or y.shape != (n, d_inner):
        raise ValueError(f"mamba2_rows: rows of {proj.shape[1]} for state {ssm.shape}")
    xbc = np.empty((n, c_all), np.float32)
    _conv_silu(proj, d_inner, conv_t, conv_b, conv_state, xbc)
    dt = proj[:, d_inner + c_all :]
    scan = _scan_serial if n == 1 else _scan_parallel
    scan(xbc, dt, dt_bias, a, d, groups, ssm, y)
    _gate_norm(proj[:, :d_inner], norm_w, groups, np.float32(eps), y)
