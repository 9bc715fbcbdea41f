"""Mistral 3 (Ministral 3, Mistral Small 3.x text models).

Llama's blocks (interleaved RoPE, q/k/v/o without norms, SwiGLU, optional rope_freqs,
biases and tied output as every family reads them), with YaRN rope scaling
(spec.rope_scaling_yarn, as llama.cpp's graph runs it) and Llama 4's attention
temperature: q after RoPE times 1 + temperature_scale * ln(1 + floor(position /
original context)), which llama.cpp turns on when '<a>.attention.temperature_scale' is
non-zero, its floor being YaRN's original context length (llama.cpp's n_ctx_orig_yarn).
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, meta_float, meta_int, rope_scaling_yarn


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "mistral3"
    fields = common_fields(meta, a, source)
    rope = rope_scaling_yarn(meta, a, source)
    temp_key = f"{a}.attention.temperature_scale"
    temp = meta_float(meta, temp_key, source, 0.0, lo_open=False, hi=1e3)
    floor = 0
    if temp:  # llama.cpp's n_ctx_orig_yarn, whatever the rope scaling
        floor = meta_int(
            meta,
            f"{a}.rope.scaling.original_context_length",
            source,
            fields["context_length"],
            hi=1 << 24,
        )
    return ModelSpec(
        **fields,
        **rope,
        rope_style="interleaved",
        attn_temp_scale=temp,
        attn_temp_floor=floor,
    )
