"""IBM Granite (3.x dense): llama with four multipliers. Embeddings are multiplied by
`embedding_scale`, q.k by `attention.scale` (instead of 1/sqrt(head_dim)), each block's
output by `residual_scale` before its residual add, and the logits divided by
`logit_scale` (llama.cpp requires the last; the others default to no change)."""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, meta_float, rope_scaling


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "granite"
    return ModelSpec(
        **common_fields(meta, a, source),
        rope_scale=rope_scaling(meta, a, source),
        rope_style="interleaved",
        embed_scale=meta_float(meta, f"{a}.embedding_scale", source, 1.0),
        attention_scale=meta_float(meta, f"{a}.attention.scale", source, 0.0, lo_open=False),
        residual_scale=meta_float(meta, f"{a}.residual_scale", source, 1.0),
        logit_scale=meta_float(meta, f"{a}.logit_scale", source),
    )
