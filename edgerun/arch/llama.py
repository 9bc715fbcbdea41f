"""Llama family (Llama 2/3, SmolLM, TinyLlama, Mistral without SWA).

GGUF converters permute llama q/k weights so that RoPE rotates adjacent
pairs (llama.cpp's NORM mode); hence rope_style "interleaved".
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    return ModelSpec(**common_fields(meta, "llama", source), rope_style="interleaved")
