"""Mixture-of-experts FFN: a router picks each row's experts; the experts' gated FFNs,
weighted by the router's probabilities, make the row's output.

For rows x [n, d_model] (one prompt's tokens, or decode rows of several sequences):

1. router logits = ffn_gate_inp x [n, n_expert]; probabilities = softmax(logits) (or
   sigmoid(logits), spec.expert_gating);
2. each row's n_expert_used most probable experts (by probability + exp_probs_b where the
   layer has that bias), their probabilities renormalised to
   sum 1 where the family says (spec.expert_norm), times spec.expert_scale;
3. out = sum over the row's experts, in rank order, of weight * down(silu(gate x) * up x);
4. where the layer has a shared expert: out += sigmoid(ffn_gate_inp_shexp . x) * shared(x)
   (without that gate tensor the shared expert adds unscaled).

The rows are grouped by expert: each selected expert's rows go through one batched
matmul (qmatvec), so a pass reads each selected expert once however many rows chose it.
Decode rows take the batched decode kernels (each row equal to a one-row pass bit for bit);
a prompt's rows the prefill ones.

Where the experts live is an :class:`ExpertSource`'s care: resident views of the file's 3-D
tensors here (:class:`ResidentExperts`), or a cache streamed from flash under a RAM budget
(offload/), behind the same two members.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import ModelFormatError, UnsupportedError
from edgerun.model.ffn import DenseFFN, check_shapes
from edgerun.ops import qmatvec
from edgerun.ops.activations import glu
from edgerun.ops.norm import rmsnorm
from edgerun.quant.formats import QuantTensor

__all__ = [
    "BesideNorms",
    "ExpertMatrices",
    "ExpertSource",
    "ResidentExperts",
    "MoEFFN",
    "route",
    "moe_ffn",
    "is_moe_layer",
    "ExpertFootprint",
    "expert_footprint",
]

# llama.cpp's clamp of the renormalising sum (the smallest normal f16), so a row whose
# chosen probabilities all underflow divides by it rather than by 0
_MIN_WEIGHT_SUM = np.float32(6.103515625e-5)


class ExpertMatrices(NamedTuple):
    """One expert's gated FFN: gate and up [expert_ff, d_model], down [d_model, expert_ff]."""

    gate: QuantTensor
    up: QuantTensor
    down: QuantTensor


class ExpertSource(Protocol):
    """Where a layer's routed experts are read from."""

    n_expert: int

    def experts(self, ids: Sequence[int]) -> Sequence[ExpertMatrices]:
        """The matrices of experts `ids` (distinct, ascending), in that order. A pass asks
        once for all the experts its rows chose, so a streaming source can read them
        together; the matrices stay valid until the next call."""
        ...


class ResidentExperts:
    """Experts held in memory (for a GGUF: 2-D views of the mapped 3-D tensors)."""

    __slots__ = ("n_expert", "_matrices")

    def __init__(
        self, gate: Sequence[QuantTensor], up: Sequence[QuantTensor], down: Sequence[QuantTensor]
    ) -> None:
        if not len(gate) == len(up) == len(down) > 0:
            raise ValueError(
                f"ResidentExperts: {len(gate)} gate, {len(up)} up, {len(down)} down matrices"
            )
        self.n_expert = len(gate)
        self._matrices = [ExpertMatrices(*m) for m in zip(gate, up, down)]

    def experts(self, ids: Sequence[int]) -> list[ExpertMatrices]:
        return [self._matrices[e] for e in ids]

    def matrices(self, e: int) -> ExpertMatrices:
        """Expert e's matrices."""
        return self._matrices[e]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for m in self._matrices for t in m)


def route(
    logits: np.ndarray,
    k: int,
    norm: bool,
    scale: float = 1.0,
    gating: str = "softmax",
    bias: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [n, n_expert] -> (experts int64 [n, k] by falling probability, ties to
    the lower id; weights float32 [n, k]): the chosen probabilities (softmax over the
    experts, or each logit's sigmoid), renormalised to sum 1 when `norm`, times `scale`.
    bias [n_expert]: added to the probabilities to pick the experts only (LFM2-MoE's
    exp_probs_b). Row by row, so a row's result does not depend on the others."""
    logits = np.asarray(logits, np.float32)
    if gating == "sigmoid":
        probs = np.float32(1.0) / (np.float32(1.0) + np.exp(-logits))
    else:
        e = np.exp(logits - logits.max(axis=1, keepdims=True))
        probs = e / e.sum(axis=1, keepdims=True)
    pick = logits if bias is None and gating == "softmax" else probs
    if bias is not None:
        pick = probs + bias
    top = np.argsort(-pick, axis=1, kind="stable")[:, :k]
    w = np.take_along_axis(probs, top, axis=1)
    if norm:
        w = w / np.maximum(w.sum(axis=1, keepdims=True), _MIN_WEIGHT_SUM)
    if scale != 1.0:
        w = w * np.float32(scale)
    return top.astype(np.int64), w.astype(np.float32)


class BesideNorms(NamedTuple):
    """Gemma 4's norms around experts that run beside the dense MLP (experts_beside_mlp):
    on the residual stream h, the MLP reads RMSNorm(h) * mlp_norm, the experts RMSNorm(h)
    * experts_norm, the router RMSNorm(h) * router_gain (ffn_gate_inp.scale / sqrt(d));
    their outputs are normed by their post norms and summed."""

    mlp_norm: np.ndarray
    mlp_post_norm: np.ndarray
    experts_norm: np.ndarray
    experts_post_norm: np.ndarray
    router_gain: np.ndarray
    eps: float


class MoEFFN:
    """A mixture-of-experts FFN on rows x [n, d_model] (module docstring). d_ff is one
    expert's width."""

    __slots__ = (
        "router",
        "source",
        "n_expert",
        "n_used",
        "norm",
        "scale",
        "activation",
        "shared",
        "shared_gate",
        "d_model",
        "d_ff",
        "gating",
        "bias",
        "expert_scales",
        "beside",
    )

    def __init__(
        self,
        router: QuantTensor,
        source: ExpertSource,
        n_used: int,
        d_ff: int,
        norm: bool,
        scale: float = 1.0,
        activation: str = "silu",
        shared: DenseFFN | None = None,
        shared_gate: np.ndarray | None = None,
        gating: str = "softmax",
        bias: np.ndarray | None = None,
        expert_scales: np.ndarray | None = None,
        beside: BesideNorms | None = None,
    ) -> None:
        """expert_scales [n_expert]: each expert's weight times its scale (Gemma 4);
        beside: the experts run beside `shared` as Gemma 4's dense MLP, with these norms
        (the rows are then the residual stream, not a normed input)."""
        self.router, self.source = router, source
        self.n_expert, self.d_model = router.shape
        if source.n_expert != self.n_expert:
            raise ValueError(
                f"MoEFFN: router '{router.name}' scores {self.n_expert} experts, the source "
                f"holds {source.n_expert}"
            )
        if not 1 <= n_used <= self.n_expert:
            raise ValueError(f"MoEFFN: n_used {n_used} outside 1..{self.n_expert}")
        self.n_used, self.d_ff = n_used, d_ff
        self.norm, self.scale, self.activation = norm, float(scale), activation
        self.shared, self.shared_gate = shared, shared_gate
        self.gating, self.bias = gating, bias
        self.expert_scales, self.beside = expert_scales, beside
        if beside is not None and shared is None:
            raise ValueError("MoEFFN: experts beside an MLP need the MLP (shared)")

    @property
    def reads_stream(self) -> bool:
        """Whether the rows this FFN takes are the residual stream itself (experts beside
        an MLP norm their own inputs), not a normed input."""
        return self.beside is not None

    def weight_matrices(self) -> list[QuantTensor]:
        """The router, the shared expert's matrices and expert 0's: one of each matrix
        this layer's passes read, for whoever needs their formats (the kernels' warm-up)."""
        ms = [self.router, *self.source.experts([0])[0]]
        if self.shared is not None:
            ms += [self.shared.gate, self.shared.up, self.shared.down]
        return ms

    def routing(self, x: np.ndarray, decode: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Rows x [n, d_model] -> (experts [n, n_used], weights [n, n_used]) (route; the
        router's input as the rows arrive: beside an MLP, already its own norm)."""
        if decode:
            logits = qmatvec.matvec_batch(self.router, x)
        else:
            logits = qmatvec.project(self.router, x)
        sel, w = route(logits, self.n_used, self.norm, self.scale, self.gating, self.bias)
        if self.expert_scales is not None:
            w = w * self.expert_scales[sel]
        return sel, w

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """One prompt's rows (or one decode row): x float32 [n, d_model] -> [n, d_model]."""
        return self._forward(np.ascontiguousarray(x, np.float32), decode=False)

    def decode_batch(self, x: np.ndarray) -> np.ndarray:
        """Decode rows of different sequences, each row equal to a one-row call bit for bit
        (the batched decode kernels; each selected expert read once for its rows)."""
        return self._forward(np.ascontiguousarray(x, np.float32), decode=True)

    def _forward(self, x: np.ndarray, decode: bool) -> np.ndarray:
        beside = self.beside
        if beside is not None:  # x is the residual stream: each part takes its own norm
            h, eps = x, beside.eps
            sel, w = self.routing(rmsnorm(h, beside.router_gain, eps), decode)
            x = rmsnorm(h, beside.experts_norm, eps)
        else:
            sel, w = self.routing(x, decode)
        n = x.shape[0]
        k = self.n_used
        flat = sel.reshape(-1)
        order = np.argsort(flat, kind="stable")  # slots grouped by expert
        ids, starts = np.unique(flat[order], return_index=True)
        bounds = np.append(starts, flat.size)
        y = np.empty((n * k, self.d_model), np.float32)  # slot j of row r at r * k + j
        for j, m in enumerate(self.source.experts(ids.tolist())):
            slots = order[bounds[j] : bounds[j + 1]]
            xr = x[slots // k]
            if decode:
                g, u = qmatvec.matvec_batch_many((m.gate, m.up), xr)
                y[slots] = qmatvec.matvec_batch(m.down, glu(g, u, self.activation))
            else:
                g, u = qmatvec.project_many((m.gate, m.up), xr)
                y[slots] = qmatvec.project(m.down, glu(g, u, self.activation))
        y = y.reshape(n, k, self.d_model)
        out = y[:, 0] * w[:, 0:1]
        for j in range(1, k):  # in rank order, the same for a row alone or in a batch
            out += y[:, j] * w[:, j : j + 1]
        if beside is not None:
            xm = rmsnorm(h, beside.mlp_norm, eps)
            mlp = self.shared.decode_batch(xm) if decode else self.shared(xm)
            out = rmsnorm(out, beside.experts_post_norm, eps)
            out += rmsnorm(mlp, beside.mlp_post_norm, eps)
        elif self.shared is not None:
            s = self.shared.decode_batch(x) if decode else self.shared(x)
            if self.shared_gate is not None:
                z = (x * self.shared_gate).sum(axis=1, keepdims=True)
                s *= np.float32(1.0) / (np.float32(1.0) + np.exp(-z))
            out += s
        return out


def is_moe_layer(spec: ModelSpec, store, layer: int) -> bool:
    """Whether layer `layer` routes its rows to experts: a mixture-of-experts spec and a
    router tensor in the store (a family may keep dense FFNs on some layers)."""
    return spec.n_expert > 0 and store.has(spec.expert_tensor("ffn_gate_inp", layer))


def _optional_vector(store, name: str, size: int, what: str, source: str) -> np.ndarray | None:
    """The store's vector `name` of `size` values (`what` names the size in the error), or
    None where the file has none."""
    if not store.has(name):
        return None
    v = store.vector(name)
    if v.shape != (size,):
        raise ModelFormatError(
            f"{source}: tensor '{name}' should have {size} values ({what}), found {v.size}"
        )
    return v


def router_gain(store, spec: ModelSpec, layer: int, source: str) -> np.ndarray | None:
    """The gain of the RMSNorm a router of experts beside an MLP (Gemma 4) applies to the
    residual stream, ffn_gate_inp.scale / sqrt(d); None where the router reads the FFN's
    input as it arrives."""
    if not spec.experts_beside_mlp:
        return None
    d = spec.d_model
    name = spec.expert_tensor("ffn_gate_inp_scale", layer)
    gain = _optional_vector(store, name, d, "d_model", source)
    if gain is None:
        raise ModelFormatError(f"{source}: tensor '{name}' is missing")
    return (gain * np.float32(1.0 / np.sqrt(d))).astype(np.float32)


def moe_ffn(store, spec: ModelSpec, layer: int, source: str, experts: ExpertSource | None = None):
    """Layer `layer`'s MoEFFN over a WeightStore's router, shared expert and gate, each
    checked against the spec; the routed experts from `experts`, or resident views of the
    store's 3-D tensors (store.expert_matrices)."""
    d, n, ff = spec.d_model, spec.n_expert, spec.expert_ff
    router = store.matrix(spec.expert_tensor("ffn_gate_inp", layer))
    check_shapes(((router, (n, d)),), source)
    if experts is None:
        get = getattr(store, "expert_matrices", None)
        if get is None:
            raise UnsupportedError(f"{source}: this weight store cannot hold expert tensors")
        fused = spec.expert_tensor("ffn_gate_up_exps", layer)
        if store.has(fused):  # each expert's gate rows, then its up rows
            pairs = [m.stacked(2) for m in get(fused, n, (2 * ff, d))]
            gate, up = [p[0] for p in pairs], [p[1] for p in pairs]
        else:
            gate = get(spec.expert_tensor("ffn_gate_exps", layer), n, (ff, d))
            up = get(spec.expert_tensor("ffn_up_exps", layer), n, (ff, d))
        experts = ResidentExperts(
            gate, up, get(spec.expert_tensor("ffn_down_exps", layer), n, (d, ff))
        )
    shared = shared_gate = beside = None
    if spec.experts_beside_mlp:  # Gemma 4: the layer's own MLP, with the norms around both
        shared = DenseFFN(
            store.matrix(spec.layer_tensor("ffn_gate", layer)),
            store.matrix(spec.layer_tensor("ffn_up", layer)),
            store.matrix(spec.layer_tensor("ffn_down", layer)),
            spec.activation,
            expected=(spec.d_ff_of(layer), d),
            source=source,
        )

        def norm(name: str) -> np.ndarray:
            v = _optional_vector(store, name, d, "d_model", source)
            if v is None:
                raise ModelFormatError(f"{source}: tensor '{name}' is missing")
            return v

        beside = BesideNorms(
            norm(spec.layer_tensor("ffn_norm", layer)),
            norm(spec.expert_tensor("ffn_post_norm_1", layer)),
            norm(spec.expert_tensor("ffn_pre_norm_2", layer)),
            norm(spec.expert_tensor("ffn_post_norm_2", layer)),
            router_gain(store, spec, layer, source),
            spec.norm_eps,
        )
    elif store.has(spec.expert_tensor("ffn_gate_shexp", layer)):
        shared = DenseFFN(
            store.matrix(spec.expert_tensor("ffn_gate_shexp", layer)),
            store.matrix(spec.expert_tensor("ffn_up_shexp", layer)),
            store.matrix(spec.expert_tensor("ffn_down_shexp", layer)),
            spec.activation,
            expected=(spec.expert_shared_ff or spec.d_ff, d),
            source=source,
        )
        shared_gate = _optional_vector(
            store, spec.expert_tensor("ffn_gate_inp_shexp", layer), d, "d_model", source
        )
    bias = _optional_vector(store, spec.expert_tensor("exp_probs_b", layer), n, "n_expert", source)
    scales = _optional_vector(
        store, spec.expert_tensor("ffn_down_exps_scale", layer), n, "n_expert", source
    )
    return MoEFFN(
        router,
        experts,
        spec.n_expert_used,
        ff,
        spec.expert_norm,
        spec.expert_scale,
        spec.activation,
        shared,
        shared_gate,
        spec.expert_gating,
        bias,
        scales,
        beside,
    )


class ExpertFootprint(NamedTuple):
    """What a model's routed experts take: `layers` MoE layers of n_expert experts each,
    `per_expert` bytes of one expert's three matrices (the largest over the layers),
    `total` bytes of them all, `shared` bytes of the shared experts and their routers."""

    layers: int
    per_expert: int
    total: int
    shared: int


def expert_footprint(ffns: Sequence[object]) -> ExpertFootprint:
    """The footprint of the MoEFFNs among layer executors `ffns` with resident experts
    (ResidentExperts); zeros where there are none."""
    layers = per_expert = total = shared = 0
    for f in ffns:
        if not isinstance(f, MoEFFN) or not isinstance(f.source, ResidentExperts):
            continue
        layers += 1
        total += f.source.nbytes
        per_expert = max(per_expert, max(sum(t.nbytes for t in m) for m in f.source._matrices))
        shared += f.router.nbytes
        if f.shared is not None:
            shared += sum(t.nbytes for t in (f.shared.gate, f.shared.up, f.shared.down))
    return ExpertFootprint(layers, per_expert, total, shared)
