"""Quantization recipes: which block format each tensor of a model gets.

A recipe name is either a plain format (`q8_0`, `q4_k`, `q3_g64`, ...: every 2-D weight
in that format) or a mixed preset in llama.cpp's spirit (`q4_k_m`, `q3_g64_m`, ...):
the tensors that hurt most when quantized coarsely (the output head / tied embedding,
attn_v, ffn_down in the first and last eighth of the layers and every third one
between) get more bits. 1-D tensors (norm gains, biases) always stay F32.

Formats need row lengths that are multiples of their block size (256 for the K-quants,
64 for the G64 formats); a tensor whose rows do not fit falls back as llama.cpp does
(Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, G64 -> Q4_0, anything -> F16 when even 32
does not fit).
Fallbacks are reported in the pack's metadata.

Plain formats below 5 bits keep the output head (and a tied embedding) at Q6_K unless
`pure=True`, as llama.cpp does.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from edgerun.errors import InvalidArgumentError
from edgerun.quant.formats import BLOCK_LAYOUT, QuantType

__all__ = ["Plan", "RECIPES", "plan_types", "recipe_names", "use_more_bits"]

Q = QuantType
_FALLBACK = {
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
    "Q3_G64": "Q4_0",
    "Q2_G64": "Q4_0",
}
_LOW = ("Q4_0", "Q4_1", "Q4_K", "Q3_G64", "Q2_G64")

# mixed presets: base, attn_v (more-bits layers / others), ffn_down (more / others), output
MIXED = {
    "q4_k_s": ("Q4_K", ("Q4_K", "Q4_K"), ("Q4_K", "Q4_K"), "Q6_K"),
    "q4_k_m": ("Q4_K", ("Q6_K", "Q4_K"), ("Q6_K", "Q4_K"), "Q6_K"),
    "q5_k_s": ("Q5_K", ("Q5_K", "Q5_K"), ("Q5_K", "Q5_K"), "Q6_K"),
    "q5_k_m": ("Q5_K", ("Q6_K", "Q5_K"), ("Q6_K", "Q5_K"), "Q6_K"),
    "q3_g64_m": ("Q3_G64", ("Q4_K", "Q4_K"), ("Q4_K", "Q3_G64"), "Q6_K"),
    "q2_g64_m": ("Q2_G64", ("Q4_K", "Q3_G64"), ("Q3_G64", "Q2_G64"), "Q6_K"),
}
PLAIN = ("f32", "f16", "bf16", "q8_0", "q6_k", "q5_k", "q5_1", "q5_0", "q4_k", "q4_1", "q4_0",
         "q3_g64", "q2_g64")  # fmt: skip
RECIPES = (*PLAIN, *MIXED, "keep")


def recipe_names() -> tuple[str, ...]:
    return tuple(r for r in RECIPES if r in ("keep", *MIXED) or hasattr(QuantType, r.upper()))


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's choice of layers that get more bits in the _M presets."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


@dataclass
class Plan:
    types: dict[str, QuantType]
    fallbacks: dict[str, tuple[str, str]] = field(default_factory=dict)  # name -> (want, got)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for q in self.types.values():
            out[q.name] = out.get(q.name, 0) + 1
        return out


def _fit(name: str, want: str, cols: int, plan: Plan) -> QuantType:
    q = want
    while True:
        qt = getattr(QuantType, q, None)
        if qt is None:
            raise InvalidArgumentError(f"format {q} is not available in this edgerun")
        if cols % BLOCK_LAYOUT[qt][0] == 0:
            break
        q = _FALLBACK.get(q, "Q8_0" if q != "Q8_0" else "F16")
    if q != want:
        plan.fallbacks[name] = (want, q)
    return qt


_LAYER = re.compile(r"^blk\.(\d+)\.(.+)$")


def plan_types(
    recipe: str,
    shapes: dict[str, tuple[int, int]],
    n_layers: int,
    source_types: dict[str, QuantType] | None = None,
    pure: bool = False,
) -> Plan:
    """The format of every tensor. shapes: name -> (rows, cols); 1-D tensors have rows 1
    and names not ending in '.weight' of a matrix role stay F32."""
    r = recipe.strip().lower()
    if r not in RECIPES:
        raise InvalidArgumentError(
            f"unknown quantization {recipe!r}; choose one of: {', '.join(recipe_names())}"
        )
    plan = Plan({})
    has_output = "output.weight" in shapes
    for name, (rows, cols) in shapes.items():
        if r == "keep":
            if source_types is None:
                raise InvalidArgumentError(
                    "--quant keep copies a GGUF's blocks unchanged; this source is not a GGUF"
                )
            plan.types[name] = source_types[name]
            continue
        if rows == 1 or not name.endswith(".weight") or "norm" in name:
            plan.types[name] = QuantType.F32
            continue
        is_out = name == "output.weight" or (name == "token_embd.weight" and not has_output)
        m = _LAYER.match(name)
        layer = int(m.group(1)) if m else -1
        role = m.group(2) if m else name
        if r in MIXED:
            base, attn_v, ffn_down, out = MIXED[r]
            want = base
            if is_out:
                want = out
            elif role == "attn_v.weight":
                want = attn_v[0] if use_more_bits(layer, n_layers) else attn_v[1]
            elif role == "ffn_down.weight":
                want = ffn_down[0] if use_more_bits(layer, n_layers) else ffn_down[1]
        else:
            want = r.upper()
            if is_out and not pure and want in _LOW:
                want = "Q6_K"
        plan.types[name] = _fit(name, want, cols, plan)
    return plan
