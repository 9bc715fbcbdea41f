"""SmolLM3: llama (interleaved RoPE after the converter's q/k permutation) whose every
`NOPE_PERIOD`-th layer (i + 1 divisible by it) attends without RoPE.

The GGUF carries no key for the period: llama.cpp fixes it at 4, as SmolLM3's
`no_rope_layer_interval` default does.
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec, common_fields, rope_scaling

NOPE_PERIOD = 4


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    fields = common_fields(meta, "smollm3", source)
    n = fields["n_layers"]
    return ModelSpec(
        **fields,
        rope_scale=rope_scaling(meta, "smollm3", source),
        rope_style="interleaved",
        layer_nope=tuple((i + 1) % NOPE_PERIOD == 0 for i in range(n)),
    )
