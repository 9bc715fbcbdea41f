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
"ssm" [heads, P, N]. The kernel runs the tokens in turn (no chunked form: one token's scan
is heads x P x N multiply-adds, and a prompt costs its tokens' worth), so every token
takes the same arithmetic alone, batched, or replayed after a rollback.
"""

from __future__ import annotations

import numpy as np
from numba import njit

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
# kernel


@njit(cache=True, fastmath=True, nogil=True)
def mamba2_rows(proj, conv_t, conv_b, dt_bias, a, d, norm_w, groups, eps, conv_state, ssm, y):
    """The mixer core over one sequence's n rows (the reference's arithmetic in float32):
    proj [n, 2 d_inner + 2 groups N + heads], conv_t [L, C] (taps, tap L - 1 on the newest
    input), conv_b [C], dt_bias, a, d [heads], norm_w [d_inner]; conv_state [L - 1, C] and
    ssm [heads, P, N] are updated in place to the states after the rows; y [n, d_inner]
    receives the gated, normed outputs (before out_proj)."""
    n = proj.shape[0]
    heads, p_dim, n_state = ssm.shape
    d_inner = heads * p_dim
    taps, c_all = conv_t.shape
    k = taps - 1
    per = heads // groups
    gsize = d_inner // groups
    xbc = np.empty(c_all, np.float32)
    for t in range(n):
        row = proj[t]
        # the conv over the window [state rows, this row], SiLU; then the state shifts
        for ch in range(c_all):
            acc = conv_b[ch]
            for j in range(k):
                acc += conv_t[j, ch] * conv_state[j, ch]
            acc += conv_t[k, ch] * row[d_inner + ch]
            xbc[ch] = acc / (np.float32(1.0) + np.exp(-acc))
        for j in range(k - 1):
            conv_state[j, :] = conv_state[j + 1, :]
        if k > 0:
            conv_state[k - 1, :] = row[d_inner : d_inner + c_all]
        yt = y[t]
        for h in range(heads):
            g = h // per
            b0 = d_inner + g * n_state
            c0 = d_inner + groups * n_state + g * n_state
            v = row[d_inner + c_all + h] + dt_bias[h]
            dts = v if v > np.float32(20.0) else np.log1p(np.exp(v))
            da = np.exp(dts * a[h])
            for p in range(p_dim):
                xv = xbc[h * p_dim + p]
                xdt = xv * dts
                s = ssm[h, p]
                acc = np.float32(0.0)
                for i in range(n_state):
                    si = s[i] * da + xbc[b0 + i] * xdt
                    s[i] = si
                    acc += si * xbc[c0 + i]
                yt[h * p_dim + p] = acc + d[h] * xv
        # gate by SiLU(z), then RMSNorm each group of channels
        for ch in range(d_inner):
            zc = row[ch]
            yt[ch] = yt[ch] * (zc / (np.float32(1.0) + np.exp(-zc)))
        for g in range(groups):
            ss = np.float32(0.0)
            for ch in range(g * gsize, (g + 1) * gsize):
                ss += yt[ch] * yt[ch]
            inv = np.float32(1.0) / np.sqrt(ss / np.float32(gsize) + eps)
            for ch in range(g * gsize, (g + 1) * gsize):
                yt[ch] = yt[ch] * inv * norm_w[ch]
