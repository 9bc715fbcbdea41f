"""Architecture families as data: a ModelSpec plus a tensor-name map.

Adding a family is a new module here that turns GGUF metadata into a
ModelSpec; model.py reads only the spec's switches.
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import ModelSpec
from edgerun.errors import ModelFormatError, UnsupportedError

_PLANNED = {"gemma3": "Gemma 3", "qwen2": "Qwen 2 / 2.5"}


def spec_from_gguf(meta: dict[str, Any], source: str = "model") -> ModelSpec:
    """Build the ModelSpec for a GGUF file's metadata."""
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelFormatError(f"{source}: metadata has no 'general.architecture' field")
    if arch == "llama":
        from edgerun.arch import llama

        return llama.spec_from_gguf(meta, source)
    if arch in _PLANNED:
        raise UnsupportedError(
            f"{source}: architecture '{arch}' ({_PLANNED[arch]}) is not supported yet; "
            "supported: llama"
        )
    raise UnsupportedError(f"{source}: unknown architecture '{arch}'; supported: llama")


__all__ = ["ModelSpec", "spec_from_gguf"]
