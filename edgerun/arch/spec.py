"""ModelSpec: everything the forward pass needs to know about a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgerun.errors import ModelFormatError

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
}
GLOBAL_TENSORS = {
    "token_embd": "token_embd.weight",
    "output_norm": "output_norm.weight",
    "output": "output.weight",
}


@dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters plus the per-family switches model.py obeys."""

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
    layer_tensors: dict[str, str] = field(default_factory=lambda: dict(LAYER_TENSORS))
    global_tensors: dict[str, str] = field(default_factory=lambda: dict(GLOBAL_TENSORS))

    def layer_tensor(self, role: str, i: int) -> str:
        return self.layer_tensors[role].format(i=i)

    def window(self, i: int) -> int:
        return self.layer_windows[i] if self.layer_windows else 0

    def rope_base_of(self, i: int) -> float:
        return self.layer_rope_bases[i] if self.layer_rope_bases else self.rope_base

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def common_fields(meta: dict[str, Any], a: str, source: str) -> dict[str, Any]:
    """Hyperparameters every family stores under the same '<arch>.' keys."""
    n_heads = require(meta, f"{a}.attention.head_count", source)
    d_model = require(meta, f"{a}.embedding_length", source)
    n_kv = int(meta.get(f"{a}.attention.head_count_kv", n_heads))
    head_dim = int(meta.get(f"{a}.attention.key_length", d_model // n_heads))
    if n_heads <= 0 or n_kv <= 0 or n_heads % n_kv:
        raise ModelFormatError(
            f"{source}: head_count {n_heads} must be a positive multiple of head_count_kv {n_kv}"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    vocab = int(meta.get(f"{a}.vocab_size", len(tokens) if tokens else 0))
    if vocab <= 0:
        raise ModelFormatError(f"{source}: cannot tell the vocabulary size")
    return dict(
        arch=a,
        name=str(meta.get("general.name", a)),
        n_layers=require(meta, f"{a}.block_count", source),
        d_model=d_model,
        d_ff=require(meta, f"{a}.feed_forward_length", source),
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        vocab_size=vocab,
        context_length=int(meta.get(f"{a}.context_length", 2048)),
        norm_eps=require(meta, f"{a}.attention.layer_norm_rms_epsilon", source, float),
        rope_base=float(meta.get(f"{a}.rope.freq_base", 10000.0)),
        rope_dim=int(meta.get(f"{a}.rope.dimension_count", head_dim)),
    )


def require(meta: dict[str, Any], key: str, source: str, kind: type = int) -> Any:
    """A metadata field that must be present, with a clear error if it is not."""
    if key not in meta:
        raise ModelFormatError(f"{source}: metadata field '{key}' is missing")
    value = meta[key]
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be {kind.__name__}, found {value!r}"
        ) from None
