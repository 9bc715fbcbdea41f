"""Phi-3 / Phi-3.5 / Phi-4-mini: llama's layer with fused q/k/v and gate+up matrices,
partial rotary (rope.dimension_count < head_dim), NeoX RoPE, LongRoPE and an optional
sliding window on every layer.

The converter stores q/k/v as one `attn_qkv` and gate+up as one `ffn_up` (gate rows
first); the GGUF reader splits both by rows into the usual roles (arch.spec's
FUSED_TENSORS). LongRoPE: files with `rope.scaling.attn_factor` carry short and long
per-pair frequency factors; as llama.cpp, a KV cache longer than
`rope.scaling.original_context_length` rotates with the long ones, and cos/sin are
multiplied by the attention factor. The window is honoured as transformers does
(llama.cpp currently ignores Phi's); 0 or absent means none.
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, meta_float, meta_int, rope_scaling

FUSED = ("attn_qkv", "ffn_gate_up")


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "phi3"
    fields = common_fields(meta, a, source)
    window = meta_int(meta, f"{a}.attention.sliding_window", source, 0, lo=0, hi=1 << 24)
    orig, attn_factor = 0, 1.0
    if f"{a}.rope.scaling.attn_factor" in meta:  # written with the LongRoPE factors only
        attn_factor = meta_float(meta, f"{a}.rope.scaling.attn_factor", source, hi=1e3)
        orig = meta_int(meta, f"{a}.rope.scaling.original_context_length", source, hi=1 << 24)
    return ModelSpec(
        **fields,
        rope_scale=rope_scaling(meta, a, source),
        rope_style="neox",
        fused_tensors=FUSED,
        layer_windows=(window,) * fields["n_layers"] if window else (),
        rope_orig_context=orig,
        rope_attn_factor=attn_factor,
    )
