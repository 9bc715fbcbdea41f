"""Qwen 3 MoE (Qwen3-30B-A3B, ...): Qwen 3's attention (per-head q/k RMSNorm, NeoX RoPE, no
biases) with a mixture-of-experts FFN on every layer: a softmax router picks the top
n_expert_used experts of each row and renormalises their weights to sum 1 (llama.cpp's
qwen3moe graph; transformers' norm_topk_prob, true in the released models)."""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, moe_fields, rope_scaling


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "qwen3moe"
    return ModelSpec(
        **common_fields(meta, a, source),
        **moe_fields(meta, a, source, norm=True),
        rope_style="neox",
        qk_norm=True,
        rope_scale=rope_scaling(meta, a, source),
    )
