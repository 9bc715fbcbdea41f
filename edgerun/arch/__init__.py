"""Architecture families as data: a ModelSpec plus a tensor-name map.

Adding a family is a new module here that turns GGUF metadata into a
ModelSpec; model/ reads only the spec's switches.
"""

from __future__ import annotations

from typing import Any

from edgerun.arch import (
    cohere2,
    exaone4,
    gemma2,
    gemma3,
    gemma3n,
    gemma4,
    glm4,
    granite,
    granitehybrid,
    lfm2,
    lfm2moe,
    llama,
    mistral3,
    olmo2,
    phi3,
    qwen2,
    qwen2moe,
    qwen3,
    qwen3moe,
    qwen35,
    qwen35moe,
    smollm3,
)
from edgerun.arch.spec import ModelSpec, validate_spec
from edgerun.errors import ModelFormatError, UnsupportedError

FAMILIES = {
    "llama": llama,
    "qwen2": qwen2,
    "gemma3": gemma3,
    "qwen3": qwen3,
    "smollm3": smollm3,
    "granite": granite,
    "olmo2": olmo2,
    "exaone4": exaone4,
    "gemma2": gemma2,
    "phi3": phi3,
    "glm4": glm4,
    "cohere2": cohere2,
    "mistral3": mistral3,
    "qwen3moe": qwen3moe,
    "qwen2moe": qwen2moe,
    "lfm2": lfm2,
    "lfm2moe": lfm2moe,
    "gemma4": gemma4,
    "gemma3n": gemma3n,
    "qwen35": qwen35,
    "qwen35moe": qwen35moe,
    "granitehybrid": granitehybrid,
}


def spec_from_gguf(meta: dict[str, Any], source: str = "model") -> ModelSpec:
    """Build the ModelSpec for a GGUF file's metadata."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelFormatError(f"{source}: metadata has no 'general.architecture' field")
    if not isinstance(arch, str):
        raise ModelFormatError(
            f"{source}: metadata field 'general.architecture' should be a string, found "
            f"{type(arch).__name__}"
        )
    family = FAMILIES.get(arch)
    if family is None:
        raise UnsupportedError(
            f"{source}: architecture '{arch}' is not supported; supported: {', '.join(FAMILIES)}"
        )
    return validate_spec(family.spec_from_gguf(meta, source), source)


__all__ = ["ModelSpec", "spec_from_gguf", "validate_spec"]
