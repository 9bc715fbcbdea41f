"""Gemma 3: GeGLU, q/k norms, pre+post norms, sqrt(d)-scaled embeddings,
sliding-window layers with a global layer every `SWA_PERIOD`-th.

GGUF converters store Gemma's (1 + w) norm gains already offset, so they are
used as plain gains. Local (sliding) layers use RoPE base 10000; global layers
use the file's freq_base (as llama.cpp and transformers do).
"""

from __future__ import annotations

import math
from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, meta_float, meta_int

SWA_PERIOD = 6  # layers i with i % 6 == 5 are global
LOCAL_ROPE_BASE = 10000.0


def gemma_switches(meta: dict[str, Any], a: str, source: str, d_model: int) -> dict[str, Any]:
    """The switches Gemma 3, 3n and 4 share: NeoX RoPE, GeGLU, q/k norms, pre+post norms,
    sqrt(d)-scaled embeddings and the file's final logit softcap (0: none)."""
    return dict(
        rope_style="neox",
        activation="gelu_tanh",
        qk_norm=True,
        post_norms=True,
        embed_scale=math.sqrt(d_model),
        final_logit_softcap=meta_float(
            meta, f"{a}.final_logit_softcapping", source, 0.0, lo_open=False
        ),
    )


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "gemma3"
    fields = common_fields(meta, a, source)
    n = fields["n_layers"]
    window = meta_int(meta, f"{a}.attention.sliding_window", source, 0, lo=0, hi=1 << 24)
    is_global = [i % SWA_PERIOD == SWA_PERIOD - 1 for i in range(n)]
    return ModelSpec(
        **fields,
        **gemma_switches(meta, a, source, fields["d_model"]),
        layer_windows=tuple(0 if g else window for g in is_global),
        layer_rope_bases=tuple(fields["rope_base"] if g else LOCAL_ROPE_BASE for g in is_global),
    )
