"""A model's recommended settings and the rule that an explicit choice overrides them.

The registry manifest's `[parameters]` table plays the part of an Ollama Modelfile's
PARAMETER lines: sampling defaults from the model card, a default system prompt and
a context size. A small model sampled with generic defaults (temperature 0.8) can
miss an answer it knows; the card's settings are what its authors tested. Models
outside the registry get the built-in defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgerun.errors import ModelFormatError
from edgerun.generate.sampling import DEFAULT_SAMPLING, SamplingParams

__all__ = ["DEFAULT_CTX", "SAMPLING_FIELDS", "ModelSettings", "parse_parameters"]

DEFAULT_CTX = 2048
SAMPLING_FIELDS = ("temperature", "top_k", "top_p", "min_p", "repeat_penalty")


@dataclass(frozen=True)
class ModelSettings:
    """What generate, chat and the chat app use for whatever the caller leaves unset."""

    temperature: float = DEFAULT_SAMPLING.temperature
    top_k: int = DEFAULT_SAMPLING.top_k
    top_p: float = DEFAULT_SAMPLING.top_p
    min_p: float = DEFAULT_SAMPLING.min_p
    repeat_penalty: float = DEFAULT_SAMPLING.repeat_penalty
    n_ctx: int = DEFAULT_CTX  # context size in tokens; 0 = the model's maximum
    system: str = ""  # default system prompt; "" leaves it to the chat template
    source: str = "built-in defaults"  # where these came from, for `edgerun info`

    def sampling(self, seed: int | None = None, **given: float | int | None) -> SamplingParams:
        """SamplingParams from these settings; each `given` value that is not None wins."""
        values: dict[str, Any] = {k: getattr(self, k) for k in SAMPLING_FIELDS}
        for k, v in given.items():
            if k not in values:
                raise TypeError(f"unknown sampling setting {k!r}")
            if v is not None:
                values[k] = v
        return SamplingParams(**values, seed=seed)

    def rows(self) -> list[tuple[str, str]]:
        """(name, value) pairs for display, in manifest order."""
        out = [(k, str(getattr(self, k))) for k in SAMPLING_FIELDS]
        out.append(("n_ctx", str(self.n_ctx) if self.n_ctx else "the model's maximum"))
        out.append(("system", repr(self.system) if self.system else "(the template's own)"))
        return out


def _number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# field -> (type check, range check, what is expected)
_SCHEMA = {
    "temperature": (_number, lambda v: v >= 0, "a number >= 0 (0 = greedy)"),
    "top_k": (_integer, lambda v: v >= 0, "an integer >= 0 (0 = off)"),
    "top_p": (_number, lambda v: 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (_number, lambda v: 0 <= v < 1, "a number in [0, 1)"),
    "repeat_penalty": (_number, lambda v: v > 0, "a number > 0 (1 = off)"),
    "n_ctx": (_integer, lambda v: v >= 0, "an integer >= 0 (0 = the model's maximum)"),
    "system": (lambda v: isinstance(v, str), lambda v: True, "a string"),
}


def parse_parameters(table: Any, where: str) -> ModelSettings:
    """ModelSettings from a manifest's `[parameters]` table; unset keys keep the defaults.

    A wrong key, type or value raises ModelFormatError naming the file, the field, what
    was expected and what was found: a manifest typo should not silently fall back.
    """
    if not isinstance(table, dict):
        raise ModelFormatError(
            f"{where}: [parameters] must be a table, found {type(table).__name__} {table!r}"
        )
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in _SCHEMA:
            raise ModelFormatError(
                f"{where}: [parameters] has unknown field '{key}' (known: {', '.join(_SCHEMA)})"
            )
        type_ok, range_ok, expected = _SCHEMA[key]
        if not (type_ok(value) and range_ok(value)):
            raise ModelFormatError(
                f"{where}: [parameters] {key}: expected {expected}, found "
                f"{type(value).__name__} {value!r}"
            )
        values[key] = float(value) if isinstance(getattr(ModelSettings, key), float) else value
    return ModelSettings(**values, source=where)
