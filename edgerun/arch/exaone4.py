"""EXAONE 4: OLMo 2's block layout (no pre-norms, post norms on each block's output)
with per-head q/k RMSNorm, NeoX RoPE, and an optional hybrid attention.

With `exaone4.attention.sliding_window`, the layers `sliding_window_pattern` marks
(default: all but every 4th) attend within the window with RoPE and the others
globally WITHOUT RoPE, as transformers' Exaone4Attention does (rope only when the
config has no sliding window or the layer slides). Without it every layer is global
and rotates.
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, rope_scaling, sliding_windows

SWA_PERIOD = 4  # without a pattern: every 4th layer global


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "exaone4"
    fields = common_fields(meta, a, source)
    windows = sliding_windows(meta, a, source, fields["n_layers"], SWA_PERIOD)
    return ModelSpec(
        **fields,
        rope_scale=rope_scaling(meta, a, source),
        rope_style="neox",
        pre_norms=False,
        post_norms=True,
        qk_norm=True,
        layer_windows=windows,
        layer_nope=tuple(w == 0 for w in windows),
    )
