"""Per-layer executors on a torch device: the FFN and the attention projections.

Both take and return numpy float32 on the host, as the CPU executors do, so the model
does not know where they run. Each call makes one host-to-device copy (the input) and
one device-to-host copy (the result): gate|up and q|k|v are fused into one matrix, so
one matmul reads them.

Batched decode (``decode_batch`` / ``qkv_batch`` / ``out_batch``) runs the rows through
one matmul. On the CPU kernels a row of a batch equals the one-token result bit for
bit; a torch matmul may pick another kernel for several rows, so here rows agree to
float rounding (the tests check argmax and closeness), not bit for bit.
"""

from __future__ import annotations

import numpy as np

from edgerun.errors import InvalidArgumentError
from edgerun.model.ffn import check_shapes
from edgerun.quant.formats import QuantTensor

from . import import_torch, resolve_device
from .weights import default_dtype, dtype_name, element_bytes, to_device, torch_dtype

__all__ = ["TorchFFN", "TorchProjections", "ACTIVATIONS"]

ACTIVATIONS = ("silu", "gelu_tanh")  # those of ops/activations.glu
_F16_MAX = 65504.0


def _device(device):
    torch = import_torch()
    return device if isinstance(device, torch.device) else resolve_device(str(device))


class _OnDevice:
    """Host float32 rows in, host float32 rows out, through one fused matmul each way."""

    __slots__ = ("device", "dtype", "device_bytes", "_torch", "_tdt", "_linear", "_clamp")

    def _setup(self, device, dtype) -> None:
        torch = self._torch = import_torch()
        self.device = _device(device)
        self.dtype = dtype_name(dtype if dtype is not None else default_dtype(self.device))
        self._tdt = torch_dtype(self.dtype)
        self._linear = torch.nn.functional.linear
        self._clamp = self.dtype == "float16"
        self.device_bytes = 0

    def _fused(self, parts: tuple[QuantTensor, ...]):
        rows = sum(t.rows for t in parts)
        w = self._torch.empty((rows, parts[0].cols), dtype=self._tdt, device=self.device)
        r = 0
        for t in parts:
            to_device(t, self.device, self.dtype, out=w[r : r + t.rows])
            r += t.rows
        self.device_bytes += rows * parts[0].cols * element_bytes(self.dtype)
        return w

    def _in(self, x: np.ndarray, cols: int, what: str):
        if x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != cols:
            raise InvalidArgumentError(f"{what}: x has shape {x.shape}, expected (n, {cols})")
        return self._torch.from_numpy(x).to(self.device, self._tdt)

    def _out(self, y) -> np.ndarray:
        return y.to("cpu", self._torch.float32).numpy()


class TorchFFN(_OnDevice):
    """down(act(gate x) * up x) on a torch device; an FFNExecutor (edgerun/model/ffn.py).

    The activation is computed in float32 whatever the weight dtype, with the functions
    of ops/activations.glu: silu(g) = g / (1 + exp(-g)); gelu_tanh(g) = 0.5 g (1 +
    tanh(sqrt(2/pi) (g + 0.044715 g^3))). In f16, act(g) * u is clamped to the f16
    range before the down matmul (an inf there would turn the layer into NaN).
    """

    __slots__ = ("d_model", "d_ff", "activation", "_gu", "_down", "_act")

    def __init__(
        self,
        gate: QuantTensor,
        up: QuantTensor,
        down: QuantTensor,
        activation: str,
        device="cpu",
        dtype=None,
        source: str = "model",
    ) -> None:
        d_ff, d_model = gate.shape
        check_shapes(((up, (d_ff, d_model)), (down, (d_model, d_ff))), source)
        if activation not in ACTIVATIONS:
            raise InvalidArgumentError(
                f"{source}: activation {activation!r} is not one of {', '.join(ACTIVATIONS)}"
            )
        self._setup(device, dtype)
        self.d_model, self.d_ff, self.activation = d_model, d_ff, activation
        self._gu = self._fused((gate, up))
        self._down = self._fused((down,))
        f = self._torch.nn.functional
        if activation == "silu":
            self._act = f.silu
        else:
            self._act = lambda g: f.gelu(g, approximate="tanh")

    def __call__(self, x: np.ndarray) -> np.ndarray:
        xt = self._in(x, self.d_model, "TorchFFN")
        gu = self._linear(xt, self._gu)
        g, u = gu[:, : self.d_ff].float(), gu[:, self.d_ff :].float()
        h = self._act(g).mul_(u)
        if self._clamp:
            h.clamp_(-_F16_MAX, _F16_MAX)
        return self._out(self._linear(h.to(self._tdt), self._down))

    decode_batch = __call__  # rows of different sequences: one matmul (see the module doc)


class TorchProjections(_OnDevice):
    """One layer's attention projections q, k, v (fused) and o on a torch device.

    The interface of weights.ResidentProjections: ``qkv(x) -> [q, k, v]`` and
    ``out(ctx)`` for forward(), ``qkv_batch`` / ``out_batch`` for forward_batch();
    float32 numpy [n, dim] in and out (biases, q/k norms and rope stay on the CPU).
    """

    __slots__ = ("d_model", "q_dim", "kv_dim", "_qkv", "_o")

    def __init__(
        self,
        q: QuantTensor,
        k: QuantTensor,
        v: QuantTensor,
        o: QuantTensor,
        device="cpu",
        dtype=None,
        source: str = "model",
    ) -> None:
        q_dim, d_model = q.shape
        kv_dim = k.rows
        check_shapes(
            ((k, (kv_dim, d_model)), (v, (kv_dim, d_model)), (o, (d_model, q_dim))),
            source,
        )
        self._setup(device, dtype)
        self.d_model, self.q_dim, self.kv_dim = d_model, q_dim, kv_dim
        self._qkv = self._fused((q, k, v))
        self._o = self._fused((o,))

    def qkv(self, x: np.ndarray) -> list[np.ndarray]:
        y = self._out(self._linear(self._in(x, self.d_model, "TorchProjections.qkv"), self._qkv))
        a, b = self.q_dim, self.q_dim + self.kv_dim
        # one row: the column slices are contiguous already (no copy)
        return [
            np.ascontiguousarray(y[:, :a]),
            np.ascontiguousarray(y[:, a:b]),
            np.ascontiguousarray(y[:, b:]),
        ]

    def out(self, ctx: np.ndarray) -> np.ndarray:
        return self._out(self._linear(self._in(ctx, self.q_dim, "TorchProjections.out"), self._o))

    qkv_batch = qkv
    out_batch = out
