"""Qwen 1.5 / 2 MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen 2's attention (q/k/v biases,
NeoX RoPE) with a mixture-of-experts FFN: a softmax router's top n_expert_used experts,
their weights not renormalised, plus a shared expert on every row scaled by
sigmoid(ffn_gate_inp_shexp . x) (llama.cpp's qwen2moe graph)."""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, moe_fields, rope_scaling


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "qwen2moe"
    return ModelSpec(
        **common_fields(meta, a, source),
        **moe_fields(meta, a, source, norm=False),
        rope_style="neox",
        attn_bias=True,
        rope_scale=rope_scaling(meta, a, source),
    )
