"""LFM2's double-gated short convolution over a sequence's rows, with its state.

in_proj gives per token B, C, x (d_model each); B * x runs through a depthwise causal
convolution of width L whose window starts with the last L - 1 gated inputs of earlier
tokens (the state, [L - 1, d_model], oldest first); y = C * conv. The kernel takes one
sequence's rows (a prompt, or one decode token) and leaves the state after them.
"""

from __future__ import annotations

import numpy as np
from numba import njit


def shortconv_reference(
    bcx: np.ndarray, w: np.ndarray, state: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """numpy reference: bcx [n, 3 d] (B, C, x), w [d, L], state [L - 1, d] ->
    (y [n, d], the state after the n rows), in float64."""
    d = w.shape[0]
    m = w.shape[1] - 1
    b, c, x = (bcx[:, k * d : (k + 1) * d].astype(np.float64) for k in range(3))
    window = np.concatenate([state.astype(np.float64), b * x])
    n = bcx.shape[0]
    conv = np.stack([(window[t : t + m + 1] * w.T).sum(axis=0) for t in range(n)])
    return c * conv, window[n:]


@njit(cache=True, nogil=True)
def shortconv_rows(bcx, w, state_in, state_out, y):
    """y[t] = C[t] * sum_j w[:, j] * window[t + j] for one sequence's n rows, window =
    state_in then B * x of the rows; state_out <- the window's last L - 1 rows (state_in
    and state_out may be the same array). Float32, summed in j order."""
    n = bcx.shape[0]
    d, width = w.shape
    m = width - 1
    window = np.empty((m + n, d), np.float32)
    window[:m] = state_in
    for t in range(n):
        for ch in range(d):
            window[m + t, ch] = bcx[t, ch] * bcx[t, 2 * d + ch]
    for t in range(n):
        for ch in range(d):
            acc = np.float32(0.0)
            for j in range(width):
                acc += w[ch, j] * window[t + j, ch]
            y[t, ch] = bcx[t, d + ch] * acc
    state_out[:] = window[n:]
