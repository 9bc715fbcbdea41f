"""ModelSpec: everything the forward pass needs to know about a model."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from edgerun.errors import ModelFormatError, UnsupportedError

# A layer's attention projections (the matrices a GPU placement moves as "attention")
ATTENTION_ROLES = ("attn_q", "attn_k", "attn_v", "attn_output")
# Per-layer tensor roles, mapped to GGUF names with "{i}" for the layer index.
LAYER_TENSORS = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "attn_q": "blk.{i}.attn_q.weight",
    "attn_k": "blk.{i}.attn_k.weight",
    "attn_v": "blk.{i}.attn_v.weight",
    "attn_output": "blk.{i}.attn_output.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "ffn_gate": "blk.{i}.ffn_gate.weight",
    "ffn_up": "blk.{i}.ffn_up.weight",
    "ffn_down": "blk.{i}.ffn_down.weight",
    # optional, used when the spec's switches ask for them
    "attn_q_bias": "blk.{i}.attn_q.bias",
    "attn_k_bias": "blk.{i}.attn_k.bias",
    "attn_v_bias": "blk.{i}.attn_v.bias",
    "attn_q_norm": "blk.{i}.attn_q_norm.weight",
    "attn_k_norm": "blk.{i}.attn_k_norm.weight",
    "post_attention_norm": "blk.{i}.post_attention_norm.weight",
    "post_ffw_norm": "blk.{i}.post_ffw_norm.weight",
    # optional in every family: read whenever the file has them (llama.cpp's
    # TENSOR_NOT_REQUIRED biases)
    "attn_output_bias": "blk.{i}.attn_output.bias",
    # recurrent mixers' tensors (ModelSpec.layer_mixers): LFM2's short convolution
    "shortconv_conv": "blk.{i}.shortconv.conv.weight",
    "shortconv_in_proj": "blk.{i}.shortconv.in_proj.weight",
    "shortconv_out_proj": "blk.{i}.shortconv.out_proj.weight",
    # Qwen3.5's gated DeltaNet: the q, k, v projection (conv channels), the output gate z,
    # beta and alpha (decay) per value head, the conv taps, dt bias, -exp(A_log), the
    # gated norm's gain and the output projection
    "ssm_qkv": "blk.{i}.attn_qkv.weight",
    "ssm_gate": "blk.{i}.attn_gate.weight",
    "ssm_beta": "blk.{i}.ssm_beta.weight",
    "ssm_alpha": "blk.{i}.ssm_alpha.weight",
    "ssm_conv1d": "blk.{i}.ssm_conv1d.weight",
    "ssm_dt_bias": "blk.{i}.ssm_dt.bias",
    "ssm_a": "blk.{i}.ssm_a",
    "ssm_norm": "blk.{i}.ssm_norm.weight",
    "ssm_out": "blk.{i}.ssm_out.weight",
    # Mamba-2 (Granite 4.0 H): in_proj (z, x B C, dt), the conv's taps and bias, dt bias,
    # -exp(A_log) and D per head, the grouped gated norm's gain and out_proj (the conv
    # taps, dt bias, A and out_proj share the DeltaNet's names)
    "ssm_in": "blk.{i}.ssm_in.weight",
    "ssm_conv1d_bias": "blk.{i}.ssm_conv1d.bias",
    "ssm_d": "blk.{i}.ssm_d",
}
# A mixture-of-experts FFN's tensors (model/moe.py), read on the layers that have a router:
# the router [n_expert, d_model], the routed experts as 3-D tensors [n_expert, rows, cols]
# (each expert a 2-D view, formats/gguf.GGUFFile.expert_matrices), and where the family has
# one, the shared expert and its sigmoid gate [d_model] (Qwen2-MoE). Not LAYER_TENSORS roles:
# a dense spec (or a pack's stored one) need not name them.
EXPERT_TENSORS = {
    "ffn_gate_inp": "blk.{i}.ffn_gate_inp.weight",
    "ffn_gate_exps": "blk.{i}.ffn_gate_exps.weight",
    "ffn_up_exps": "blk.{i}.ffn_up_exps.weight",
    "ffn_down_exps": "blk.{i}.ffn_down_exps.weight",
    "ffn_gate_shexp": "blk.{i}.ffn_gate_shexp.weight",
    "ffn_up_shexp": "blk.{i}.ffn_up_shexp.weight",
    "ffn_down_shexp": "blk.{i}.ffn_down_shexp.weight",
    "ffn_gate_inp_shexp": "blk.{i}.ffn_gate_inp_shexp.weight",
    "exp_probs_b": "blk.{i}.exp_probs_b.bias",
    # Gemma 4 (experts_beside_mlp): gate and up of every expert in one tensor [n_expert,
    # 2 * expert_ff, d_model] (gate rows first), a scale per expert, the router's input gain
    # [d_model], and the norms around the MLP and the experts
    "ffn_gate_up_exps": "blk.{i}.ffn_gate_up_exps.weight",
    "ffn_down_exps_scale": "blk.{i}.ffn_down_exps.scale",
    "ffn_gate_inp_scale": "blk.{i}.ffn_gate_inp.scale",
    "ffn_pre_norm_2": "blk.{i}.pre_ffw_norm_2.weight",
    "ffn_post_norm_1": "blk.{i}.post_ffw_norm_1.weight",
    "ffn_post_norm_2": "blk.{i}.post_ffw_norm_2.weight",
}
GLOBAL_TENSORS = {
    "token_embd": "token_embd.weight",
    "output_norm": "output_norm.weight",
    "output": "output.weight",
    # optional: per-frequency RoPE divisors [rope_dim // 2] (Llama 3's rope scaling)
    "rope_freqs": "rope_freqs.weight",
    # LongRoPE's per-pair frequency factors (Phi-3), used when spec.rope_orig_context > 0
    "rope_factors_short": "rope_factors_short.weight",
    "rope_factors_long": "rope_factors_long.weight",
}
# Fused matrices some converters store (Phi-3's attn_qkv, Phi-3 / GLM-4's ffn_up holding
# gate then up): the fused tensor's name, and the roles its rows hold, in order. The GGUF
# reader splits them into those roles' tensors by rows (fused_splits), so everything past
# it (kernels, offloading, sessions) sees only the usual roles.
FUSED_TENSORS = {
    "attn_qkv": ("blk.{i}.attn_qkv.weight", ("attn_q", "attn_k", "attn_v")),
    "ffn_gate_up": ("blk.{i}.ffn_up.weight", ("ffn_gate", "ffn_up")),
}


@dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters plus the per-family switches model/layer.py honours."""

    arch: str
    name: str
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_base: float
    rope_dim: int
    # "interleaved": rotate (x[2i], x[2i+1]) (llama.cpp's NORM; GGUF permutes
    # llama q/k weights for it); "neox": rotate (x[i], x[i + d/2]).
    rope_style: str = "interleaved"
    activation: str = "silu"  # gated FFN: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    attn_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Gemma 3)
    post_norms: bool = False  # norm the attention / FFN outputs before the residual add
    embed_scale: float = 1.0  # token embeddings are multiplied by this (Gemma: sqrt(d))
    final_logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap) when > 0
    # per layer: sliding attention window in tokens (0 = global) and RoPE base;
    # empty means every layer is global with rope_base
    layer_windows: tuple[int, ...] = ()
    layer_rope_bases: tuple[float, ...] = ()
    # no RoPE on layers whose entry is True (SmolLM3's NoPE layers, EXAONE 4's global
    # layers); empty means every layer rotates
    layer_nope: tuple[bool, ...] = ()
    pre_norms: bool = True  # RMSNorm the input of each block (False: OLMo 2 / EXAONE 4)
    qk_norm_full: bool = False  # the q/k norm spans the whole projection, not each head
    attention_scale: float = 0.0  # the softmax scale of q.k; 0 means 1/sqrt(head_dim)
    residual_scale: float = 1.0  # each block's output is multiplied by this (Granite)
    logit_scale: float = 1.0  # logits are divided by this (Granite)
    # Gemma 2: attention scores (after their scale) -> cap * tanh(scores / cap) when > 0
    attn_softcap: float = 0.0
    # LongRoPE (Phi-3): > 0 is the trained context; a KV cache longer than it rotates with
    # the long factors, else the short ones; rope_attn_factor scales cos and sin
    rope_orig_context: int = 0
    rope_attn_factor: float = 1.0
    # every RoPE frequency is multiplied by this: linear rope scaling (1 / factor); with
    # YaRN, only the slow frequencies, through YaRN's ramp
    rope_scale: float = 1.0
    # YaRN (rope.scaling.type yarn): > 0 is the original context its ramp's correction
    # dims are computed from, with beta_fast / beta_slow; rope_attn_factor is then YaRN's
    # attention factor (ops/rope.rope_tables)
    yarn_orig_context: int = 0
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    # Llama 4 / Mistral 3 attention temperature, when attn_temp_scale > 0: q after RoPE
    # times 1 + attn_temp_scale * ln(1 + floor(position / attn_temp_floor))
    attn_temp_scale: float = 0.0
    attn_temp_floor: int = 0
    # FUSED_TENSORS kinds this family's files may store (split when the GGUF is read)
    fused_tensors: tuple[str, ...] = ()
    # the blocks' input norms and the output norm: "rms" (RMSNorm) or "layer" (LayerNorm
    # without bias, mean-centred: Cohere)
    norm_kind: str = "rms"
    # attention and FFN both read the layer's one normed input and both add to the
    # residual stream (Cohere): h += attn(x) + ffn(x), with no norm between
    parallel_blocks: bool = False
    # how an embedding pools the final hidden states of a text's tokens (model/embedding.py):
    # "last" (the token that saw the whole text: the default of every causal family here),
    # "mean", "cls" (the first token), or "rank" (a reranker's file, which embeds nothing)
    pooling: str = "last"
    # per layer: its token mixer, "attention" or a recurrent mixer (RECURRENT_MIXERS: a
    # per-sequence state instead of KV rows, model/state_cache.py); empty: every layer attends
    layer_mixers: tuple[str, ...] = ()
    # LFM2's short convolution: its width L (the state holds the last L - 1 inputs)
    shortconv_l_cache: int = 0
    # Qwen3.5's gated DeltaNet (layer_mixers "deltanet"): the conv width, the size of a
    # key / value head (ssm.state_size), the key heads (ssm.group_count) and the value
    # heads (ssm.time_step_rank), each value head reading key head h % ssm_k_heads
    ssm_conv_kernel: int = 0
    ssm_head_dim: int = 0
    ssm_k_heads: int = 0
    ssm_v_heads: int = 0
    # Mamba-2 (layer_mixers "mamba2"; its conv width is ssm_conv_kernel): mamba_heads
    # heads of mamba_head_dim channels (d_inner = heads x head_dim), each with a
    # [head_dim, mamba_state] state; B and C come in mamba_groups groups (head h reads
    # group h // (heads / groups)), which also split the gated norm
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_state: int = 0
    mamba_groups: int = 0
    # the q projection carries a gate per head after each head's q (Qwen3.5): the
    # attention context is multiplied by sigmoid(gate) before the output projection
    attn_output_gate: bool = False
    # mixture of experts (n_expert > 0): a layer with a router (EXPERT_TENSORS) routes each
    # row to its n_expert_used most probable of n_expert experts of width expert_ff, whose
    # softmax weights are renormalised to sum 1 where expert_norm, then multiplied by
    # expert_scale; a shared expert of width expert_shared_ff (0: none) adds to every row
    n_expert: int = 0
    n_expert_used: int = 0
    expert_ff: int = 0
    expert_shared_ff: int = 0
    expert_norm: bool = False
    expert_scale: float = 1.0
    # the router's probabilities: "softmax" over the experts, or "sigmoid" of each logit
    # (LFM2-MoE), the experts then picked by probability plus the layer's exp_probs_b bias
    # where the file has one (the weights stay the unbiased probabilities)
    expert_gating: str = "softmax"
    # the experts run beside the layer's dense MLP, not in its place (Gemma 4 26B-A4B):
    # the FFN block reads the residual stream itself; the MLP takes ffn_norm and its output
    # post_ffw_norm_1, the experts pre_ffw_norm_2 and post_ffw_norm_2, the router
    # RMSNorm(h) * ffn_gate_inp.scale / sqrt(d_model); the two outputs are summed
    experts_beside_mlp: bool = False
    # Per layer, where layers differ (Gemma 4); empty means every layer takes the spec-wide
    # value (head_dim, n_kv_heads, d_ff and rope_dim then hold the largest of them)
    layer_head_dims: tuple[int, ...] = ()
    layer_kv_heads: tuple[int, ...] = ()
    layer_d_ff: tuple[int, ...] = ()
    layer_rope_dims: tuple[int, ...] = ()
    # the layers whose RoPE divides by the file's rope_freqs (Gemma 4's proportional RoPE
    # on its full layers); empty: every layer, when the file has them
    layer_rope_freqs: tuple[bool, ...] = ()
    # KV shared across layers (Gemma 4): layer i attends to the keys and values layer
    # kv_source[i] stored and stores none of its own where that is another layer
    layer_kv_source: tuple[int, ...] = ()
    v_norm: bool = False  # v is RMSNormed (no gain) per head before it is cached (Gemma 4)
    # per-layer embeddings (Gemma 4's PLE): > 0 is each layer's width of them
    per_layer_input: int = 0
    layer_output_scale: bool = False  # each layer's output times its own scalar (Gemma 4)
    # Gemma 3n's AltUp (altup_inputs > 0): the residual stream is altup_inputs streams of
    # d_model; each layer predicts them all from each other, runs the active one
    # (altup_active) through attention and FFN, and corrects the others by what it did
    # (model/altup.py)
    altup_inputs: int = 0
    altup_active: int = 0
    laurel: bool = False  # a low-rank residual beside attention (Gemma 3n's Laurel block)
    # per layer: the FFN gate's activation sparsity as the standard deviations above its
    # mean where it is cut (Gemma 3n's gaussian top-k: relu(g - mean - std * this)); None
    # on a dense layer; empty: every layer dense
    layer_ffn_sparsity: tuple[float | None, ...] = ()
    layer_tensors: dict[str, str] = field(default_factory=lambda: dict(LAYER_TENSORS))
    global_tensors: dict[str, str] = field(default_factory=lambda: dict(GLOBAL_TENSORS))

    def layer_tensor(self, role: str, i: int) -> str:
        return self.layer_tensors[role].format(i=i)

    def expert_tensor(self, role: str, i: int) -> str:
        """Layer i's name of a mixture-of-experts role (EXPERT_TENSORS)."""
        return self.layer_tensors.get(role, EXPERT_TENSORS[role]).format(i=i)

    def window(self, i: int) -> int:
        return self.layer_windows[i] if self.layer_windows else 0

    def rope_base_of(self, i: int) -> float:
        return self.layer_rope_bases[i] if self.layer_rope_bases else self.rope_base

    def head_dim_of(self, i: int) -> int:
        return self.layer_head_dims[i] if self.layer_head_dims else self.head_dim

    def kv_heads_of(self, i: int) -> int:
        return self.layer_kv_heads[i] if self.layer_kv_heads else self.n_kv_heads

    def d_ff_of(self, i: int) -> int:
        return self.layer_d_ff[i] if self.layer_d_ff else self.d_ff

    def rope_dim_of(self, i: int) -> int:
        return self.layer_rope_dims[i] if self.layer_rope_dims else self.rope_dim

    def rope_freqs_of(self, i: int) -> bool:
        """Whether layer i's RoPE divides by the file's rope_freqs (when it has them)."""
        return self.layer_rope_freqs[i] if self.layer_rope_freqs else True

    def ffn_sparsity_of(self, i: int) -> float | None:
        """Layer i's FFN gate cutoff in standard deviations above the mean (None: dense)."""
        return self.layer_ffn_sparsity[i] if self.layer_ffn_sparsity else None

    def kv_source(self, i: int) -> int:
        """The layer whose keys and values layer i attends to (i: its own)."""
        return self.layer_kv_source[i] if self.layer_kv_source else i

    @property
    def layered(self) -> bool:
        """Whether layers differ in their attention's shape or share KV (per-layer head
        dims, KV heads, RoPE dims or KV sources): the KV cache then gives each layer a
        view of its own shape (model/kvcache.KVCache.layer)."""
        return bool(
            self.layer_head_dims or self.layer_kv_heads or self.layer_kv_source
            or self.layer_rope_dims
        )  # fmt: skip

    def rotates(self, i: int) -> bool:
        """Whether layer i applies RoPE to q and k."""
        return not (self.layer_nope and self.layer_nope[i])

    def query_scale(self, i: int | None = None) -> float:
        """The factor q is multiplied by after RoPE so that the attention kernels' fixed
        1/sqrt(head_dim) gives the spec's attention_scale (1.0 when it has none); i: of
        layer i's head_dim (where layers differ)."""
        if self.attention_scale == 0.0:
            return 1.0
        hd = self.head_dim if i is None else self.head_dim_of(i)
        return self.attention_scale * math.sqrt(hd)

    def attn_temperatures(self, positions: np.ndarray) -> np.ndarray:
        """The attention temperature q is multiplied by at each position, float32 (as
        llama.cpp's llm_graph_input_attn_temp: computed in double, stored as float)."""
        floors = np.floor(np.asarray(positions, np.float64) / self.attn_temp_floor)
        return (np.log(floors + 1.0) * self.attn_temp_scale + 1.0).astype(np.float32)

    def mixer(self, i: int) -> str:
        """Layer i's token mixer: "attention" or a RECURRENT_MIXERS kind."""
        return self.layer_mixers[i] if self.layer_mixers else "attention"

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers that attend (and so hold KV rows), in order."""
        return tuple(i for i in range(self.n_layers) if self.mixer(i) == "attention")

    @property
    def recurrent_layers(self) -> tuple[int, ...]:
        """The layers whose mixer keeps a per-sequence state instead of KV rows."""
        return tuple(i for i in range(self.n_layers) if self.mixer(i) != "attention")

    def kv_slot(self, i: int) -> int:
        """Attention layer i's index into the KV cache, which holds attention layers only."""
        if not self.layer_mixers:
            return i
        return self.layer_mixers[:i].count("attention")

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


# Bounds a real model stays far inside; a file beyond them is corrupt or hostile, and the
# numbers would otherwise size allocations (KV cache, RoPE tables) or index tensors.
_MAX_LAYERS = 4096
_MAX_WIDTH = 1 << 20  # d_model, d_ff
_MAX_HEADS = 4096
_MAX_HEAD_DIM = 4096
_MAX_VOCAB = 1 << 24
_MAX_CONTEXT = 1 << 24
_MAX_EXPERTS = 1 << 16
_ROPE_STYLES = ("interleaved", "neox")
_ACTIVATIONS = ("silu", "gelu_tanh")
_NORM_KINDS = ("rms", "layer")
# '<arch>.pooling_type' as llama.cpp writes it (gguf-py's PoolingType; convert_hf_to_gguf
# reads it from a sentence-transformers Pooling module); 0 (none) leaves the family's default
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last", 4: "rank"}
POOLINGS = ("last", "mean", "cls", "rank")
# token mixers that keep a per-sequence recurrent state (model/state_cache.STATE_SHAPES
# gives each one's arrays): LFM2's short convolution, Qwen3.5's gated DeltaNet, Mamba-2
RECURRENT_MIXERS = ("shortconv", "deltanet", "mamba2")
MIXERS = ("attention", *RECURRENT_MIXERS)


def _kind(value: Any) -> str:
    """What a metadata value is, for error messages (arrays by size, never in full)."""
    if isinstance(value, bool):
        return f"bool {value}"
    if isinstance(value, int | float):
        return f"{type(value).__name__} {value!r}"
    if isinstance(value, str):
        return f"str {value[:40]!r}"
    try:
        return f"an array of {len(value)} values"
    except TypeError:
        return type(value).__name__


def meta_int(
    meta: dict[str, Any],
    key: str,
    source: str,
    default: int | None = None,
    lo: int = 1,
    hi: int = _MAX_WIDTH,
) -> int:
    """An integer metadata field in [lo, hi]; missing -> default (an error when None).

    GGUF stores these as (u)int8..64: a float, bool, string or array there means the file
    is corrupt, and is refused rather than converted."""
    if key not in meta:
        if default is None:
            raise ModelFormatError(f"{source}: metadata field '{key}' is missing")
        return default
    value = meta[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be an integer, found {_kind(value)}"
        )
    if not lo <= value <= hi:
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be in {lo}..{hi}, found {value}"
        )
    return value


def meta_float(
    meta: dict[str, Any],
    key: str,
    source: str,
    default: float | None = None,
    lo: float = 0.0,
    hi: float = math.inf,
    lo_open: bool = True,
) -> float:
    """A finite float metadata field (GGUF f32/f64) in (lo, hi) (lo included unless lo_open).

    An integer there (a u8 where an f32 belongs) is refused: the writer got the key wrong."""
    if key not in meta:
        if default is None:
            raise ModelFormatError(f"{source}: metadata field '{key}' is missing")
        return default
    value = meta[key]
    if not isinstance(value, float):
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be a float (f32), found {_kind(value)}"
        )
    ok = math.isfinite(value) and (value > lo if lo_open else value >= lo) and value < hi
    if not ok:
        bound = f"> {lo}" if lo_open else f">= {lo}"
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be finite and {bound}, found {value!r}"
        )
    return value


def meta_str(meta: dict[str, Any], key: str, source: str, default: str | None = None) -> str:
    """A string metadata field; missing -> default (an error when None)."""
    if key not in meta:
        if default is None:
            raise ModelFormatError(f"{source}: metadata field '{key}' is missing")
        return default
    value = meta[key]
    if not isinstance(value, str):
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be a string, found {_kind(value)}"
        )
    return value


def meta_layer_pattern(
    meta: dict[str, Any], key: str, source: str, n_layers: int, period: int
) -> tuple[bool, ...]:
    """Which layers a per-layer pattern marks (llama.cpp's load_swa_pattern): an array of
    n_layers bools, or an integer period p marking every layer but each p-th
    (i % p < p - 1; 0 marks all); missing -> that rule with `period`."""
    value = meta.get(key, period)
    if isinstance(value, int) and not isinstance(value, bool):
        p = meta_int(meta, key, source, period, lo=0, hi=_MAX_LAYERS)
        return tuple(p == 0 or i % p < p - 1 for i in range(n_layers))
    try:
        ok = not isinstance(value, str) and len(value) == n_layers
    except TypeError:
        ok = False
    if not ok or not all(isinstance(v, bool | np.bool_) for v in value):
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be an integer period or an array of "
            f"{n_layers} bools (one per layer), found {_kind(value)}"
        )
    flags = [bool(v) for v in value]
    return tuple(flags)


def sliding_windows(
    meta: dict[str, Any], a: str, source: str, n_layers: int, period: int
) -> tuple[int, ...]:
    """Each layer's window from '<a>.attention.sliding_window' on the layers
    '<a>.attention.sliding_window_pattern' marks (meta_layer_pattern, default `period`);
    () when the file sets no window."""
    window = meta_int(meta, f"{a}.attention.sliding_window", source, 0, lo=0, hi=_MAX_CONTEXT)
    if not window:
        return ()
    pattern = meta_layer_pattern(
        meta, f"{a}.attention.sliding_window_pattern", source, n_layers, period
    )
    return tuple(window if sliding else 0 for sliding in pattern)


def rope_scaling(meta: dict[str, Any], a: str, source: str) -> float:
    """The RoPE frequency multiplier of '<a>.rope.scaling.type' / '.factor' (llama.cpp's
    rope_freq_scale: 1 / factor for linear scaling, 1 without). YaRN and LongRoPE with a
    factor other than 1 change more than the frequencies and are refused, not ignored."""
    kind = meta_str(meta, f"{a}.rope.scaling.type", source, "linear")
    key = f"{a}.rope.scaling.factor"
    if key not in meta:
        key = f"{a}.rope.scale_linear"  # the older name
    factor = meta_float(meta, key, source, 0.0, lo_open=False)
    if kind == "none" or factor in (0.0, 1.0):
        return 1.0
    if kind == "linear":
        return 1.0 / factor
    if kind in ("yarn", "longrope"):
        raise UnsupportedError(
            f"{source}: RoPE scaling '{kind}' (factor {factor}) is not supported for "
            f"architecture '{a}'"
        )
    raise ModelFormatError(
        f"{source}: metadata field '{a}.rope.scaling.type' should be none, linear, yarn or "
        f"longrope, found {kind[:40]!r}"
    )


def rope_scaling_yarn(meta: dict[str, Any], a: str, source: str) -> dict[str, Any]:
    """The spec fields of '<a>.rope.scaling.*' for a family whose RoPE takes YaRN as
    llama.cpp's ggml_rope_ext does: rope_scale alone for none / linear (rope_scaling),
    else rope_scale 1 / factor, the original context and betas, and the attention factor
    llama.cpp ends with (llama_context's yarn_attn_factor times rope_yarn's own
    1 + 0.1 ln(factor), which cancel but for the yarn_log_multiplier ratio, times
    '.rope.scaling.attn_factor')."""
    kind = meta_str(meta, f"{a}.rope.scaling.type", source, "linear")
    if kind != "yarn":
        return {"rope_scale": rope_scaling(meta, a, source)}
    factor = meta_float(meta, f"{a}.rope.scaling.factor", source, 0.0, lo_open=False)
    if factor == 0.0:  # llama.cpp: freq_scale 1, where YaRN's ramp and factor are no-ops
        return {"rope_scale": 1.0}
    context = meta_int(meta, f"{a}.context_length", source, 2048, hi=_MAX_CONTEXT)
    orig = meta_int(
        meta, f"{a}.rope.scaling.original_context_length", source, context, hi=_MAX_CONTEXT
    )
    log_mul = meta_float(
        meta, f"{a}.rope.scaling.yarn_log_multiplier", source, 0.0, lo_open=False, hi=1e3
    )

    def mscale(m: float) -> float:  # llama.cpp's get_mscale
        return 1.0 if factor <= 1.0 else 0.1 * m * math.log(factor) + 1.0

    attn = mscale(1.0) / mscale(log_mul) if log_mul else mscale(1.0)
    attn *= meta_float(meta, f"{a}.rope.scaling.attn_factor", source, 1.0, hi=1e3)
    return {
        "rope_scale": 1.0 / factor,
        "rope_attn_factor": attn,
        "yarn_orig_context": orig,
        "yarn_beta_fast": meta_float(
            meta, f"{a}.rope.scaling.yarn_beta_fast", source, 32.0, hi=1e6
        ),
        "yarn_beta_slow": meta_float(meta, f"{a}.rope.scaling.yarn_beta_slow", source, 1.0, hi=1e6),
    }


def common_fields(
    meta: dict[str, Any],
    a: str,
    source: str,
    norm_eps_key: str = "layer_norm_rms_epsilon",
    pooling: str = "last",
) -> dict[str, Any]:
    """Hyperparameters every family stores under the same '<arch>.' keys, type- and
    range-checked (the file is untrusted; these size every allocation). norm_eps_key:
    the norm epsilon's key under '<arch>.attention.' (LayerNorm families:
    'layer_norm_epsilon'); pooling: the family's embedding pooling where the file names
    none."""
    n_heads = meta_int(meta, f"{a}.attention.head_count", source, hi=_MAX_HEADS)
    d_model = meta_int(meta, f"{a}.embedding_length", source)
    n_kv = meta_int(meta, f"{a}.attention.head_count_kv", source, n_heads, hi=_MAX_HEADS)
    head_dim = meta_int(
        meta, f"{a}.attention.key_length", source, max(1, d_model // n_heads), hi=_MAX_HEAD_DIM
    )
    if n_heads % n_kv:
        raise ModelFormatError(
            f"{source}: head_count {n_heads} must be a positive multiple of head_count_kv {n_kv}"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if tokens is not None and not isinstance(tokens, str | int) else 0
    vocab = meta_int(meta, f"{a}.vocab_size", source, n_tokens or -1, lo=-1, hi=_MAX_VOCAB)
    if vocab <= 0:
        raise ModelFormatError(
            f"{source}: cannot tell the vocabulary size (no '{a}.vocab_size' and no "
            "'tokenizer.ggml.tokens')"
        )
    return dict(
        arch=a,
        name=meta_str(meta, "general.name", source, a),
        n_layers=meta_int(meta, f"{a}.block_count", source, hi=_MAX_LAYERS),
        d_model=d_model,
        d_ff=meta_int(meta, f"{a}.feed_forward_length", source),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        context_length=meta_int(meta, f"{a}.context_length", source, 2048, hi=_MAX_CONTEXT),
        norm_eps=meta_float(meta, f"{a}.attention.{norm_eps_key}", source, hi=1.0),
        rope_base=meta_float(meta, f"{a}.rope.freq_base", source, 10000.0),
        rope_dim=meta_int(meta, f"{a}.rope.dimension_count", source, head_dim, hi=head_dim),
        pooling=meta_pooling(meta, a, source, pooling),
    )


def meta_pooling(meta: dict[str, Any], a: str, source: str, default: str) -> str:
    """The embedding pooling '<arch>.pooling_type' names (POOLING_TYPES); missing or 0
    (none): default."""
    code = meta_int(meta, f"{a}.pooling_type", source, 0, lo=0, hi=max(POOLING_TYPES))
    return POOLING_TYPES.get(code, default)


def require(meta: dict[str, Any], key: str, source: str, kind: type = int) -> Any:
    """A metadata field that must be present and of type ``kind`` (int, float or str)."""
    if kind is float:
        return meta_float(meta, key, source, lo=-math.inf)
    if kind is str:
        return meta_str(meta, key, source)
    return meta_int(meta, key, source, lo=-(1 << 63), hi=(1 << 64) - 1)


def validate_spec(spec: ModelSpec, source: str) -> ModelSpec:
    """Check a spec's numbers and names, wherever it came from (GGUF metadata, a pack's
    JSON): positive sizes in range, consistent heads, finite floats, known switches, and
    tensor-name patterns that can only format the layer index."""

    def bad(field_: str, expected: str, found: Any) -> ModelFormatError:
        return ModelFormatError(
            f"{source}: spec field '{field_}' should be {expected}, found {found!r}"
        )

    limits = {
        "n_layers": _MAX_LAYERS,
        "d_model": _MAX_WIDTH,
        "d_ff": _MAX_WIDTH,
        "n_heads": _MAX_HEADS,
        "n_kv_heads": _MAX_HEADS,
        "head_dim": _MAX_HEAD_DIM,
        "vocab_size": _MAX_VOCAB,
        "context_length": _MAX_CONTEXT,
        "rope_dim": _MAX_HEAD_DIM,
    }
    for name, hi in limits.items():
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise bad(name, f"an integer in 1..{hi}", v)
    if spec.n_heads % spec.n_kv_heads:
        raise bad("n_kv_heads", f"a divisor of n_heads {spec.n_heads}", spec.n_kv_heads)
    if spec.rope_dim > spec.head_dim or spec.rope_dim % 2:
        raise bad("rope_dim", f"even and at most head_dim {spec.head_dim}", spec.rope_dim)
    for name, lo, lo_open, hi in (
        ("norm_eps", 0.0, True, 1.0),
        ("rope_base", 0.0, True, math.inf),
        ("embed_scale", 0.0, True, math.inf),
        ("final_logit_softcap", 0.0, False, math.inf),
        ("attention_scale", 0.0, False, math.inf),
        ("residual_scale", 0.0, True, math.inf),
        ("logit_scale", 0.0, True, math.inf),
        ("attn_softcap", 0.0, False, math.inf),
        ("rope_attn_factor", 0.0, True, 1e3),
        ("rope_scale", 0.0, True, math.inf),
        ("yarn_beta_fast", 0.0, True, math.inf),
        ("yarn_beta_slow", 0.0, True, math.inf),
        ("attn_temp_scale", 0.0, False, 1e3),
        ("expert_scale", 0.0, True, 1e6),
    ):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise bad(name, "a number", v)
        if not (math.isfinite(v) and (v > lo if lo_open else v >= lo) and v < hi):
            raise bad(name, f"finite and {'>' if lo_open else '>='} {lo}", v)
    for name in ("rope_orig_context", "yarn_orig_context", "attn_temp_floor"):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= _MAX_CONTEXT:
            raise bad(name, f"an integer in 0..{_MAX_CONTEXT}", v)
    check_experts(spec, bad)
    if spec.yarn_orig_context and spec.rope_orig_context:
        raise bad(
            "yarn_orig_context", "0 with LongRoPE (rope_orig_context > 0)", spec.yarn_orig_context
        )
    if spec.yarn_orig_context and 1.0 in (spec.rope_base, *spec.layer_rope_bases):
        # the ramp's correction dimensions divide by ln(base)
        raise bad("rope_base", "other than 1 with YaRN", 1.0)
    if spec.attn_temp_scale and not spec.attn_temp_floor:
        raise bad("attn_temp_floor", "> 0 with an attention temperature", spec.attn_temp_floor)
    if not isinstance(spec.fused_tensors, tuple) or any(
        k not in FUSED_TENSORS for k in spec.fused_tensors
    ):
        raise bad("fused_tensors", f"a tuple of {', '.join(FUSED_TENSORS)}", spec.fused_tensors)
    if spec.rope_style not in _ROPE_STYLES:
        raise bad("rope_style", " or ".join(_ROPE_STYLES), spec.rope_style)
    if spec.norm_kind not in _NORM_KINDS:
        raise bad("norm_kind", " or ".join(_NORM_KINDS), spec.norm_kind)
    # LayerNorm and parallel blocks come as Cohere has them: pre-norms only, no residual
    # scale (their fused kernels, token_step.add_layernormed / add_rows, take neither)
    for name, on in (
        ("norm_kind", spec.norm_kind == "layer"),
        ("parallel_blocks", spec.parallel_blocks),
    ):
        if on and (spec.post_norms or not spec.pre_norms or spec.residual_scale != 1.0):
            raise bad(
                name,
                "used with pre-norms only (no post_norms, pre_norms true, residual_scale 1)",
                getattr(spec, name),
            )
    if spec.pooling not in POOLINGS:
        raise bad("pooling", " or ".join(POOLINGS), spec.pooling)
    if spec.activation not in _ACTIVATIONS:
        raise bad("activation", " or ".join(_ACTIVATIONS), spec.activation)
    for name in (
        "pre_norms",
        "qk_norm_full",
        "attn_bias",
        "qk_norm",
        "post_norms",
        "parallel_blocks",
        "attn_output_gate",
        "expert_norm",
    ):
        if not isinstance(getattr(spec, name), bool):
            raise bad(name, "true or false", getattr(spec, name))
    _validate_layered(spec, bad)
    for name in ("layer_windows", "layer_rope_bases", "layer_nope", "layer_mixers"):
        v = getattr(spec, name)
        if len(v) not in (0, spec.n_layers):
            raise bad(name, f"empty or {spec.n_layers} entries (one per layer)", f"{len(v)}")
    for w in spec.layer_windows:
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w <= _MAX_CONTEXT:
            raise bad("layer_windows", f"integers in 0..{_MAX_CONTEXT}", w)
    for flag in spec.layer_nope:
        if not isinstance(flag, bool):
            raise bad("layer_nope", "true or false per layer", flag)
    for m in spec.layer_mixers:
        if m not in MIXERS:
            raise bad("layer_mixers", f"one of {', '.join(MIXERS)} per layer", m)
    sc = spec.shortconv_l_cache
    if isinstance(sc, bool) or not isinstance(sc, int) or not 0 <= sc <= 64:
        raise bad("shortconv_l_cache", "an integer in 0..64", sc)
    if "shortconv" in spec.layer_mixers and sc < 2:
        raise bad("shortconv_l_cache", "at least 2 with shortconv layers", sc)
    _validate_deltanet(spec, bad)
    _validate_mamba2(spec, bad)
    for b in spec.layer_rope_bases:
        if not isinstance(b, float) or not math.isfinite(b) or b <= 0:
            raise bad("layer_rope_bases", "finite floats > 0", b)
    for name, want in (("layer_tensors", LAYER_TENSORS), ("global_tensors", GLOBAL_TENSORS)):
        table = getattr(spec, name)
        missing = [role for role in want if role not in table]
        if missing:
            raise bad(name, f"a name for every role (missing '{missing[0]}')", sorted(table))
        for role, pattern in table.items():
            # str.format would otherwise run attribute lookups or huge paddings from the file
            if (
                not isinstance(pattern, str)
                or not 0 < len(pattern) <= 256
                or "{" in pattern.replace("{i}", "")
                or "}" in pattern.replace("{i}", "")
            ):
                raise bad(
                    f"{name}.{role}",
                    "a tensor name of at most 256 characters whose only placeholder is {i}",
                    pattern,
                )
    return spec


def _validate_deltanet(spec: ModelSpec, bad: Callable[..., ModelFormatError]) -> None:
    """The gated DeltaNet sizes: integers in range; with deltanet layers, a conv of 2..64
    taps, heads of a multiple of 16 values (the kernels' lane groups) and value heads a
    multiple of the key heads."""
    for name, hi in (
        ("ssm_conv_kernel", 64),
        ("ssm_head_dim", _MAX_HEAD_DIM),
        ("ssm_k_heads", _MAX_HEADS),
        ("ssm_v_heads", _MAX_HEADS),
    ):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            raise bad(name, f"an integer in 0..{hi}", v)
    if "deltanet" not in spec.layer_mixers:
        return
    if spec.ssm_conv_kernel < 2:
        raise bad("ssm_conv_kernel", "at least 2 with deltanet layers", spec.ssm_conv_kernel)
    if spec.ssm_head_dim < 16 or spec.ssm_head_dim % 16:
        raise bad("ssm_head_dim", "a positive multiple of 16 with deltanet layers",
                  spec.ssm_head_dim)  # fmt: skip
    if spec.ssm_k_heads < 1 or spec.ssm_v_heads < 1 or spec.ssm_v_heads % spec.ssm_k_heads:
        raise bad(
            "ssm_v_heads",
            f"a positive multiple of ssm_k_heads {spec.ssm_k_heads} with deltanet layers",
            spec.ssm_v_heads,
        )


def _validate_mamba2(spec: ModelSpec, bad: Callable[..., ModelFormatError]) -> None:
    """The Mamba-2 sizes: integers in range; with mamba2 layers, a conv of 2..64 taps,
    positive sizes and heads a multiple of the groups."""
    for name, hi in (
        ("mamba_heads", _MAX_HEADS),
        ("mamba_head_dim", _MAX_HEAD_DIM),
        ("mamba_state", _MAX_HEAD_DIM),
        ("mamba_groups", _MAX_HEADS),
    ):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            raise bad(name, f"an integer in 0..{hi}", v)
    if "mamba2" not in spec.layer_mixers:
        return
    if not 2 <= spec.ssm_conv_kernel <= 64:
        raise bad("ssm_conv_kernel", "in 2..64 with mamba2 layers", spec.ssm_conv_kernel)
    for name in ("mamba_heads", "mamba_head_dim", "mamba_state", "mamba_groups"):
        if getattr(spec, name) < 1:
            raise bad(name, "at least 1 with mamba2 layers", getattr(spec, name))
    if spec.mamba_heads % spec.mamba_groups:
        raise bad(
            "mamba_heads",
            f"a multiple of mamba_groups {spec.mamba_groups} with mamba2 layers",
            spec.mamba_heads,
        )


def check_experts(spec: ModelSpec, bad) -> None:
    """The mixture-of-experts fields: all 0 (dense), or 1 <= n_expert_used <= n_expert with
    an expert width; bad(field, expected, found) makes the error."""
    for name, hi in (
        ("n_expert", _MAX_EXPERTS),
        ("n_expert_used", _MAX_EXPERTS),
        ("expert_ff", _MAX_WIDTH),
        ("expert_shared_ff", _MAX_WIDTH),
    ):
        v = getattr(spec, name)
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= hi:
            raise bad(name, f"an integer in 0..{hi}", v)
    if spec.n_expert == 0:
        for name in ("n_expert_used", "expert_ff", "expert_shared_ff"):
            if getattr(spec, name):
                raise bad(name, "0 without experts (n_expert 0)", getattr(spec, name))
        return
    if not 1 <= spec.n_expert_used <= spec.n_expert:
        raise bad("n_expert_used", f"in 1..n_expert {spec.n_expert}", spec.n_expert_used)
    if spec.expert_ff == 0:
        raise bad("expert_ff", "> 0 with experts", spec.expert_ff)
    if spec.expert_gating not in EXPERT_GATINGS.values():
        raise bad("expert_gating", " or ".join(EXPERT_GATINGS.values()), spec.expert_gating)


# '<arch>.expert_gating_func' values (llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_*) -> gating
EXPERT_GATINGS = {1: "softmax", 2: "sigmoid"}


def moe_fields(meta: dict[str, Any], a: str, source: str, norm: bool) -> dict[str, Any]:
    """A mixture-of-experts family's spec fields from '<a>.expert_count',
    '.expert_used_count', '.expert_shared_feed_forward_length'
    (absent: no shared expert), '.expert_feed_forward_length' (absent: the dense width over
    the experts used, as llama.cpp), '.expert_weights_norm' (absent: the family's rule `norm`,
    as llama.cpp builds it) and '.expert_weights_scale' (absent or 0: 1)."""
    n_expert = meta_int(meta, f"{a}.expert_count", source, hi=_MAX_EXPERTS)
    used = meta_int(meta, f"{a}.expert_used_count", source, hi=n_expert)
    key = f"{a}.expert_weights_norm"
    if key in meta and not isinstance(meta[key], bool):
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be a bool, found {_kind(meta[key])}"
        )
    scale = meta_float(meta, f"{a}.expert_weights_scale", source, 0.0, lo_open=False, hi=1e6)
    return dict(
        n_expert=n_expert,
        n_expert_used=used,
        expert_ff=meta_int(
            meta,
            f"{a}.expert_feed_forward_length",
            source,
            max(1, meta_int(meta, f"{a}.feed_forward_length", source, used) // used),
        ),
        expert_shared_ff=meta_int(meta, f"{a}.expert_shared_feed_forward_length", source, 0, lo=0),
        expert_norm=bool(meta.get(key, norm)),
        expert_scale=scale or 1.0,
        expert_gating=_expert_gating(meta, a, source),
    )


def _expert_gating(meta: dict[str, Any], a: str, source: str) -> str:
    """'<a>.expert_gating_func' as a gating name (absent: softmax)."""
    key = f"{a}.expert_gating_func"
    if key not in meta:
        return "softmax"
    v = meta[key]
    if isinstance(v, bool) or not isinstance(v, int) or v not in EXPERT_GATINGS:
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be one of {sorted(EXPERT_GATINGS)} "
            f"({', '.join(EXPERT_GATINGS.values())}), found {v!r}"
        )
    return EXPERT_GATINGS[v]


def _validate_layered(spec: ModelSpec, bad: Callable[[str, str, Any], Exception]) -> None:
    """The per-layer fields (Gemma 4): one entry per layer or none, each within the
    spec-wide size (which the buffers and the KV cache are sized by), and KV sources that
    are earlier layers storing their own."""
    n = spec.n_layers
    for name, top in (
        ("layer_head_dims", spec.head_dim),
        ("layer_kv_heads", spec.n_kv_heads),
        ("layer_d_ff", spec.d_ff),
        ("layer_rope_dims", spec.head_dim),
        ("layer_kv_source", n - 1),
    ):
        v = getattr(spec, name)
        if len(v) not in (0, n):
            raise bad(name, f"empty or {n} entries (one per layer)", f"{len(v)}")
        lo = 0 if name == "layer_kv_source" else 1
        for x in v:
            if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= top:
                raise bad(name, f"integers in {lo}..{top}", x)
    if len(spec.layer_rope_freqs) not in (0, n):
        raise bad("layer_rope_freqs", f"empty or {n} entries", len(spec.layer_rope_freqs))
    for i in range(n):
        hd, kvh = spec.head_dim_of(i), spec.kv_heads_of(i)
        if spec.n_heads % kvh:
            raise bad("layer_kv_heads", f"divisors of n_heads {spec.n_heads}", kvh)
        if spec.rope_dim_of(i) > hd or spec.rope_dim_of(i) % 2:
            raise bad("layer_rope_dims", f"even and at most layer {i}'s head_dim {hd}",
                      spec.rope_dim_of(i))  # fmt: skip
        src = spec.kv_source(i)
        if src != i and (
            src > i
            or spec.kv_source(src) != src
            or (spec.head_dim_of(src), spec.kv_heads_of(src)) != (hd, kvh)
        ):
            raise bad(
                "layer_kv_source",
                f"for layer {i}, an earlier layer of its head shape that stores its own KV",
                src,
            )
    for name in ("v_norm", "layer_output_scale"):
        if not isinstance(getattr(spec, name), bool):
            raise bad(name, "true or false", getattr(spec, name))
    ple = spec.per_layer_input
    if isinstance(ple, bool) or not isinstance(ple, int) or not 0 <= ple <= _MAX_WIDTH:
        raise bad("per_layer_input", f"an integer in 0..{_MAX_WIDTH}", ple)
    a = spec.altup_inputs
    if isinstance(a, bool) or not isinstance(a, int) or a not in (0, *range(2, 17)):
        raise bad("altup_inputs", "0 or an integer in 2..16", a)
    act = spec.altup_active
    if isinstance(act, bool) or not isinstance(act, int) or not 0 <= act < max(a, 1):
        raise bad("altup_active", f"an integer in 0..{max(a, 1) - 1}", act)
    if not isinstance(spec.laurel, bool) or (spec.laurel and not a):
        raise bad("laurel", "true or false (true only with AltUp streams)", spec.laurel)
    if len(spec.layer_ffn_sparsity) not in (0, n):
        raise bad("layer_ffn_sparsity", f"empty or {n} entries", len(spec.layer_ffn_sparsity))
    for m in spec.layer_ffn_sparsity:
        if m is not None and (
            isinstance(m, bool) or not isinstance(m, float) or not math.isfinite(m)
        ):
            raise bad("layer_ffn_sparsity", "finite floats or None per layer", m)


def role_rows(spec: ModelSpec, role: str) -> int:
    """The rows of a layer matrix role that a fused tensor holds."""
    return {
        "attn_q": spec.q_dim,
        "attn_k": spec.kv_dim,
        "attn_v": spec.kv_dim,
        "ffn_gate": spec.d_ff,
        "ffn_up": spec.d_ff,
    }[role]


def fused_splits(spec: ModelSpec) -> list[tuple[str, list[tuple[str, int]]]]:
    """For each fused tensor this spec's files may hold: its name and the (tensor name,
    rows) parts it splits into, in row order (one entry per layer and fused kind)."""
    out = []
    for kind in spec.fused_tensors:
        pattern, roles = FUSED_TENSORS[kind]
        for i in range(spec.n_layers):
            parts = [(spec.layer_tensor(r, i), role_rows(spec, r)) for r in roles]
            out.append((pattern.format(i=i), parts))
    return out
