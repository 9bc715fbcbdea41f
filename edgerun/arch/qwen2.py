"""Qwen 2 / 2.5: llama with q/k/v biases, NeoX RoPE, usually an untied output."""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    return ModelSpec(**common_fields(meta, "qwen2", source), rope_style="neox", attn_bias=True)
