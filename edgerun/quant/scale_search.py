"""Scale searches shared by the block quantizers (ggml-quants.c's, vectorized in numpy).

- make_qkx2_quants: asymmetric (scale, min) per group (Q4_K's sub-blocks, the G64 formats)
- make_qx_quants: symmetric scale per group (Q6_K's sub-blocks)
- importance: llama.cpp's imatrix weights, qw * sqrt(sigma2 + x^2)
- roundf: round half away from zero, as gguf-py / ggml-quants.c
"""

from __future__ import annotations

import numpy as np

__all__ = ["GROUP_MAX_EPS", "importance", "make_qkx2_quants", "make_qx_quants", "roundf"]

GROUP_MAX_EPS = np.float32(1e-15)


def roundf(n: np.ndarray) -> np.ndarray:
    """Round half away from zero (gguf-py / ggml-quants.c roundf)."""
    a = abs(n)
    floored = np.floor(a)
    b = floored + np.floor(2 * (a - floored))
    return np.sign(n) * b


def make_qkx2_quants(
    x: np.ndarray,
    w: np.ndarray,
    nmax: int,
    rmin: float = -1.0,
    rdelta: float = 0.1,
    nstep: int = 20,
    clamp_min: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric (scale, min) per group, ggml-quants.c's make_qkx2_quants vectorized.

    x, w: float32 [..., n] (groups along the last axis). Minimizes sum w * (s*L + m - x)^2
    over candidate scales; L in [0, nmax]. Returns (scale, min) float32 [...]: x ~ s*L + min.
    clamp_min keeps min <= 0 (the K-quants store -min as an unsigned 6-bit value).
    """
    x = x.astype(np.float32, copy=False)
    w = w.astype(np.float32, copy=False)
    mn = x.min(axis=-1)
    if clamp_min:
        mn = np.minimum(mn, np.float32(0))
    mx = x.max(axis=-1)
    rng = mx - mn
    flat = rng <= 0
    rng = np.where(flat, np.float32(1), rng).astype(np.float32)
    sum_w = w.sum(axis=-1)
    sum_x = (w * x).sum(axis=-1)
    xm = x - mn[..., None]
    iscale = np.float32(nmax) / rng
    scale = (np.float32(1) / iscale).astype(np.float32)
    L = np.clip(np.rint(iscale[..., None] * xm), 0, nmax)
    diff = scale[..., None] * L + mn[..., None] - x
    best_err = (w * diff * diff).sum(axis=-1)
    best_scale, best_min = scale, mn
    for step in range(nstep + 1):
        iscale = (np.float32(rmin + rdelta * step + nmax) / rng).astype(np.float32)
        La = np.clip(np.rint(iscale[..., None] * xm), 0, nmax).astype(np.float32)
        wl = w * La
        sum_l = wl.sum(axis=-1)
        sum_l2 = (wl * La).sum(axis=-1)
        sum_xl = (wl * x).sum(axis=-1)
        D = sum_w * sum_l2 - sum_l * sum_l
        ok = D > 0
        Ds = np.where(ok, D, np.float32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / Ds
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / Ds
        if clamp_min:
            pos = this_min > 0
            this_scale = np.where(
                pos, sum_xl / np.where(sum_l2 > 0, sum_l2, np.float32(1)), this_scale
            )
            this_min = np.where(pos, np.float32(0), this_min)
        diff = this_scale[..., None] * La + this_min[..., None] - x
        err = (w * diff * diff).sum(axis=-1)
        better = ok & (err < best_err)
        best_err = np.where(better, err, best_err)
        best_scale = np.where(better, this_scale, best_scale)
        best_min = np.where(better, this_min, best_min)
    best_scale = np.where(flat, np.float32(0), best_scale).astype(np.float32)
    return best_scale, best_min.astype(np.float32)


def make_qx_quants(x: np.ndarray, nmax: int, w: np.ndarray | None = None) -> np.ndarray:
    """Symmetric scale per group (ggml-quants.c make_qx_quants, rmse_type 1), vectorized.

    x: float32 [..., n]; L in [-nmax, nmax-1]; w defaults to x^2. Returns scale [...]
    (x ~ scale * L); 0 for all-zero groups.
    """
    x = x.astype(np.float32, copy=False)
    if w is None:
        w = x * x
    ax = np.abs(x)
    imax = ax.argmax(axis=-1)[..., None]
    amax = np.take_along_axis(ax, imax, axis=-1)[..., 0]
    max_ = np.take_along_axis(x, imax, axis=-1)[..., 0]
    small = amax < GROUP_MAX_EPS
    max_ = np.where(small, np.float32(1), max_).astype(np.float32)

    def sums(iscale):
        L = np.clip(np.rint(iscale[..., None] * x), -nmax, nmax - 1).astype(np.float32)
        wl = w * L
        return (wl * x).sum(axis=-1), (wl * L).sum(axis=-1)

    sumlx, suml2 = sums((np.float32(-nmax) / max_).astype(np.float32))
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, 1), np.float32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = (np.float32(-(nmax + 0.1 * step)) / max_).astype(np.float32)
        slx, sl2 = sums(iscale)
        better = (sl2 > 0) & (slx * slx > best * sl2)
        new_scale = slx / np.where(sl2 > 0, sl2, 1)
        scale = np.where(better, new_scale, scale)
        best = np.where(better, new_scale * slx, best)
    return np.where(small, np.float32(0), scale).astype(np.float32)


def importance(xs: np.ndarray, qw: np.ndarray | None, sigma2: np.ndarray) -> np.ndarray | None:
    """llama.cpp's imatrix weights: qw * sqrt(sigma2 + x^2); None without an imatrix."""
    if qw is None:
        return None
    return (qw * np.sqrt(sigma2 + xs * xs)).astype(np.float32)
