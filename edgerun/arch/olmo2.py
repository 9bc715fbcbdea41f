"""OLMo 2 (and OLMo 3's sliding-window layout): no norm before attention or the FFN,
RMSNorm of each block's output before its residual add (post_attention_norm,
post_ffw_norm), q/k RMSNorm over the whole projection (not per head), NeoX RoPE.

With `olmo2.attention.sliding_window`, the layers `sliding_window_pattern` marks
(default: all but every 4th) attend within the window; all layers keep the file's
RoPE base (llama.cpp reads no separate base for the sliding layers of this family
unless `rope.freq_base_swa` is present).
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import (
    ModelSpec,
    common_fields,
    meta_float,
    rope_scaling,
    sliding_windows,
)

SWA_PERIOD = 4


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "olmo2"
    fields = common_fields(meta, a, source)
    windows = sliding_windows(meta, a, source, fields["n_layers"], SWA_PERIOD)
    bases: tuple[float, ...] = ()
    if windows and f"{a}.rope.freq_base_swa" in meta:
        local = meta_float(meta, f"{a}.rope.freq_base_swa", source)
        bases = tuple(local if w else fields["rope_base"] for w in windows)
    return ModelSpec(
        **fields,
        rope_scale=rope_scaling(meta, a, source),
        rope_style="neox",
        pre_norms=False,
        post_norms=True,
        qk_norm=True,
        qk_norm_full=True,
        layer_windows=windows,
        layer_rope_bases=bases,
    )
