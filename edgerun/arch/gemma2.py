"""Gemma 2: Gemma 3's layer without q/k norms, plus attention logit softcapping.

Pre+post norms, GeGLU, sqrt(d)-scaled embeddings, final logit softcapping, and sliding
windows on the even layers (llama.cpp's pattern of 2: layer i is local unless
i % 2 == 1), every layer with the file's RoPE base. The scores' scale is llama.cpp's:
1/sqrt(head_dim), but 1/sqrt(d_model / heads) for the 46-layer 27B (Gemma's
query_pre_attn_scalar, which the GGUF does not store).
"""

from __future__ import annotations

import math
from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, meta_float, meta_int, rope_scaling

SWA_PERIOD = 2  # layers i with i % 2 == 1 are global
DEFAULT_WINDOW = 4096
LAYERS_27B = 46


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "gemma2"
    fields = common_fields(meta, a, source)
    n = fields["n_layers"]
    window = meta_int(
        meta, f"{a}.attention.sliding_window", source, DEFAULT_WINDOW, lo=0, hi=1 << 24
    )
    is_global = [i % SWA_PERIOD == SWA_PERIOD - 1 for i in range(n)]
    scale = 0.0
    if n == LAYERS_27B:
        scale = 1.0 / math.sqrt(fields["d_model"] // fields["n_heads"])
    return ModelSpec(
        **fields,
        rope_scale=rope_scaling(meta, a, source),
        rope_style="neox",
        activation="gelu_tanh",
        post_norms=True,
        embed_scale=math.sqrt(fields["d_model"]),
        final_logit_softcap=meta_float(
            meta, f"{a}.final_logit_softcapping", source, 0.0, lo_open=False
        ),
        attn_softcap=meta_float(meta, f"{a}.attn_logit_softcapping", source, 0.0, lo_open=False),
        attention_scale=scale,
        layer_windows=tuple(0 if g else window for g in is_global),
    )
