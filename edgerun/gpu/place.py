"""Apply a GPU placement: move chosen layers' FFN and/or attention projections onto a
torch device by swapping their executors (``layer.ffn``, ``layer.attn_proj``).

Weights are fetched by name (``spec.layer_tensor("ffn_gate", i)`` ...) from anything with
``matrix(name) -> QuantTensor``: the model's ResidentStore, or an OffloadStore, whose
GGUF file is still mapped even when the FFNs are computed from a flash bundle.

``layer_device_bytes(spec, dtype)`` sizes one layer on the device without building
anything, for a planner.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from edgerun.arch.spec import ATTENTION_ROLES
from edgerun.errors import InvalidArgumentError, ModelFormatError, UnsupportedError

from . import resolve_device
from .executors import TorchFFN, TorchProjections
from .weights import default_dtype, dtype_name, element_bytes

__all__ = ["PARTS", "GpuPlacement", "move_layers", "layer_device_bytes"]

PARTS = ("ffn", "attention")


@dataclass(frozen=True)
class GpuPlacement:
    """What move_layers put on the device."""

    device: str  # e.g. "cuda:0", "cpu"
    dtype: str  # "float16" | "bfloat16" | "float32"
    layers: tuple[int, ...]  # sorted layer indices
    parts: tuple[str, ...]  # subset of PARTS, in PARTS order
    device_bytes: int  # weight bytes allocated on the device (all moved layers)
    layer_bytes: dict[int, int] = field(default_factory=dict)  # per moved layer

    def describe(self) -> str:
        if not self.layers:
            return f"GPU ({self.device}): nothing placed"
        ls = self.layers
        span = (
            f"layers {ls[0]}..{ls[-1]}"
            if list(ls) == list(range(ls[0], ls[-1] + 1))
            else "layers " + ",".join(map(str, ls))
        )
        return (
            f"GPU ({self.device}, {self.dtype}): {span} ({len(ls)}), "
            f"{' + '.join(self.parts)}, {self.device_bytes / 2**20:.0f} MiB of weights"
        )


def layer_device_bytes(spec, dtype="float16") -> dict[str, int]:
    """Weight bytes one layer takes on the device, per part: {"ffn": ..., "attention": ...}.

    Dense matrices of `dtype` (weights are dequantized at load, see gpu/weights.py):
    FFN gate + up + down = 3 d_ff d_model; attention q, k, v, o = (2 q_dim + 2 kv_dim)
    d_model. Excludes the torch/CUDA context and the per-call activations (a few
    vectors of d_ff floats), which a planner should reserve once.
    """
    e = element_bytes(dtype)
    return {
        "ffn": 3 * spec.d_ff * spec.d_model * e,
        "attention": (2 * spec.q_dim + 2 * spec.kv_dim) * spec.d_model * e,
    }


def _parts(parts: Iterable[str]) -> tuple[str, ...]:
    got = set(parts)
    bad = got - set(PARTS)
    if bad or not got:
        raise InvalidArgumentError(
            f"GPU parts {sorted(bad) if bad else '(none)'}: choose from {', '.join(PARTS)}"
        )
    return tuple(p for p in PARTS if p in got)


def move_layers(
    transformer,
    weights,
    layers: Sequence[int],
    device: str = "cuda",
    parts: Iterable[str] = PARTS,
    dtype=None,
) -> GpuPlacement:
    """Put `parts` of `layers` of `transformer` on torch `device` ("cpu", "cuda", "cuda:N").

    weights: has ``matrix(name) -> QuantTensor`` (the model's store). dtype: None for the
    device's default (f16 on CUDA, f32 on the CPU), or "float16" / "bfloat16" /
    "float32". Replaces ``layer.ffn`` (TorchFFN) and/or ``layer.attn_proj``
    (TorchProjections); everything else of the layer stays on the CPU. All checks run
    before anything is moved; an error while building leaves the layers moved so far
    in place and the rest untouched.
    """
    spec = transformer.spec
    if getattr(spec, "layered", False) or getattr(spec, "layer_d_ff", ()):
        raise UnsupportedError(
            f"move_layers: {spec.arch} layers differ in shape or share KV (per-layer head "
            "dims, FFN widths); the GPU executors take one shape for all layers"
        )
    parts_t = _parts(parts)
    idx = sorted({int(i) for i in layers})
    if len(idx) != len(list(layers)):
        raise InvalidArgumentError(f"move_layers: layer listed twice in {list(layers)}")
    if idx and (idx[0] < 0 or idx[-1] >= spec.n_layers):
        raise InvalidArgumentError(
            f"move_layers: layers must be in 0..{spec.n_layers - 1}, got {list(layers)}"
        )
    dev = resolve_device(device)
    dt = dtype_name(dtype if dtype is not None else default_dtype(dev))
    src = str(getattr(transformer, "source", "model"))
    name, m = spec.layer_tensor, weights.matrix
    want = {
        "ffn": {
            "ffn_gate": (spec.d_ff, spec.d_model),
            "ffn_up": (spec.d_ff, spec.d_model),
            "ffn_down": (spec.d_model, spec.d_ff),
        },
        "attention": dict(
            zip(
                ATTENTION_ROLES,
                (
                    (spec.q_dim, spec.d_model),
                    (spec.kv_dim, spec.d_model),
                    (spec.kv_dim, spec.d_model),
                    (spec.d_model, spec.q_dim),
                ),
                strict=True,
            )
        ),
    }

    def parts_of(i: int) -> list[str]:  # a recurrent layer has no attention to move
        return [p for p in parts_t if p != "attention" or spec.mixer(i) == "attention"]

    for i in idx:  # every tensor checked before any memory on the device is taken
        for p in parts_of(i):
            for role, shape in want[p].items():
                t = m(name(role, i))
                if t.shape != shape:
                    raise ModelFormatError(
                        f"{src}: tensor '{t.name}' (layer {i}) has shape {t.shape}, "
                        f"expected {shape}"
                    )
    per_layer: dict[int, int] = {}
    for i in idx:
        layer = transformer.layers[i]
        nbytes = 0
        if "ffn" in parts_t:
            ffn = TorchFFN(
                m(name("ffn_gate", i)),
                m(name("ffn_up", i)),
                m(name("ffn_down", i)),
                spec.activation,
                dev,
                dt,
                source=src,
            )
            layer.ffn = ffn
            nbytes += ffn.device_bytes
        if "attention" in parts_of(i):
            proj = TorchProjections(
                *(m(name(role, i)) for role in ATTENTION_ROLES),
                dev,
                dt,
                source=src,
            )
            layer.attn_proj = proj
            nbytes += proj.device_bytes
        per_layer[i] = nbytes
    return GpuPlacement(
        device=str(dev),
        dtype=dt,
        layers=tuple(idx),
        parts=parts_t,
        device_bytes=sum(per_layer.values()),
        layer_bytes=per_layer,
    )
