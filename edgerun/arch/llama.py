"""Llama family (Llama 2/3, SmolLM, TinyLlama, Mistral without SWA)."""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, require
from edgerun.errors import ModelFormatError


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "llama"
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
    return ModelSpec(
        arch=a,
        name=str(meta.get("general.name", "llama")),
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
        rope_style="interleaved",
        activation="silu",
    )
