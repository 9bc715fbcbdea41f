"""Qwen 3 (dense): llama with per-head q/k RMSNorm before RoPE, no biases, NeoX RoPE."""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, rope_scaling


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "qwen3"
    return ModelSpec(
        **common_fields(meta, a, source),
        rope_style="neox",
        qk_norm=True,
        rope_scale=rope_scaling(meta, a, source),
    )
