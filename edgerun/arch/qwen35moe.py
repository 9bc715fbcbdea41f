"""Qwen 3.5 MoE (Qwen3.5-35B-A3B, ...): Qwen 3.5's layers (gated DeltaNet layers with a
full-attention layer every few: arch/qwen35.py) with a mixture-of-experts FFN on every
layer: a softmax router picks the top n_expert_used experts of each row and renormalises
their weights to sum 1, and a shared expert behind a sigmoid gate adds to every row
(llama.cpp's qwen35moe graph; transformers' Qwen3_5MoeSparseMoeBlock)."""

from __future__ import annotations

from typing import Any

from edgerun.arch.qwen35 import hybrid_fields
from edgerun.arch.spec import ModelSpec, moe_fields


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "qwen35moe"
    return ModelSpec(**hybrid_fields(meta, a, source), **moe_fields(meta, a, source, norm=True))
