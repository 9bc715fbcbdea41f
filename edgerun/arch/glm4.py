"""GLM-4 (0414): llama's layer with q/k/v biases, partial rotary on interleaved pairs
(llama.cpp's NORM mode over the first rope.dimension_count of each head), post norms on
the attention and FFN outputs, and gate+up fused in one `ffn_up` (gate rows first; the
GGUF reader splits it, arch.spec's FUSED_TENSORS).

Files may end with `nextn_predict_layers` multi-token-prediction layers that the forward
pass skips (llama.cpp loads and ignores them); block_count counts them.
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, meta_int, rope_scaling

FUSED = ("attn_qkv", "ffn_gate_up")


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "glm4"
    fields = common_fields(meta, a, source)
    n = fields["n_layers"]
    nextn = meta_int(meta, f"{a}.nextn_predict_layers", source, 0, lo=0, hi=n - 1)
    fields["n_layers"] = n - nextn
    return ModelSpec(
        **fields,
        rope_scale=rope_scaling(meta, a, source),
        rope_style="interleaved",
        attn_bias=True,
        post_norms=True,
        fused_tensors=FUSED,
    )
