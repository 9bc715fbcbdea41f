"""One transformer layer, defined once.

A model's layers are a program: a list of steps per layer, built from the ModelSpec's
switches in one place (`layer_steps`). Each step holds both of its forms side by side:

- `run(rows)` computes it with the general kernels for a pass of rows: a prompt of n
  tokens of one sequence, or one decode token each of n sequences (their rows then take
  the batched decode kernels, each row equal to a one-token step bit for bit);
- `bind(rows)` lays it out as kernel calls on fixed buffers for the bound decode step
  (decode_step.py), which replays them for every token with no Python glue between.

Both forms call the same compiled kernels in the same order, so the bound step equals
the general path bit for bit. A switch (q/k norm, post norms, biases, a window, ...)
is honoured by the step that owns it, in both forms, in this module.

Steps hand values on through the rows' buffers: `h` the residual stream, `x` the normed
input of the next block, `a` the output of the last block before its residual add. Each
layer ends by norming `h` for whatever comes next (the next layer's attention, or the
head), so a layer boundary costs one fused kernel in the bound step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.model.altup import AltUpCorrect, AltUpPredict, LaurelResidual
from edgerun.model.ffn import DenseFFN, FFNExecutor, decode_rows
from edgerun.model.state_cache import LayerState, RecurrentMixer
from edgerun.model.weights import AttentionProjections, ResidentProjections
from edgerun.ops import activations, qmatvec
from edgerun.ops.norm import _layernorm_serial, _rmsnorm_serial, layernorm, rmsnorm
from edgerun.ops.rope import rope_inplace
from edgerun.ops.token_step import (
    NO_CENTRE,
    add_layernormed,
    add_normed,
    add_rows,
    attend_rows,
    token_calls,
)
from edgerun.quant.formats import QuantTensor

__all__ = [
    "Layer",
    "Step",
    "Rows",
    "BoundRows",
    "ATTEND",
    "InputNorm",
    "Attention",
    "Recurrent",
    "StateSlot",
    "Residual",
    "AddAttention",
    "FeedForward",
    "PerLayerOutput",
    "layer_steps",
    "layer_matrices",
]

NONE = np.empty(0, np.float32)  # an absent bias or norm, as the fused kernels take it
ATTEND = object()  # in a bound layout: the attention kernels, bound later to the caches


class Layer:
    """A layer's weights: norms, projections, optional biases and norms, the FFN."""

    __slots__ = (
        "attn_norm",
        "q",
        "k",
        "v",
        "o",
        "attn_proj",
        "ffn_norm",
        "ffn",
        "q_bias",
        "k_bias",
        "v_bias",
        "q_norm",
        "k_norm",
        "post_attn_norm",
        "post_ffn_norm",
        "o_bias",
        "mixer",
        # Gemma 4: the per-layer embedding's gate, projection and norm, the output scalar
        # (None where the model has none; k and v are None on a KV-shared layer)
        "ple_gate",
        "ple_proj",
        "ple_post_norm",
        "out_scale",
        # Gemma 3n: the AltUp parts and the Laurel block (model/altup.py; None without)
        "altup",
        "laurel",
    )

    attn_proj: AttentionProjections | None  # None in a recurrent layer
    ffn: FFNExecutor
    mixer: RecurrentMixer | None  # a recurrent layer's token mixer (else None)


def layer_matrices(layer: Layer) -> list[QuantTensor]:
    """A layer's attention (or recurrent mixer's) matrices and, for a dense FFN, its three."""
    ts = [t for t in (layer.q, layer.k, layer.v, layer.o) if t is not None]
    if getattr(layer, "mixer", None) is not None:
        ts += layer.mixer.matrices()
    if type(layer.ffn) is DenseFFN:
        ts += [layer.ffn.gate, layer.ffn.up, layer.ffn.down]
    return ts


class Rows:
    """The general path's state while one pass runs through the layers.

    decode: the rows are one decode token each of different sequences (batched decode
    kernels, each row as a one-token step computes it); else one sequence's prompt.
    attend(layer, q, k, v, window, softcap) stores k, v into the caches and returns the
    attention context [n, q_dim] (softcap > 0: the scores' tanh cap, Gemma 2); rope(base)
    gives the (cos, sin) tables for the pass (base None: the tables of no rotation, for a
    layer without RoPE). states(layer) gives a recurrent layer's (ins, outs) states
    (state_cache.PassStates: one pair for a prompt, one per row for decode rows)."""

    __slots__ = (
        "h", "x", "a", "positions", "decode", "attend", "rope", "states", "ple", "streams",
        "laurel",
    )  # fmt: skip

    def __init__(
        self,
        h: np.ndarray,
        positions: np.ndarray,
        decode: bool,
        attend: Callable[..., np.ndarray],
        rope: Callable[[float | None], tuple[np.ndarray, np.ndarray]],
        states: Callable[[int], tuple[list[LayerState], list[LayerState]]] | None = None,
    ) -> None:
        self.states = states
        self.h = h
        self.x: np.ndarray | None = None
        self.a: np.ndarray | None = None
        self.positions = positions
        self.decode = decode
        self.attend = attend
        self.rope = rope
        # per-layer embeddings [n, n_layers, width] (model/per_layer.py), None without
        self.ple: np.ndarray | None = None
        # Gemma 3n: the AltUp streams [A, n, d_model] and the layer's Laurel residual
        # (model/altup.py), None without
        self.streams: np.ndarray | None = None
        self.laurel: np.ndarray | None = None


class BoundRows:
    """Buffers of the bound decode step for n sequences (n = 1: one token), and the
    kernel binders that match them."""

    def __init__(self, spec: ModelSpec, n: int) -> None:
        f32 = np.float32
        self.n = n
        self.h, self.x, self.a = (np.zeros((n, spec.d_model), f32) for _ in range(3))
        self.q, self.ctx = np.zeros((n, spec.q_dim), f32), np.zeros((n, spec.q_dim), f32)
        self.k, self.v = np.zeros((n, spec.kv_dim), f32), np.zeros((n, spec.kv_dim), f32)
        self.g, self.u, self.act = (np.zeros((n, spec.d_ff), f32) for _ in range(3))
        self.positions = np.zeros(n, np.int64)
        self.bind = qmatvec.bound_matvecs if n == 1 else qmatvec.bound_matvecs_batch

    def row(self, name: str) -> np.ndarray:
        """A buffer as the kernels take it: its one row for one sequence, else all rows."""
        buf = getattr(self, name)
        return buf[0] if self.n == 1 else buf


Call = tuple[Callable, tuple]


class Step(Protocol):
    def run(self, rows: Rows) -> None: ...

    def bindable(self) -> bool:
        """Whether `bind` covers this step's executors (resident weights)."""
        ...

    def bind(self, rows: BoundRows) -> list[Call | object]: ...


class InputNorm:
    """x = norm(h): the norm before the first layer (each layer norms for the next);
    RMSNorm, or LayerNorm where the spec's norm_kind is "layer". weight None (a family
    without pre-norms): x = h."""

    def __init__(self, weight: np.ndarray | None, eps: float, kind: str = "rms") -> None:
        self.weight, self.eps, self.layer_norm = weight, np.float64(eps), kind == "layer"

    def run(self, rows: Rows) -> None:
        if self.weight is None:
            rows.x = rows.h.copy()
            return
        norm = layernorm if self.layer_norm else rmsnorm
        rows.x = norm(rows.h, self.weight, self.eps)

    def bindable(self) -> bool:
        return True

    def bind(self, rows: BoundRows) -> list[Call | object]:
        if self.weight is None:
            return [(np.copyto, (rows.x, rows.h))]
        kernel = _layernorm_serial if self.layer_norm else _rmsnorm_serial
        return [(kernel, (rows.h, self.weight, self.eps, rows.x))]


class Attention:
    """a = o(attention(rope(norm(q/k + bias)), cache)) of x, storing k and v in the cache.

    Its switches: q/k/v/o biases, q/k RMSNorm (per head, or over the whole projection),
    the layer's window, RoPE base or no RoPE, the attention scale (q is multiplied by
    query_scale after RoPE, so the kernels' 1/sqrt(head_dim) gives it) and the scores'
    softcap (Gemma 2: cap * tanh(s / cap) before the softmax, inside the kernels), the
    attention temperature (q then times the spec's attn_temperatures at its position), and
    the output gate (Qwen3.5: the q projection holds each head's q then its gate, and the
    context is multiplied by sigmoid(gate) before the output projection)."""

    def __init__(self, spec: ModelSpec, layer: Layer, index: int) -> None:
        self.spec, self.layer, self.index = spec, layer, index
        self.slot = spec.kv_slot(index)  # its rows in the KV caches (attention layers only)
        self.window = spec.window(index)
        # the RoPE tables' key (Rows.rope): the layer's base, None without RoPE
        self.base = spec.rope_base_of(index) if spec.rotates(index) else None
        self.eps = np.float64(spec.norm_eps)
        self.neox = spec.rope_style == "neox"
        self.q_scale = np.float32(spec.query_scale(index))
        self.softcap = spec.attn_softcap
        self.temperature = spec.attn_temp_scale != 0.0
        # where layers differ (Gemma 4): this layer's head shape, RoPE, KV source, v norm
        self.head_dim, self.kv_heads = spec.head_dim_of(index), spec.kv_heads_of(index)
        self.layered = spec.layered
        self.rope_kind = (spec.rope_dim_of(index), spec.rope_freqs_of(index))
        self.v_ones = np.ones(self.head_dim, np.float32) if spec.v_norm else None
        self.gated = spec.attn_output_gate

    def heads(
        self, qkv: list[np.ndarray], positions: np.ndarray, cos: np.ndarray, sin: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Projected q, k, v [n, dim] -> per-head, biased, q/k-normed and rotated."""
        s, layer = self.spec, self.layer
        q, k, v = qkv
        n = q.shape[0]
        if k is None:  # a KV-shared layer: q alone (the keys are its source layer's)
            if layer.q_norm is not None:
                q = rmsnorm(q.reshape(n, -1, layer.q_norm.shape[0]), layer.q_norm, self.eps)
            q = q.reshape(n, s.n_heads, self.head_dim)
            rope_inplace(q, positions, cos, sin, self.neox)
            if self.q_scale != 1.0:
                q *= self.q_scale
            return q, None, None
        if layer.q_bias is not None:
            q += layer.q_bias
            k += layer.k_bias
            v += layer.v_bias
        if layer.q_norm is not None:  # in groups of the norm's width: a head or all
            q = rmsnorm(q.reshape(n, -1, layer.q_norm.shape[0]), layer.q_norm, self.eps)
            k = rmsnorm(k.reshape(n, -1, layer.k_norm.shape[0]), layer.k_norm, self.eps)
        q = q.reshape(n, s.n_heads, self.head_dim)
        k = k.reshape(n, self.kv_heads, self.head_dim)
        v = v.reshape(n, self.kv_heads, self.head_dim)
        if self.v_ones is not None:
            v = rmsnorm(v, self.v_ones, self.eps)
        rope_inplace(q, positions, cos, sin, self.neox)
        rope_inplace(k, positions, cos, sin, self.neox)
        if self.q_scale != 1.0:
            q *= self.q_scale
        if self.temperature:
            q *= s.attn_temperatures(positions)[:, None, None]
        return q, k, v

    def run(self, rows: Rows) -> None:
        proj = self.layer.attn_proj
        qkv = proj.qkv_batch(rows.x) if rows.decode else proj.qkv(rows.x)
        gate = None
        if self.gated:  # each head's q, then its gate (Qwen3.5's attn_output_gate)
            n, s = rows.x.shape[0], self.spec
            qg = qkv[0].reshape(n, s.n_heads, 2, s.head_dim)
            gate = np.ascontiguousarray(qg[:, :, 1]).reshape(n, s.q_dim)
            qkv = [np.ascontiguousarray(qg[:, :, 0]).reshape(n, s.q_dim), *qkv[1:]]
        kind = self.rope_kind if self.layered else ()
        q, k, v = self.heads(qkv, rows.positions, *rows.rope(self.base, *kind))
        ctx = rows.attend(self.slot, q, k, v, self.window, self.softcap)
        if gate is not None:
            ctx = output_gate(ctx, gate, np.empty_like(ctx))
        rows.a = proj.out_batch(ctx) if rows.decode else proj.out(ctx)
        if self.layer.o_bias is not None:
            rows.a += self.layer.o_bias

    def bindable(self) -> bool:
        # per-layer shapes, shared KV and the v norm take the general path only
        plain = not self.layered and self.v_ones is None
        return plain and type(self.layer.attn_proj) is ResidentProjections

    def bind(self, rows: BoundRows) -> list[Call | object]:
        p = self.layer.attn_proj
        q_out, gated = rows.row("q"), []
        if self.gated:  # q and gate into a buffer of their own; q then split out, and the
            # context times sigmoid(gate) after attention, as run does
            s, n = self.spec, rows.n
            qg = np.zeros((n, 2 * s.q_dim), np.float32)
            gate = np.zeros((n, s.q_dim), np.float32)
            halves = qg.reshape(n, s.n_heads, 2, s.head_dim)
            q_out = qg[0] if n == 1 else qg
            split = [
                (np.copyto, (rows.q.reshape(n, s.n_heads, s.head_dim), halves[:, :, 0])),
                (np.copyto, (gate.reshape(n, s.n_heads, s.head_dim), halves[:, :, 1])),
            ]
            ctx = rows.row("ctx")
            gated = [(output_gate, (ctx, gate[0] if n == 1 else gate, ctx))]
        qkv = rows.bind((p.q, p.k, p.v), rows.row("x"), (q_out, rows.row("k"),
                                                         rows.row("v")))  # fmt: skip
        if self.gated:
            qkv += split
        out = rows.bind((p.o,), rows.row("ctx"), (rows.row("a"),))
        if self.layer.o_bias is not None:
            out.append((np.add, (rows.a, self.layer.o_bias, rows.a)))
        return [*qkv, ATTEND, *gated, *out]

    def bind_attention(
        self, rows: BoundRows, caches: list, cos: np.ndarray, sin: np.ndarray,
        scores: np.ndarray, batch,
    ) -> list[Call]:  # fmt: skip
        """The fused attention kernels (ops/token_step) on these caches: biases, q/k norm,
        RoPE, the KV store and attention in two calls for one sequence (token_calls), one
        for several. batch: the caches' ops/attention.BatchAttention for several
        sequences (None for one)."""
        layer = self.layer
        vectors = tuple(
            NONE if t is None else t
            for t in (layer.q_bias, layer.k_bias, layer.v_bias, layer.q_norm, layer.k_norm)
        )
        s, li = self.spec, self.slot
        scale = np.float32(1.0 / np.sqrt(s.head_dim))
        softcap = np.float32(self.softcap)
        q, k, v, ctx = rows.row("q"), rows.row("k"), rows.row("v"), rows.row("ctx")
        temps = NONE  # the temperature of every position the caches hold (n_ctx: cos's)
        if self.temperature:
            temps = s.attn_temperatures(np.arange(cos.shape[0]))
        head = (q, k, v, *vectors, self.eps, rows.positions, cos, sin, self.neox, self.q_scale,
                temps)  # fmt: skip
        window = np.int64(self.window)
        centre = caches[0].key_centre  # one for every cache of a batch (BatchAttention)
        centre = NO_CENTRE if centre is None else centre[li]
        k_scale = caches[0].key_scale  # the same: BatchAttention.one_kernel
        k_scale = NO_CENTRE if k_scale is None else k_scale[li]
        if batch is None:
            c = caches[0]
            return token_calls(head, c.k[li], c.v[li], window, scale, softcap, scores, ctx,
                               centre, k_scale)  # fmt: skip
        kv_new = tuple(  # each new row as the caches store it (a row: their last axis)
            np.zeros((rows.n, s.n_kv_heads, a.shape[-1]), a.dtype)
            for a in (caches[0].k, caches[0].v)
        )
        tail = (*kv_new, batch._kaddr, batch._vaddr, batch._nctx, np.int64(li), window, scale,
                softcap, scores, ctx, centre, k_scale)  # fmt: skip
        return [(attend_rows, (*head, *tail))]


def output_gate(ctx: np.ndarray, gate: np.ndarray, out: np.ndarray) -> np.ndarray:
    """out = ctx * sigmoid(gate) (Qwen3.5's attention output gate; contiguous float32, the
    same numpy operations in the general and the bound form, so the same bits)."""
    np.multiply(ctx, np.float32(1.0) / (np.float32(1.0) + np.exp(-gate)), out=out)
    return out


class StateSlot:
    """In a bound layout: a recurrent layer's calls on the sequences' states, bound later
    to the caches (decode_step.py): `calls(states)` with states[b] the layer's state of
    sequence b (one sequence per row; each updated in place)."""

    def __init__(self, index: int, calls: Callable[[list[LayerState]], list[Call]]) -> None:
        self.index, self.calls = index, calls

    def bind(self, caches: list) -> list[Call]:
        return self.calls([c.state.layers[self.index] for c in caches])


class Recurrent:
    """a = mixer(x, the sequence's state): a recurrent token mixer in place of attention
    (the protocol: state_cache.py), its state updated for the pass's tokens."""

    def __init__(self, layer: Layer, index: int) -> None:
        self.mixer, self.index = layer.mixer, index

    def run(self, rows: Rows) -> None:
        if rows.states is None:
            raise ValueError(f"layer {self.index} is recurrent: the pass needs its states")
        ins, outs = rows.states(self.index)
        if rows.decode:
            rows.a = self.mixer.decode(rows.x, ins, outs)
        else:
            rows.a = self.mixer.prompt(rows.x, ins[0])

    def bindable(self) -> bool:
        return self.mixer.bindable()

    def bind(self, rows: BoundRows) -> list[Call | object]:
        before, on_states, after = self.mixer.bind(rows)
        return [*before, StateSlot(self.index, on_states), *after]


class Residual:
    """h += post_norm(a) * scale (no post norm: a itself), then x = RMSNorm(h) for what
    follows (LayerNorm where the spec's norm_kind is "layer", which has no post norms;
    norm None, a family without pre-norms: x = h)."""

    def __init__(
        self,
        post_norm: np.ndarray | None,
        norm: np.ndarray | None,
        eps: float,
        scale: float = 1.0,
        kind: str = "rms",
    ) -> None:
        self.post_norm, self.norm, self.eps = post_norm, norm, np.float64(eps)
        self.scale = np.float32(scale)
        self.layer_norm = kind == "layer"

    def run(self, rows: Rows) -> None:
        a = rows.a
        if self.post_norm is not None:
            a = rmsnorm(a, self.post_norm, self.eps)
        if self.scale != 1.0:
            a = a * self.scale
        rows.h += a
        if self.norm is None:
            rows.x = rows.h.copy()
        else:
            norm = layernorm if self.layer_norm else rmsnorm
            rows.x = norm(rows.h, self.norm, self.eps)

    def bindable(self) -> bool:
        return True

    def bind(self, rows: BoundRows) -> list[Call | object]:
        if self.layer_norm:
            return [(add_layernormed, (rows.h, rows.a, self.eps, self.norm, rows.x))]
        post = NONE if self.post_norm is None else self.post_norm
        norm = NONE if self.norm is None else self.norm
        args = (rows.h, rows.a, post, self.eps, self.scale, norm, rows.x)
        return [(add_normed, args)]


class AddAttention:
    """h += a, x kept: a parallel block's attention output joins the residual stream and
    the FFN then reads the same normed input (Cohere's parallel_blocks)."""

    def run(self, rows: Rows) -> None:
        rows.h += rows.a

    def bindable(self) -> bool:
        return True

    def bind(self, rows: BoundRows) -> list[Call | object]:
        return [(add_rows, (rows.h, rows.a))]


class FeedForward:
    """a = FFN(x) through the layer's executor (resident, offloaded or on a GPU)."""

    def __init__(self, spec: ModelSpec, layer: Layer) -> None:
        self.spec, self.layer = spec, layer

    def run(self, rows: Rows) -> None:
        ffn = self.layer.ffn
        rows.a = decode_rows(ffn, rows.x) if rows.decode else ffn(rows.x)

    def bindable(self) -> bool:
        # the bound buffers are spec.d_ff wide: a layer of its own width (Gemma 4's
        # double-wide FFNs) takes the general path
        ffn = self.layer.ffn
        return type(ffn) is DenseFFN and ffn.d_ff == self.spec.d_ff and ffn.sparsity is None

    def bind(self, rows: BoundRows) -> list[Call | object]:
        ffn = self.layer.ffn
        glu = activations._glu_rows_serial
        if rows.n * self.spec.d_ff >= activations.PARALLEL_MIN:
            glu = activations._glu_rows  # as activations.glu chooses
        gelu = activations._GELU[ffn.activation]
        x, g, u, act, a = (rows.row(b) for b in ("x", "g", "u", "act", "a"))
        return [
            *rows.bind((ffn.gate, ffn.up), x, (g, u)),
            (glu, (gelu, rows.g, rows.u, rows.act)),
            *rows.bind((ffn.down,), act, (a,)),
        ]


class PerLayerOutput:
    """Gemma 4's layer end: h += post_norm(proj(gelu(gate h) * e)) with e the layer's
    per-layer embedding (rows.ple, where the layer has a gate), then h *= the layer's scalar
    (where it has one), then x = RMSNorm(h) for what follows (norm None: x = h). General
    path only (bindable False): the bound decode step does not cover it."""

    def __init__(self, layer: Layer, index: int, norm: np.ndarray | None, eps: float) -> None:
        self.layer, self.index, self.norm, self.eps = layer, index, norm, np.float64(eps)

    def run(self, rows: Rows) -> None:
        layer = self.layer
        if layer.ple_gate is not None:
            if rows.ple is None:  # a pass that skipped them would compute another model
                raise RuntimeError("PerLayerOutput: the rows carry no per-layer embeddings")
            mm = qmatvec.matvec_batch if rows.decode else qmatvec.project
            e = np.ascontiguousarray(rows.ple[:, self.index])
            g = activations.glu(mm(layer.ple_gate, rows.h), e, "gelu_tanh")
            rows.h += rmsnorm(mm(layer.ple_proj, g), layer.ple_post_norm, self.eps)
        if layer.out_scale is not None:
            rows.h *= layer.out_scale
        rows.x = rows.h.copy() if self.norm is None else rmsnorm(rows.h, self.norm, self.eps)

    def bindable(self) -> bool:
        return False

    def bind(self, rows: BoundRows) -> list[Call | object]:
        raise NotImplementedError("PerLayerOutput runs on the general path only")


def layer_steps(
    spec: ModelSpec, layer: Layer, index: int, next_norm: np.ndarray | None
) -> list[Step]:
    """Layer `index` as steps: pre-norm attention and FFN blocks, each added to the
    residual stream (through the post norm and residual scale where the spec has them),
    the stream then normed by `next_norm` (the next layer's attention norm, or the output
    norm after the last; None: no pre-norm, the next block reads the stream itself).
    Parallel blocks (Cohere): attention and FFN both read the attention norm's output and
    both add to the stream, normed once after."""
    eps, scale, kind = spec.norm_eps, spec.residual_scale, spec.norm_kind
    recurrent = getattr(layer, "mixer", None) is not None
    mixer = Recurrent(layer, index) if recurrent else Attention(spec, layer, index)
    if spec.parallel_blocks:
        return [
            mixer,
            AddAttention(),
            FeedForward(spec, layer),
            Residual(None, next_norm, eps, scale, kind),
        ]
    if spec.altup_inputs:  # Gemma 3n: AltUp streams around the block, Laurel beside it
        # (the transformer adds the streams' expansion before the first layer and their
        # merge after the last: AltUpExpand, AltUpMerge)
        return [
            AltUpPredict(spec, layer, index),
            mixer,
            LaurelResidual(layer.post_attn_norm, layer.ffn_norm, eps),
            FeedForward(spec, layer),
            Residual(layer.post_ffn_norm, None, eps, scale, kind),
            AltUpCorrect(spec, layer, index),
        ]
    if spec.per_layer_input or spec.layer_output_scale:  # Gemma 4
        # experts beside the MLP read the stream and norm each part's input themselves
        ffn_norm = None if getattr(layer.ffn, "reads_stream", False) else layer.ffn_norm
        return [
            mixer,
            Residual(layer.post_attn_norm, ffn_norm, eps, scale, kind),
            FeedForward(spec, layer),
            Residual(layer.post_ffn_norm, None, eps, scale, kind),
            PerLayerOutput(layer, index, next_norm, eps),
        ]
    return [
        mixer,
        Residual(layer.post_attn_norm, layer.ffn_norm, eps, scale, kind),
        FeedForward(spec, layer),
        Residual(layer.post_ffn_norm, next_norm, eps, scale, kind),
    ]
