"""Gemma 3n's AltUp streams and Laurel residual, as steps of a layer's program.

AltUp (alternating updates) widens the residual stream to A streams of d_model at the
cost of one: only the active stream goes through attention and the FFN. Each layer

- predicts every stream from all of them: p_i = s_i + sum_j C[i, j] s_j, the
  coefficients C [A, A] a linear map of the router modalities of the active stream,
  tanh(router(RMSNorm(s_active) / d_model));
- runs the active prediction through the block (with Laurel beside attention: x +
  RMSNorm(R(L(x))) of the normed input, averaged in by (h + laurel) / sqrt(2));
- corrects every prediction by what the block did to the active one: c_i = p_i + (1 +
  k_i) (out - p_active), k a linear map of the modalities of the block's output;
- adds the layer's per-layer embedding, gated by the corrected active stream (times
  altup_correct_scale), to every stream but the first.

Before the first layer the scaled embedding is projected to the other streams, each
rescaled to the embedding's root mean square; after the last the other streams are
projected back (rescaled to the first's) and the A streams averaged. This follows
transformers' Gemma3nTextModel and llama.cpp's gemma3n graph. General path only: the
bound decode step does not cover these steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import ModelFormatError
from edgerun.ops import activations, qmatvec
from edgerun.ops.norm import rmsnorm
from edgerun.quant.formats import QuantTensor
from edgerun.quant.reference import dequantize

if TYPE_CHECKING:
    from edgerun.model.weights import WeightStore

# model/layer.py's Layer and Rows (layer.py builds these steps, so it is not imported here)
Layer = Rows = Any

__all__ = [
    "AltUpWeights",
    "LaurelWeights",
    "AltUpExpand",
    "AltUpPredict",
    "LaurelResidual",
    "AltUpCorrect",
    "AltUpMerge",
    "small_matrix",
]

# the smallest mean square a projected stream is rescaled from (transformers' clamp)
_MIN_MEAN_SQUARE = np.float32(1e-5)


def small_matrix(t: QuantTensor, shape: tuple[int, int], source: str) -> np.ndarray:
    """A small matrix (AltUp's router and coefficients) as float32 [rows, cols]."""
    if t.shape != shape:
        raise ModelFormatError(f"{source}: tensor '{t.name}' has shape {t.shape}, expected {shape}")
    return np.ascontiguousarray(dequantize(t.qtype, t.data).reshape(shape), np.float32)


def _mm(rows_decode: bool) -> Callable[[QuantTensor, np.ndarray], np.ndarray]:
    """The projection of a pass's rows: each decode row as a one-token step computes it."""
    return qmatvec.matvec_batch if rows_decode else qmatvec.project


def _rescaled(p: np.ndarray, target: np.ndarray) -> np.ndarray:
    """p [n, d] rescaled to root mean square target [n, 1] per row."""
    ms = np.maximum(np.mean(p * p, axis=-1, keepdims=True), _MIN_MEAN_SQUARE)
    return p * (target / np.sqrt(ms))


def _rms(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.mean(x * x, axis=-1, keepdims=True))


class AltUpWeights:
    """A layer's AltUp parts: the router [A, d] and its norm, the prediction [A*A, A] and
    correction [A, A] coefficient maps (float32), the corrected stream's scale [d]."""

    __slots__ = ("router", "router_norm", "predict", "correct", "correct_scale", "d_model")

    def __init__(self, store: WeightStore, spec: ModelSpec, i: int, source: str) -> None:
        a, d = spec.altup_inputs, spec.d_model

        def matrix(role: str, shape: tuple[int, int]) -> np.ndarray:
            name = spec.layer_tensor(role, i)
            if not store.has(name):
                raise ModelFormatError(f"{source}: tensor '{name}' (layer {i}) is missing")
            return small_matrix(store.matrix(name), shape, source)

        def vector(role: str) -> np.ndarray:
            name = spec.layer_tensor(role, i)
            v = store.vector(name)
            if v.shape != (d,):
                raise ModelFormatError(
                    f"{source}: tensor '{name}' should have {d} values, found {v.size}"
                )
            return v

        self.router = matrix("altup_router", (a, d))
        self.predict = matrix("altup_predict_coef", (a * a, a))
        self.correct = matrix("altup_correct_coef", (a, a))
        self.router_norm = vector("altup_router_norm")
        self.correct_scale = vector("altup_correct_scale")
        self.d_model = d

    def modalities(self, x: np.ndarray, eps: np.float64) -> np.ndarray:
        """tanh(router(RMSNorm(x) / d_model)) [n, A] of rows x [n, d]."""
        r = rmsnorm(x, self.router_norm, eps) * np.float32(1.0 / self.d_model)
        return np.tanh(np.einsum("nd,ad->na", r, self.router))


class LaurelWeights:
    """A layer's Laurel block: x + RMSNorm(R(L(x))), L [rank, d] and R [d, rank]."""

    __slots__ = ("left", "right", "norm")

    def __init__(self, store: WeightStore, spec: ModelSpec, i: int, source: str) -> None:
        names = [spec.layer_tensor(r, i) for r in ("laurel_l", "laurel_r", "laurel_post_norm")]
        for name in names:
            if not store.has(name):
                raise ModelFormatError(f"{source}: tensor '{name}' (layer {i}) is missing")
        self.left, self.right = store.matrix(names[0]), store.matrix(names[1])
        self.norm = store.vector(names[2])
        d, rank = spec.d_model, self.left.shape[0]
        for t, shape in ((self.left, (rank, d)), (self.right, (d, rank))):
            if t.shape != shape:
                raise ModelFormatError(
                    f"{source}: tensor '{t.name}' has shape {t.shape}, expected {shape}"
                )
        if self.norm.shape != (d,):
            raise ModelFormatError(
                f"{source}: tensor '{names[2]}' should have {d} values, found {self.norm.size}"
            )

    def __call__(self, x: np.ndarray, eps: np.float64, decode: bool) -> np.ndarray:
        mm = _mm(decode)
        return x + rmsnorm(mm(self.right, mm(self.left, x)), self.norm, eps)


class AltUpExpand:
    """Before the first layer: rows.streams [A, n, d] from the scaled embedding rows.h,
    the others its projections (altup_proj [(A - 1) * d, d]) rescaled to its RMS."""

    def __init__(self, proj: QuantTensor, n_streams: int, d_model: int, source: str) -> None:
        if proj.shape != ((n_streams - 1) * d_model, d_model):
            raise ModelFormatError(
                f"{source}: tensor '{proj.name}' has shape {proj.shape}, expected "
                f"{((n_streams - 1) * d_model, d_model)} ({n_streams - 1} projections)"
            )
        self.proj, self.n, self.d = proj, n_streams, d_model

    def run(self, rows: Rows) -> None:
        h = rows.h
        n = h.shape[0]
        target = _rms(h)
        p = _mm(rows.decode)(self.proj, h).reshape(n, self.n - 1, self.d)
        streams = np.empty((self.n, n, self.d), np.float32)
        streams[0] = h
        for i in range(1, self.n):
            streams[i] = _rescaled(p[:, i - 1], target)
        rows.streams = streams

    def bindable(self) -> bool:
        return False

    def bind(self, rows: object) -> list:
        raise NotImplementedError("AltUpExpand runs on the general path only")


class AltUpPredict:
    """A layer's start: the streams' predictions (rows.streams), the active one as the
    stream the block updates (rows.h), normed for attention (rows.x), and the Laurel
    residual of that normed input (rows.laurel)."""

    def __init__(self, spec: ModelSpec, layer: Layer, index: int) -> None:
        self.altup, self.laurel = layer.altup, layer.laurel
        self.norm, self.eps = layer.attn_norm, np.float64(spec.norm_eps)
        self.active = spec.altup_active

    def run(self, rows: Rows) -> None:
        s = rows.streams
        m = self.altup.modalities(s[self.active], self.eps)
        n, a = m.shape
        coefs = np.einsum("np,qp->nq", m, self.altup.predict).reshape(n, a, a)
        pred = s + np.einsum("nij,jnd->ind", coefs, s)
        rows.streams = pred.astype(np.float32, copy=False)
        rows.h = rows.streams[self.active].copy()
        rows.x = rmsnorm(rows.h, self.norm, self.eps)
        rows.laurel = self.laurel(rows.x, self.eps, rows.decode)

    def bindable(self) -> bool:
        return False

    def bind(self, rows: object) -> list:
        raise NotImplementedError("AltUpPredict runs on the general path only")


class LaurelResidual:
    """h = (h + post_norm(a) + laurel) / sqrt(2), then x = RMSNorm(h) for the FFN."""

    def __init__(self, post_norm: np.ndarray, norm: np.ndarray, eps: float) -> None:
        self.post_norm, self.norm, self.eps = post_norm, norm, np.float64(eps)
        self.scale = np.float32(1.0 / math.sqrt(2.0))

    def run(self, rows: Rows) -> None:
        a = rmsnorm(rows.a, self.post_norm, self.eps)
        rows.h = (rows.h + a + rows.laurel) * self.scale
        rows.x = rmsnorm(rows.h, self.norm, self.eps)

    def bindable(self) -> bool:
        return False

    def bind(self, rows: object) -> list:
        raise NotImplementedError("LaurelResidual runs on the general path only")


class AltUpCorrect:
    """A layer's end: every stream's prediction corrected by the block's output rows.h,
    then the per-layer embedding (rows.ple), gated by the corrected active stream, added
    to every stream but the first."""

    def __init__(self, spec: ModelSpec, layer: Layer, index: int) -> None:
        self.layer, self.index = layer, index
        self.altup = layer.altup
        self.eps = np.float64(spec.norm_eps)
        self.active = spec.altup_active

    def run(self, rows: Rows) -> None:
        pred, out, w = rows.streams, rows.h, self.altup
        m = w.modalities(out, self.eps)
        k = np.einsum("np,qp->nq", m, w.correct) + np.float32(1.0)  # [n, A]
        innovation = out - pred[self.active]
        streams = pred + k.T[:, :, None] * innovation[None]
        layer = self.layer
        if layer.ple_gate is not None:
            if rows.ple is None:  # a pass that skipped them would compute another model
                raise RuntimeError("AltUpCorrect: the rows carry no per-layer embeddings")
            mm = _mm(rows.decode)
            first = np.ascontiguousarray(streams[self.active] * w.correct_scale, np.float32)
            e = np.ascontiguousarray(rows.ple[:, self.index])
            g = activations.glu(mm(layer.ple_gate, first), e, "gelu_tanh")
            streams[1:] += rmsnorm(mm(layer.ple_proj, g), layer.ple_post_norm, self.eps)
        rows.streams = streams.astype(np.float32, copy=False)

    def bindable(self) -> bool:
        return False

    def bind(self, rows: object) -> list:
        raise NotImplementedError("AltUpCorrect runs on the general path only")


class AltUpMerge:
    """After the last layer: the streams back to one, the first plus the others projected
    back (altup_unembd_proj, each rescaled to the first's RMS), averaged; rows.h, and
    rows.x = RMSNorm(h) with the output norm for the head."""

    def __init__(
        self, proj: QuantTensor, n_streams: int, d_model: int, norm: np.ndarray, eps: float,
        source: str,
    ) -> None:  # fmt: skip
        if proj.shape != ((n_streams - 1) * d_model, d_model):
            raise ModelFormatError(
                f"{source}: tensor '{proj.name}' has shape {proj.shape}, expected "
                f"{((n_streams - 1) * d_model, d_model)} ({n_streams - 1} projections)"
            )
        self.projs = proj.stacked(n_streams - 1)
        self.n, self.norm, self.eps = n_streams, norm, np.float64(eps)

    def run(self, rows: Rows) -> None:
        s = rows.streams
        target = _rms(s[0])
        mm = _mm(rows.decode)
        h = s[0].copy()
        for i in range(1, self.n):
            h += _rescaled(mm(self.projs[i - 1], np.ascontiguousarray(s[i])), target)
        rows.h = h * np.float32(1.0 / self.n)
        rows.x = rmsnorm(rows.h, self.norm, self.eps)

    def bindable(self) -> bool:
        return False

    def bind(self, rows: object) -> list:
        raise NotImplementedError("AltUpMerge runs on the general path only")
