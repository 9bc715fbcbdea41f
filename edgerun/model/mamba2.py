"""Mamba-2's mixer (Granite 4.0 H; state_cache.py's protocol): in_proj of x to z, the conv
channels (x, B, C) and dt per head; the conv, selective scan, D skip and grouped gated
RMSNorm of ops/mamba2.py; out_proj.

Its per-sequence state: "conv", the last L - 1 inputs of the conv [L - 1, d_inner + 2
groups N], and "ssm", each head's [P, N] matrix.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import ModelFormatError
from edgerun.model.state_cache import STATE_SHAPES, LayerState
from edgerun.model.weights import WeightStore
from edgerun.ops import qmatvec
from edgerun.ops.mamba2 import mamba2_rows
from edgerun.quant.formats import QuantTensor
from edgerun.quant.reference import dequantize


class Mamba2:
    """One layer's Mamba-2 mixer (states "conv" [L - 1, channels], "ssm" [heads, P, N])."""

    kind = "mamba2"

    def __init__(self, spec: ModelSpec, store: WeightStore, i: int, source: str) -> None:
        d, heads = spec.d_model, spec.mamba_heads
        self.d_inner = heads * spec.mamba_head_dim
        channels = STATE_SHAPES[self.kind](spec)["conv"][1]  # x, B, C
        self.groups = spec.mamba_groups
        self.eps = np.float32(spec.norm_eps)
        what = "from the model's ssm metadata"

        def matrix(role: str, shape: tuple[int, int]) -> QuantTensor:
            t = store.matrix(spec.layer_tensor(role, i))
            if tuple(t.shape) != shape:
                raise ModelFormatError(
                    f"{source}: tensor '{t.name}' (layer {i}) has shape {tuple(t.shape)}, "
                    f"expected {shape} ({what})"
                )
            return t

        def vector(role: str, n: int) -> np.ndarray:
            # per head or channel, stored 1-D or as [1, n] / [groups, n / groups] matrices
            t = store.matrix(spec.layer_tensor(role, i))
            if t.rows * t.cols != n:
                raise ModelFormatError(
                    f"{source}: tensor '{t.name}' (layer {i}) should hold {n} values ({what}), "
                    f"found shape {tuple(t.shape)}"
                )
            v = dequantize(t.qtype, t.data).reshape(-1).astype(np.float32)
            if not np.isfinite(v).all():
                raise ModelFormatError(f"{source}: tensor '{t.name}' holds non-finite values")
            return np.ascontiguousarray(v)

        # in_proj's rows: z (d_inner), the conv's channels (x, B, C), dt per head
        self.in_proj = matrix("ssm_in", (self.d_inner + channels + heads, d))
        self.out_proj = matrix("ssm_out", (d, self.d_inner))
        conv = matrix("ssm_conv1d", (channels, spec.ssm_conv_kernel))
        w = vector("ssm_conv1d", channels * spec.ssm_conv_kernel)
        self.conv_t = np.ascontiguousarray(w.reshape(conv.shape).T)  # [L, channels]
        if store.has(spec.layer_tensor("ssm_conv1d_bias", i)):
            self.conv_b = vector("ssm_conv1d_bias", channels)
        else:  # llama.cpp: optional
            self.conv_b = np.zeros(channels, np.float32)
        self.dt_bias = vector("ssm_dt_bias", heads)
        self.a = vector("ssm_a", heads)  # -exp(A_log), as the converter stores it
        self.d = vector("ssm_d", heads)
        self.norm = vector("ssm_norm", self.d_inner)

    def _mix(self, proj: np.ndarray, state: LayerState, y: np.ndarray) -> None:
        mamba2_rows(proj, self.conv_t, self.conv_b, self.dt_bias, self.a, self.d, self.norm,
                    self.groups, self.eps, state["conv"], state["ssm"], y)  # fmt: skip

    def prompt(self, x: np.ndarray, state: LayerState) -> np.ndarray:
        proj = qmatvec.project(self.in_proj, x)
        y = np.empty((x.shape[0], self.d_inner), np.float32)
        self._mix(proj, state, y)
        return qmatvec.project(self.out_proj, y)

    def decode(
        self, x: np.ndarray, ins: Sequence[LayerState], outs: Sequence[LayerState]
    ) -> np.ndarray:
        proj = qmatvec.matvec_batch(self.in_proj, x)
        y = np.empty((x.shape[0], self.d_inner), np.float32)
        for r in range(x.shape[0]):  # in order: a verification pass chains its rows
            if outs[r] is not ins[r]:
                for name, arr in ins[r].items():
                    outs[r][name][...] = arr
            self._mix(proj[r : r + 1], outs[r], y[r : r + 1])
        return qmatvec.matvec_batch(self.out_proj, y)

    def matrices(self) -> list[QuantTensor]:
        return [self.in_proj, self.out_proj]

    def bindable(self) -> bool:
        return True

    def bind(self, rows) -> tuple[list, Callable[[list[LayerState]], list], list]:
        """The bound decode form (state_cache.py's protocol): in_proj into a buffer of
        these rows, then per sequence the kernel on its state (decode's call, so the same
        bits), then out_proj."""
        n, one = rows.n, rows.n == 1
        proj = np.zeros((n, self.in_proj.shape[0]), np.float32)
        y = np.zeros((n, self.d_inner), np.float32)
        before = rows.bind((self.in_proj,), rows.row("x"), (proj[0] if one else proj,))
        after = rows.bind((self.out_proj,), y[0] if one else y, (rows.row("a"),))

        def on_states(states: list[LayerState]) -> list:
            return [(self._mix, (proj[b : b + 1], st, y[b : b + 1])) for b, st in enumerate(states)]

        return before, on_states, after
