"""A conversion source (GGUF file, Hugging Face checkpoint) -> a pack, tensor by tensor.

The format half of `edgerun convert` (edgerun.tools.convert runs the model for the
imatrix and drives this): check the output directory, plan every tensor's type from a
recipe, then quantize each tensor and stream it into the pack (edgerun.formats.pack),
so memory stays at about one float tensor. A source is a GGUFSource
(edgerun.formats.gguf) or an HFCheckpoint (edgerun.formats.safetensors_hf).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from edgerun.errors import InvalidArgumentError
from edgerun.quant.formats import QuantType

__all__ = ["check_output", "plan_pack", "write_pack"]

_FLOAT = (QuantType.F32, QuantType.F16, QuantType.BF16)


def warn(msg: str) -> None:
    print(f"edgerun: warning: {msg}", file=sys.stderr)


def check_output(out: str | os.PathLike) -> Path:
    """`out` as a Path; raises unless it is new, an empty directory or a pack."""
    from edgerun.formats.pack import is_pack

    out = Path(out)
    if out.exists() and not (out.is_dir() and (is_pack(out) or not any(out.iterdir()))):
        raise InvalidArgumentError(
            f"output {out} exists and is not an empty directory or a pack; choose another -o"
        )
    return out


def plan_pack(source, recipe: str, pure: bool = False):
    """Every tensor's type under `recipe` (a quant.recipes plan); warns when a source that
    is already quantized would be requantized."""
    from edgerun.quant.recipes import plan_types

    src_types = source.source_types()
    plan = plan_types(recipe, source.shapes(), source.spec.n_layers, src_types, pure)
    if recipe != "keep" and src_types is not None:
        quantized = sorted({q.name for q in src_types.values() if q not in _FLOAT})
        if quantized:
            warn(
                f"{source.path.name} is already quantized ({', '.join(quantized)}); "
                f"requantizing to {recipe} starts from its dequantized weights and adds a "
                "second rounding error (double quantization). Convert from the original "
                "float checkpoint when you can."
            )
    return plan


def write_pack(
    source,
    out: Path,
    recipe: str,
    plan,
    imatrix: dict[str, np.ndarray] | None = None,
    method: str = "search",
    pure: bool = False,
    imatrix_info: dict | None = None,
    on_tensor: Callable[[str], None] | None = None,
    extra_meta: dict | None = None,
) -> Path:
    """Quantize every tensor of `source` as `plan` says and write the pack `out`.

    imatrix: name -> column importances [cols] (missing names: unweighted).
    on_tensor(name) is called after each tensor is written.
    extra_meta: more top-level sections for edgerun.json (written with the pack, so a
    reader never sees the pack without them).
    """
    from edgerun._version import __version__ as ver
    from edgerun.formats.pack import PackWriter, spec_to_json
    from edgerun.quant.quantize import quantize

    imatrix = imatrix or {}
    if plan.fallbacks:
        ex = next(iter(plan.fallbacks.items()))
        warn(
            f"{len(plan.fallbacks)} tensors do not fit their format's block size and fall "
            f"back (e.g. {ex[0]}: {ex[1][0]} -> {ex[1][1]})"
        )
    shapes = source.shapes()
    names = list(shapes)
    writer = PackWriter(out, [(n, plan.types[n], shapes[n]) for n in names])
    try:
        for name in names:
            qt = plan.types[name]
            if recipe == "keep":
                data = source.tensor(name).data
            else:
                x = source.float_tensor(name)
                data = quantize(x, qt, imatrix.get(name), method)
            writer.write(name, data)
            if on_tensor is not None:
                on_tensor(name)
        tok_section, extra = source.tokenizer_section()
        for fname, blob in extra.items():
            (writer.dir / fname).write_bytes(blob)
        meta = {
            "created_by": f"edgerun {ver}",
            "spec": spec_to_json(source.spec),
            "tokenizer": tok_section,
            "quantization": {
                "recipe": recipe,
                "method": method,
                "pure": pure,
                "imatrix": imatrix_info,
                "types": plan.counts(),
                "fallbacks": {k: list(v) for k, v in plan.fallbacks.items()},
            },
            "source": {
                "path": str(Path(source.path).resolve()),
                "format": source.kind,
                "sha256": source.sha256(),
            },
            **(extra_meta or {}),
        }
        return writer.close(meta)
    except BaseException:  # Ctrl+C or an error: nothing half-written is left at `out`
        writer.abort()
        raise
