"""Gated DeltaNet (Qwen3.5's linear attention): the causal depthwise conv1d over the
projected q, k, v channels, the gated delta rule over each value head's recurrent state,
and the gated RMSNorm of its output.

Per value head h and token t (q, k L2-normed, q times 1/sqrt(dk)):
    S = exp(g) * S                      (g = -exp(A_log) * softplus(a + dt_bias) <= 0)
    delta = (v - k.S) * beta            (beta = sigmoid(b))
    S += outer(k, delta)
    o = q.S
with S [dk, dv]. Value head h reads key head h % n_k_heads: llama.cpp's converter
reorders the value heads so that the key heads tile them (its _reorder_v_heads), and the
GGUF holds them in that order.

The delta rule runs the tokens in turn. Every one-token call takes one serial kernel, so
a decode token gives the same bits alone, batched with other sequences, in a
verification pass or replayed after a rollback; a prompt takes its parallel twin (the
heads on the threads), which Numba vectorizes apart: equal to the steps within float32
rounding, not bit for bit. The chunked (matmul) form of the rule is not here: on 2 cores
the sequential prompt costs about what the steps do per token (benchmarks/deltanet.py).
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit, prange

from edgerun.ops._simd import glu16, stack16

# --------------------------------------------------------------------------------------------
# references (float64 numpy, as transformers computes them)


def conv1d_silu_reference(
    x: np.ndarray, weight: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """SiLU(causal depthwise conv1d) of x [n, C] after the state's K = L - 1 earlier
    inputs [K, C], with weight [C, L] (tap L - 1 on the newest input). Returns the output
    [n, C] and the new state (the last K inputs)."""
    k = weight.shape[1] - 1
    full = np.concatenate([state, x]).astype(np.float64)
    w = weight.astype(np.float64)
    n = x.shape[0]
    out = np.zeros((n, x.shape[1]))
    for j in range(k + 1):
        out += full[j : j + n] * w[:, j]
    out = out / (1.0 + np.exp(-out))
    return out.astype(np.float32), full[full.shape[0] - k :].astype(np.float32)


def gated_delta_reference(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    eps: float,
) -> tuple[np.ndarray, np.ndarray]:
    """The gated delta rule token by token (transformers' torch_recurrent_gated_delta_rule):
    q, k [n, Hk, dk] as the conv gives them, v [n, Hv, dv], g and beta [n, Hv], state
    [Hv, dk, dv]. Returns the output [n, Hv, dv] and the new state."""
    n, hk, dk = q.shape
    hv = v.shape[1]
    s = state.astype(np.float64).copy()
    qn = q / np.sqrt((q.astype(np.float64) ** 2).sum(-1, keepdims=True) + eps) / np.sqrt(dk)
    kn = k / np.sqrt((k.astype(np.float64) ** 2).sum(-1, keepdims=True) + eps)
    heads = np.arange(hv) % hk
    out = np.zeros(v.shape)
    for t in range(n):
        s *= np.exp(g[t].astype(np.float64))[:, None, None]
        kt, qt = kn[t, heads], qn[t, heads]  # [Hv, dk]
        mem = np.einsum("hi,hij->hj", kt, s)
        delta = (v[t] - mem) * beta[t][:, None]
        s += kt[:, :, None] * delta[:, None, :]
        out[t] = np.einsum("hi,hij->hj", qt, s)
    return out.astype(np.float32), s.astype(np.float32)


def gated_rmsnorm_reference(o: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each head's output o [..., dv] with gain w [dv], times SiLU(z)."""
    o64, z64 = o.astype(np.float64), z.astype(np.float64)
    normed = o64 / np.sqrt((o64 * o64).mean(-1, keepdims=True) + eps) * w
    return (normed * z64 / (1.0 + np.exp(-z64))).astype(np.float32)


def decay_beta_reference(
    a: np.ndarray, b: np.ndarray, a_neg: np.ndarray, dt_bias: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The log decay g = a_neg * softplus(a + dt_bias) (a_neg = -exp(A_log), as GGUF
    stores ssm_a) and beta = sigmoid(b), from the projections a, b [n, Hv]."""
    x = a.astype(np.float64) + dt_bias
    softplus = np.where(x > 20.0, x, np.log1p(np.exp(np.minimum(x, 20.0))))
    return (a_neg * softplus).astype(np.float32), (1.0 / (1.0 + np.exp(-b))).astype(np.float32)


# --------------------------------------------------------------------------------------------
# kernels


@njit(cache=True, fastmath=True, nogil=True)
def _conv1d_silu(x, wt, state, ones, out):
    n, c_all = x.shape
    taps = wt.shape[0]
    k = taps - 1
    acc = numba.carray(stack16(), 16)
    for t in range(n):
        o = out[t]
        for c in range(0, c_all, 16):
            for lane in range(16):
                acc[lane] = np.float32(0.0)
            for j in range(taps):
                tt = t - k + j
                rc = x[tt, c : c + 16] if tt >= 0 else state[k + tt, c : c + 16]
                wc = wt[j, c : c + 16]
                for lane in range(16):
                    acc[lane] += wc[lane] * rc[lane]
            for lane in range(16):
                o[c + lane] = acc[lane]
            glu16(False, o, ones, o, c)  # SiLU in place
    # the state keeps the last k inputs of state ++ x
    if n >= k:
        state[:] = x[n - k :]
    else:
        state[: k - n] = state[n:].copy()
        state[k - n :] = x


def conv1d_silu(x: np.ndarray, weight_t: np.ndarray, state: np.ndarray) -> np.ndarray:
    """SiLU(causal depthwise conv1d) of x [n, C] float32 after the K = L - 1 inputs that
    state [K, C] holds, with the taps weight_t [L, C] (the GGUF's ssm_conv1d [C, L]
    transposed; tap L - 1 on the newest input); updates state to the last K inputs.
    Returns [n, C]. C is a multiple of 16 (the kernels' lane groups; arch/qwen35 checks
    the file's sizes)."""
    if x.shape[1] % 16 or weight_t.shape[1] != x.shape[1] or state.shape[1] != x.shape[1]:
        raise ValueError(f"conv1d_silu: {x.shape[1]} channels (a multiple of 16 expected)")
    out = np.empty_like(x)
    _conv1d_silu(x, weight_t, state, np.ones(x.shape[1], np.float32), out)
    return out


@njit(cache=True, fastmath=True, inline="always")
def _decay_read(s, c, decay, kt, mem):
    """Columns c..c+15 of the state s [dk, dv]: s *= decay, mem = kt.s. The 16 lanes sit
    in a stack accumulator, so the SLP vectorizer packs them (Numba's loop vectorizer
    stays off: runtime/numba_env)."""
    acc = numba.carray(stack16(), 16)
    for lane in range(16):
        acc[lane] = np.float32(0.0)
    for i in range(s.shape[0]):
        sc = s[i, c : c + 16]
        ki = kt[i]
        for lane in range(16):
            x = sc[lane] * decay
            sc[lane] = x
            acc[lane] += ki * x
    for lane in range(16):
        mem[c + lane] = acc[lane]


@njit(cache=True, fastmath=True, inline="always")
def _write_read(s, c, kt, delta, qt, o):
    """Columns c..c+15 of the state s [dk, dv]: s += outer(kt, delta), o = qt.s."""
    acc = numba.carray(stack16(), 16)
    dc = numba.carray(stack16(), 16)
    for lane in range(16):
        acc[lane] = np.float32(0.0)
        dc[lane] = delta[c + lane]
    for i in range(s.shape[0]):
        sc = s[i, c : c + 16]
        ki, qi = kt[i], qt[i]
        for lane in range(16):
            x = sc[lane] + ki * dc[lane]
            sc[lane] = x
            acc[lane] += qi * x
    for lane in range(16):
        o[c + lane] = acc[lane]


@njit(cache=True, fastmath=True, inline="always")
def _delta_head(q, k, v, g, beta, s, eps, t, h, kh, kt, qt, mem, o, out):
    """Token t of value head h (key head kh) on its state s [dk, dv]."""
    dk, dv = s.shape
    sq = np.float32(0.0)
    sk = np.float32(0.0)
    for i in range(dk):
        sq += q[t, kh, i] * q[t, kh, i]
        sk += k[t, kh, i] * k[t, kh, i]
    qi = np.float32(1.0 / np.sqrt(dk)) / np.sqrt(sq + eps)
    ki = np.float32(1.0) / np.sqrt(sk + eps)
    for i in range(dk):
        qt[i] = q[t, kh, i] * qi
        kt[i] = k[t, kh, i] * ki
    decay = np.exp(g[t, h])
    for c in range(0, dv, 16):  # decay the state and read what it holds for k
        _decay_read(s, c, decay, kt, mem)
    b = beta[t, h]
    for j in range(dv):
        mem[j] = (v[t, h, j] - mem[j]) * b  # now delta
    for c in range(0, dv, 16):  # write delta along k, read the new state for q
        _write_read(s, c, kt, mem, qt, o)
    out[t, h, :] = o


@njit(cache=True, fastmath=True, nogil=True, parallel=True)
def _gated_delta(q, k, v, g, beta, state, eps, out):
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    for h in prange(hv):
        kt, qt = np.empty(dk, np.float32), np.empty(dk, np.float32)
        mem, o = np.empty(dv, np.float32), np.empty(dv, np.float32)
        for t in range(n):
            _delta_head(q, k, v, g, beta, state[h], eps, t, h, h % hk, kt, qt, mem, o, out)


@njit(cache=True, fastmath=True, nogil=True)
def _gated_delta_serial(q, k, v, g, beta, state, eps, out):
    n, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    kt, qt = np.empty(dk, np.float32), np.empty(dk, np.float32)
    mem, o = np.empty(dv, np.float32), np.empty(dv, np.float32)
    for h in range(hv):
        for t in range(n):
            _delta_head(q, k, v, g, beta, state[h], eps, t, h, h % hk, kt, qt, mem, o, out)


def gated_delta(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    g: np.ndarray,
    beta: np.ndarray,
    state: np.ndarray,
    eps: float,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """The gated delta rule over n tokens of one sequence: q, k [n, Hk, dk], v [n, Hv, dv],
    g, beta [n, Hv] float32 (decay_beta's); state [Hv, dk, dv] float32, updated in place.
    Returns the output [n, Hv, dv].

    One token takes the serial kernel (a parallel region costs more than one token's
    heads on a busy machine: ~110 us vs 180-840 us at 16 heads of 128 x 128), and every
    one-token call takes that same kernel, so a decode token's bits do not depend on
    whether it runs alone, batched or in a verification pass; a prompt spreads the heads
    over the threads."""
    if v.shape[2] % 16 or state.shape != (v.shape[1], q.shape[2], v.shape[2]):
        raise ValueError(f"gated_delta: state {state.shape} for values {v.shape}")
    if out is None:
        out = np.empty_like(v)
    kernel = _gated_delta_serial if q.shape[0] == 1 else _gated_delta
    kernel(q, k, v, g, beta, state, np.float32(eps), out)
    return out


@njit(cache=True, fastmath=True, nogil=True)
def _decay_beta(a, b, a_neg, dt_bias, g, beta):
    n, hv = a.shape
    for t in range(n):
        for h in range(hv):
            x = a[t, h] + dt_bias[h]
            sp = x if x > np.float32(20.0) else np.log1p(np.exp(x))
            g[t, h] = a_neg[h] * sp
            beta[t, h] = np.float32(1.0) / (np.float32(1.0) + np.exp(-b[t, h]))


def decay_beta(
    a: np.ndarray, b: np.ndarray, a_neg: np.ndarray, dt_bias: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """g = a_neg * softplus(a + dt_bias) and beta = sigmoid(b) of a, b [n, Hv] float32
    (softplus as torch's, linear past 20)."""
    g, beta = np.empty_like(a), np.empty_like(b)
    _decay_beta(a, b, a_neg, dt_bias, g, beta)
    return g, beta


@njit(cache=True, fastmath=True, nogil=True)
def _gated_rmsnorm(o, z, w, eps, out):
    rows, d = o.shape
    for r in range(rows):
        s = np.float32(0.0)
        for j in range(d):
            s += o[r, j] * o[r, j]
        inv = np.float32(1.0) / np.sqrt(s / np.float32(d) + eps)
        for j in range(d):
            out[r, j] = o[r, j] * inv * w[j]
        for c in range(0, d, 16):
            glu16(False, z[r], out[r], out[r], c)  # times SiLU(z)


def gated_rmsnorm(o: np.ndarray, z: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """RMSNorm of each head's row of o [..., dv] with gain w [dv], times SiLU(z) (z as o)."""
    if w.shape[0] % 16:
        raise ValueError(f"gated_rmsnorm: rows of {w.shape[0]} (a multiple of 16 expected)")
    o2 = o.reshape(-1, w.shape[0])
    out = np.empty_like(o2)
    _gated_rmsnorm(o2, z.reshape(o2.shape), w, np.float32(eps), out)
    return out.reshape(o.shape)
