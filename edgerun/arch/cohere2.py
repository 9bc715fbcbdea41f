"""Cohere Command R7B (cohere2): parallel attention and FFN from one LayerNorm, sliding
windows with RoPE on three layers of four and global layers without RoPE, scaled logits.

Each layer norms its input once (LayerNorm without bias, mean-centred) and adds both
the attention and the FFN of that normed input to the residual stream (parallel_blocks).
Layers are local (the file's window, RoPE on interleaved pairs) unless
`attention.sliding_window_pattern` marks them global (default period 4: layer i is
local when i % 4 < 3); global layers attend everywhere without RoPE (llama.cpp's
cohere2 graph). Logits are multiplied by `logit_scale` (the spec divides by its own).
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import (
    ModelSpec,
    common_fields,
    meta_float,
    meta_int,
    meta_layer_pattern,
    rope_scaling,
)

SWA_PERIOD = 4


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "cohere2"
    fields = common_fields(meta, a, source, norm_eps_key="layer_norm_epsilon")
    n = fields["n_layers"]
    window = meta_int(meta, f"{a}.attention.sliding_window", source, lo=1, hi=1 << 24)
    local = meta_layer_pattern(meta, f"{a}.attention.sliding_window_pattern", source, n, SWA_PERIOD)
    scale = meta_float(meta, f"{a}.logit_scale", source, 1.0, hi=1e6)
    return ModelSpec(
        **fields,
        rope_scale=rope_scaling(meta, a, source),
        rope_style="interleaved",
        norm_kind="layer",
        parallel_blocks=True,
        layer_windows=tuple(window if w else 0 for w in local),
        layer_nope=tuple(not w for w in local),
        logit_scale=1.0 / scale,
    )
