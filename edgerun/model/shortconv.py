"""LFM2's short-convolution mixer: in_proj -> B, C, x; C * causal_conv(B * x) -> out_proj,
with the last L - 1 gated inputs as its per-sequence state (state_cache.py's protocol)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import ModelFormatError
from edgerun.model.state_cache import LayerState
from edgerun.model.weights import WeightStore
from edgerun.ops import qmatvec
from edgerun.ops.shortconv import shortconv_rows
from edgerun.quant.formats import QuantTensor
from edgerun.quant.reference import dequantize


class ShortConv:
    """One layer's double-gated short convolution (state: "conv" [L - 1, d_model])."""

    kind = "shortconv"

    def __init__(self, spec: ModelSpec, store: WeightStore, i: int, source: str) -> None:
        d, width = spec.d_model, spec.shortconv_l_cache
        self.d = d
        self.in_proj = store.matrix(spec.layer_tensor("shortconv_in_proj", i))
        self.out_proj = store.matrix(spec.layer_tensor("shortconv_out_proj", i))
        conv = store.matrix(spec.layer_tensor("shortconv_conv", i))
        for t, shape in ((self.in_proj, (3 * d, d)), (self.out_proj, (d, d)), (conv, (d, width))):
            if tuple(t.shape) != shape:
                raise ModelFormatError(
                    f"{source}: tensor '{t.name}' (layer {i}) has shape {tuple(t.shape)}, "
                    f"expected {shape}"
                )
        w = dequantize(conv.qtype, conv.data).reshape(d, width).astype(np.float32)
        if not np.isfinite(w).all():
            raise ModelFormatError(f"{source}: tensor '{conv.name}' holds non-finite values")
        self.conv = np.ascontiguousarray(w)

    def prompt(self, x: np.ndarray, state: LayerState) -> np.ndarray:
        bcx = qmatvec.project(self.in_proj, x)
        y = np.empty((x.shape[0], self.d), np.float32)
        shortconv_rows(bcx, self.conv, state["conv"], state["conv"], y)
        return qmatvec.project(self.out_proj, y)

    def decode(
        self, x: np.ndarray, ins: Sequence[LayerState], outs: Sequence[LayerState]
    ) -> np.ndarray:
        bcx = qmatvec.matvec_batch(self.in_proj, x)
        y = np.empty((x.shape[0], self.d), np.float32)
        for b in range(x.shape[0]):  # in order: a verification pass chains its rows
            shortconv_rows(bcx[b : b + 1], self.conv, ins[b]["conv"], outs[b]["conv"], y[b : b + 1])
        return qmatvec.matvec_batch(self.out_proj, y)

    def matrices(self) -> list[QuantTensor]:
        return [self.in_proj, self.out_proj]

    def bindable(self) -> bool:
        return True

    def bind(self, rows) -> tuple[list, Callable[[list[LayerState]], list], list]:
        """The bound decode form (state_cache.py's protocol): in_proj, then per sequence
        the convolution on its state, then out_proj, on buffers of these rows."""
        n, one = rows.n, rows.n == 1
        bcx = np.zeros((n, 3 * self.d), np.float32)
        y = np.zeros((n, self.d), np.float32)
        before = rows.bind((self.in_proj,), rows.row("x"), (bcx[0] if one else bcx,))
        after = rows.bind((self.out_proj,), y[0] if one else y, (rows.row("a"),))

        def on_states(states: list[LayerState]) -> list:
            return [
                (shortconv_rows, (bcx[b : b + 1], self.conv, st["conv"], st["conv"], y[b : b + 1]))
                for b, st in enumerate(states)
            ]

        return before, on_states, after
