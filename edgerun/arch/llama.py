"""Llama family (Llama 2/3/3.1/3.2, SmolLM, TinyLlama, Mistral).

GGUF converters permute llama q/k weights so that RoPE rotates adjacent
pairs (llama.cpp's NORM mode); hence rope_style "interleaved". Llama 3.1/3.2's
rope scaling arrives as the `rope_freqs.weight` tensor (model/transformer.py reads
it for every family), q/k/v/o biases and a tied output as optional tensors;
Mistral's sliding window (`llama.attention.sliding_window`) covers every layer.
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, meta_int, rope_scaling

MAX_WINDOW = 1 << 24


def sliding_windows(meta: dict[str, Any], a: str, source: str, n_layers: int) -> tuple[int, ...]:
    """Every layer's window from '<a>.attention.sliding_window' (absent or 0: none)."""
    window = meta_int(meta, f"{a}.attention.sliding_window", source, 0, lo=0, hi=MAX_WINDOW)
    return (window,) * n_layers if window else ()


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    fields = common_fields(meta, "llama", source)
    return ModelSpec(
        **fields,
        rope_scale=rope_scaling(meta, "llama", source),
        rope_style="interleaved",
        layer_windows=sliding_windows(meta, "llama", source, fields["n_layers"]),
    )
