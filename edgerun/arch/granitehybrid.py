"""IBM Granite 4.0 H (Mamba-2 hybrids, dense or MoE): Mamba-2 layers (model/mamba2.py)
between attention layers, each followed by a SwiGLU FFN, dense (granite-4.0-h-micro) or a
mixture of experts with a shared expert on every layer (granite-4.0-h-tiny: softmax router,
top-k weights renormalised). Granite's four multipliers as in arch/granite.py. The file
marks the Mamba layers by a head_count_kv of 0 in its per-layer array (as LFM2's
convolution layers).

RoPE: only where '.rope.scaling.finetuned' is true (Bamba; llama.cpp's switch, default
true); Granite 4.0 H writes false, and its attention layers take no positions at all.

Mamba-2 sizes: '.ssm.inner_size' d_inner in '.ssm.time_step_rank' heads, state size
'.ssm.state_size', '.ssm.group_count' groups of B and C, '.ssm.conv_kernel' taps.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from edgerun.arch.lfm2 import kv_marked_mixers
from edgerun.arch.spec import (
    ModelSpec,
    common_fields,
    meta_float,
    meta_int,
    moe_fields,
    rope_scaling,
)
from edgerun.errors import ModelFormatError


def mamba2_fields(meta: dict[str, Any], a: str, source: str) -> dict[str, Any]:
    """The Mamba-2 sizes from '<a>.ssm.*' (d_inner a multiple of the heads)."""
    inner = meta_int(meta, f"{a}.ssm.inner_size", source, hi=1 << 20)
    heads = meta_int(meta, f"{a}.ssm.time_step_rank", source, hi=4096)
    if inner % heads:
        raise ModelFormatError(
            f"{source}: metadata field '{a}.ssm.inner_size' ({inner}) should be a multiple of "
            f"'{a}.ssm.time_step_rank' ({heads} heads)"
        )
    return dict(
        ssm_conv_kernel=meta_int(meta, f"{a}.ssm.conv_kernel", source, lo=2, hi=64),
        mamba_heads=heads,
        mamba_head_dim=inner // heads,
        mamba_state=meta_int(meta, f"{a}.ssm.state_size", source, hi=4096),
        mamba_groups=meta_int(meta, f"{a}.ssm.group_count", source, hi=4096),
    )


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "granitehybrid"
    meta, mixers = kv_marked_mixers(meta, a, source, "mamba2")
    key = f"{a}.rope.scaling.finetuned"
    rope = meta.get(key, True)
    if not isinstance(rope, bool):
        raise ModelFormatError(f"{source}: metadata field '{key}' should be a bool")
    spec = ModelSpec(
        **common_fields(meta, a, source),
        rope_scale=rope_scaling(meta, a, source),
        rope_style="interleaved",
        layer_nope=() if rope else tuple(m == "attention" for m in mixers),
        embed_scale=meta_float(meta, f"{a}.embedding_scale", source, 1.0),
        attention_scale=meta_float(meta, f"{a}.attention.scale", source, 0.0, lo_open=False),
        residual_scale=meta_float(meta, f"{a}.residual_scale", source, 1.0),
        logit_scale=meta_float(meta, f"{a}.logit_scale", source, 1.0),
        layer_mixers=mixers,
        **mamba2_fields(meta, a, source),
    )
    if meta_int(meta, f"{a}.expert_count", source, 0, lo=0) == 0:
        return spec
    moe = moe_fields(meta, a, source, norm=True)
    if f"{a}.expert_feed_forward_length" not in meta:  # llama.cpp: the experts are n_ff wide
        moe["expert_ff"] = spec.d_ff
    return dataclasses.replace(spec, **moe)
