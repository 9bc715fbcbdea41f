"""Qwen 3.5 (dense): gated DeltaNet layers (model/deltanet.py) with a full-attention layer
every few (the file's '.attention.recurrent_layers', else every
'.full_attention_interval'-th). Attention layers: per-head q/k RMSNorm, an output gate
carried by the q projection (o = attention * sigmoid(gate)), NeoX RoPE over the first
rope_dim dims of each head. Every layer: norm, mixer, residual; norm
('post_attention_norm'), SwiGLU FFN, residual.

RoPE: Qwen3.5 rotates by multi-section (interleaved M-RoPE) positions; for text all of a
token's sections hold its position, so each frequency turns by that one position and the
sections collapse to ordinary RoPE over rope_dim (transformers' Qwen3_5TextRotaryEmbedding
with equal position ids; llama.cpp's ggml_rope_multi with the same position in each).

Norms: transformers' Qwen3_5RMSNorm multiplies by 1 + w; llama.cpp's converter stores
1 + w, so the file's gains are plain RMSNorm gains (the DeltaNet's gated norm, stored as
is, multiplies by w)."""

from __future__ import annotations

from typing import Any

import numpy as np

from edgerun.arch.spec import LAYER_TENSORS, ModelSpec, common_fields, meta_int, rope_scaling
from edgerun.errors import ModelFormatError


def layer_mixers(meta: dict[str, Any], a: str, source: str) -> tuple[str, ...]:
    """Each layer's mixer: 'deltanet' where '<a>.attention.recurrent_layers' marks the layer,
    else 'attention' (llama.cpp's rule without the array: every layer but each
    '<a>.full_attention_interval'-th, default 4, is recurrent)."""
    n_layers = meta_int(meta, f"{a}.block_count", source, hi=4096)
    key = f"{a}.attention.recurrent_layers"
    if key in meta:
        value = meta[key]
        try:
            recurrent = tuple(bool(v) for v in value if isinstance(v, bool | np.bool_))
            ok = not isinstance(value, str) and len(recurrent) == len(value) == n_layers
        except TypeError:
            ok = False
        if not ok:
            raise ModelFormatError(
                f"{source}: metadata field '{key}' should be an array of {n_layers} bools "
                "(one per layer, true for a recurrent layer)"
            )
    else:
        every = meta_int(meta, f"{a}.full_attention_interval", source, 4, hi=4096)
        recurrent = tuple((i + 1) % every != 0 for i in range(n_layers))
    return tuple("deltanet" if r else "attention" for r in recurrent)


def hybrid_fields(meta: dict[str, Any], a: str, source: str) -> dict[str, Any]:
    """The spec fields Qwen3.5's layers share, dense or MoE ('<a>.' keys): the common
    ones, the layer mixers, the DeltaNet sizes, gated attention with q/k norms and NeoX
    RoPE, and the FFN norm's name."""
    mixers = layer_mixers(meta, a, source)
    head_k = meta_int(meta, f"{a}.ssm.state_size", source, hi=4096)
    k_heads = meta_int(meta, f"{a}.ssm.group_count", source, hi=4096)
    v_heads = meta_int(meta, f"{a}.ssm.time_step_rank", source, hi=4096)
    inner = meta_int(meta, f"{a}.ssm.inner_size", source)
    if inner != v_heads * head_k:
        raise ModelFormatError(
            f"{source}: metadata field '{a}.ssm.inner_size' should be time_step_rank x "
            f"state_size = {v_heads * head_k} (value heads as wide as key heads), found {inner}"
        )
    return dict(
        **common_fields(meta, a, source),
        rope_style="neox",
        qk_norm=True,
        rope_scale=rope_scaling(meta, a, source),
        layer_mixers=mixers,
        ssm_conv_kernel=meta_int(meta, f"{a}.ssm.conv_kernel", source, lo=2, hi=64),
        ssm_head_dim=head_k,
        ssm_k_heads=k_heads,
        ssm_v_heads=v_heads,
        attn_output_gate=True,
        # the FFN's input norm is stored under the post-attention name
        layer_tensors=dict(LAYER_TENSORS, ffn_norm="blk.{i}.post_attention_norm.weight"),
    )


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    return ModelSpec(**hybrid_fields(meta, "qwen35", source))
