"""Qwen3.5's gated DeltaNet mixer (state_cache.py's protocol): projections of x to the
conv channels (q, k, v), the output gate z and each value head's beta and decay; SiLU of
a causal depthwise conv over the channels; the gated delta rule over each value head's
[dk, dv] state; RMSNorm of each head's output times SiLU(z); the output projection.

Its per-sequence state: "conv", the last L - 1 projected inputs of the conv, and "ssm",
the value heads' matrices (ops/gated_delta.py has the kernels and their references).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import ModelFormatError
from edgerun.model.state_cache import LayerState
from edgerun.model.weights import WeightStore
from edgerun.ops import gated_delta as gd
from edgerun.ops import qmatvec
from edgerun.quant.formats import QuantTensor
from edgerun.quant.reference import dequantize

# transformers' l2norm of q and k (FLA's): x / sqrt(sum x^2 + 1e-6), whatever the model's
# RMSNorm epsilon
L2_EPS = 1e-6


class DeltaNet:
    """One layer's gated DeltaNet (states "conv" [L - 1, channels], "ssm" [Hv, dk, dv])."""

    kind = "deltanet"

    def __init__(self, spec: ModelSpec, store: WeightStore, i: int, source: str) -> None:
        d, dk = spec.d_model, spec.ssm_head_dim
        hk, hv = spec.ssm_k_heads, spec.ssm_v_heads
        self.hk, self.hv, self.dk = hk, hv, dk
        self.key_dim, self.value_dim = hk * dk, hv * dk
        channels = 2 * self.key_dim + self.value_dim
        self.eps = spec.norm_eps

        def matrix(role: str, shape: tuple[int, int]) -> QuantTensor:
            t = store.matrix(spec.layer_tensor(role, i))
            if tuple(t.shape) != shape:
                raise ModelFormatError(
                    f"{source}: tensor '{t.name}' (layer {i}) has shape {tuple(t.shape)}, "
                    f"expected {shape} (from the model's ssm metadata)"
                )
            return t

        def vector(role: str, n: int) -> np.ndarray:
            name = spec.layer_tensor(role, i)
            v = np.asarray(store.vector(name), np.float32).reshape(-1)
            if v.shape != (n,):
                raise ModelFormatError(
                    f"{source}: tensor '{name}' (layer {i}) should hold {n} values, found {v.size}"
                )
            return np.ascontiguousarray(v)

        self.qkv = matrix("ssm_qkv", (channels, d))
        self.gate = matrix("ssm_gate", (self.value_dim, d))
        self.beta = matrix("ssm_beta", (hv, d))
        self.alpha = matrix("ssm_alpha", (hv, d))
        self.out = matrix("ssm_out", (d, self.value_dim))
        conv = matrix("ssm_conv1d", (channels, spec.ssm_conv_kernel))
        w = dequantize(conv.qtype, conv.data).reshape(conv.shape).astype(np.float32)
        if not np.isfinite(w).all():
            raise ModelFormatError(f"{source}: tensor '{conv.name}' holds non-finite values")
        self.conv_t = np.ascontiguousarray(w.T)  # [L, channels]: the kernel's taps
        self.dt_bias = vector("ssm_dt_bias", hv)
        self.a_neg = vector("ssm_a", hv)  # -exp(A_log), as the converter stores it
        self.norm = vector("ssm_norm", dk)

    def _mix(self, proj: list[np.ndarray], state: LayerState) -> np.ndarray:
        """The conv, the delta rule and the gated norm of n tokens of one sequence from
        their projections [qkv, z, b, a]; the state updated in place. Returns the gated
        outputs [n, value_dim] (before the output projection)."""
        qkv, z, b, a = proj
        n, kd = qkv.shape[0], self.key_dim
        c = gd.conv1d_silu(qkv, self.conv_t, state["conv"])
        q = np.ascontiguousarray(c[:, :kd]).reshape(n, self.hk, self.dk)
        k = np.ascontiguousarray(c[:, kd : 2 * kd]).reshape(n, self.hk, self.dk)
        v = np.ascontiguousarray(c[:, 2 * kd :]).reshape(n, self.hv, self.dk)
        g, beta = gd.decay_beta(np.ascontiguousarray(a), np.ascontiguousarray(b), self.a_neg,
                                self.dt_bias)  # fmt: skip
        o = gd.gated_delta(q, k, v, g, beta, state["ssm"], L2_EPS)
        y = gd.gated_rmsnorm(o, np.ascontiguousarray(z).reshape(o.shape), self.norm, self.eps)
        return y.reshape(n, self.value_dim)

    def _weights(self) -> tuple[QuantTensor, ...]:
        return (self.qkv, self.gate, self.beta, self.alpha)

    def prompt(self, x: np.ndarray, state: LayerState) -> np.ndarray:
        y = self._mix(qmatvec.project_many(self._weights(), x), state)
        return qmatvec.project(self.out, y)

    def decode(
        self, x: np.ndarray, ins: Sequence[LayerState], outs: Sequence[LayerState]
    ) -> np.ndarray:
        proj = qmatvec.matvec_batch_many(self._weights(), x)
        y = np.empty((x.shape[0], self.value_dim), np.float32)
        for r in range(x.shape[0]):  # in order: a verification pass chains its rows
            if outs[r] is not ins[r]:
                for name, arr in ins[r].items():
                    outs[r][name][...] = arr
            y[r] = self._mix([p[r : r + 1] for p in proj], outs[r])[0]
        return qmatvec.matvec_batch(self.out, y)

    def matrices(self) -> list[QuantTensor]:
        return [self.qkv, self.gate, self.beta, self.alpha, self.out]

    def bindable(self) -> bool:
        return True

    def bind(self, rows) -> tuple[list, Callable[[list[LayerState]], list], list]:
        """The bound decode form (state_cache.py's protocol): the projections into buffers
        of these rows, then per sequence the conv, delta rule and gated norm on its state
        (the calls decode makes, so the same bits), then the output projection."""
        n, one = rows.n, rows.n == 1
        widths = [t.shape[0] for t in self._weights()]
        proj = [np.zeros((n, w), np.float32) for w in widths]
        y = np.zeros((n, self.value_dim), np.float32)
        before = rows.bind(self._weights(), rows.row("x"), tuple(p[0] if one else p for p in proj))
        after = rows.bind((self.out,), y[0] if one else y, (rows.row("a"),))

        def mix_row(b: int, state: LayerState) -> None:
            y[b] = self._mix([p[b : b + 1] for p in proj], state)[0]

        def on_states(states: list[LayerState]) -> list:
            return [(mix_row, (b, st)) for b, st in enumerate(states)]

        return before, on_states, after
