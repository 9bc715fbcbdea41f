"""LFM2-MoE (Liquid AI's LFM2-8B-A1B style): LFM2's short-convolution and attention layers,
with a mixture-of-experts FFN after the first `leading_dense_block_count` dense layers. The
router's probabilities are sigmoids of its logits; each layer's `exp_probs_b` bias picks the
experts and the picked probabilities, renormalised, weight them (llama.cpp's lfm2 graph)."""

from __future__ import annotations

import dataclasses
from typing import Any

from edgerun.arch import lfm2
from edgerun.arch.spec import ModelSpec, moe_fields


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "lfm2moe"
    spec = lfm2.spec_from_gguf(meta, source, a)
    return dataclasses.replace(spec, **moe_fields(meta, a, source, norm=True))
