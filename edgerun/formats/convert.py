"""`edgerun convert`: a GGUF file, registry model or Hugging Face checkpoint -> a pack.

    edgerun convert smollm2-135m -o smollm2-q8 --quant q8_0
    edgerun convert ./hf-llama-dir -o llama-q4 --quant q4_k_m --imatrix auto
    edgerun convert model.gguf -o model-pack --quant keep     # blocks copied unchanged

Sources are read tensor by tensor and each tensor is quantized and streamed into the
pack (edgerun.formats.pack), so memory stays at about one float tensor. Requantizing a
GGUF that is already quantized starts from its dequantized weights: that adds a second
rounding error on top of the first (double quantization), which is printed as a warning.

--imatrix auto runs the source model on calibration text (edgerun.perplexity's
calibration_text(), disjoint from the evaluation text) to collect per-column activation
importances; --imatrix FILE.npz reads ones saved with --save-imatrix.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.errors import InvalidArgumentError, ModelNotFoundError
from edgerun.quant.formats import QuantType

__all__ = ["GGUFSource", "convert", "open_source"]

_FLOAT = (QuantType.F32, QuantType.F16, QuantType.BF16)


class GGUFSource:
    kind = "gguf"

    def __init__(self, path: Path) -> None:
        from edgerun.arch import spec_from_gguf
        from edgerun.formats.gguf import read_gguf

        self.path = Path(path)
        self.file = read_gguf(self.path)
        self.metadata = self.file.metadata
        self.spec = spec_from_gguf(self.metadata, str(self.path))

    def tensor_names(self) -> list[str]:
        return self.file.tensor_names()

    def tensor(self, name: str):
        return self.file.tensor(name)

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {n: self.file.tensor(n).shape for n in self.file.tensor_names()}

    def source_types(self) -> dict[str, QuantType]:
        return {n: self.file.tensor(n).qtype for n in self.file.tensor_names()}

    def float_tensor(self, name: str) -> np.ndarray:
        from edgerun.quant.reference import dequantize

        t = self.file.tensor(name)
        return dequantize(t.qtype, t.data).reshape(t.shape)

    def tokenizer_section(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        meta = {k: v for k, v in self.metadata.items() if k.startswith("tokenizer.")}
        return {"kind": "gguf", "metadata": meta}, {}

    def sha256(self) -> str:
        h = hashlib.sha256()
        with open(self.path, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
        return h.hexdigest()


def open_source(src: str | os.PathLike):
    """A conversion source from a path (GGUF file / HF directory) or a registry name."""
    from edgerun.formats.safetensors_hf import HFCheckpoint, is_hf_dir

    p = Path(src).expanduser()
    if p.is_dir():
        if is_hf_dir(p):
            return HFCheckpoint(p)
        raise InvalidArgumentError(
            f"{p} is a directory but not a Hugging Face checkpoint (config.json + "
            "*.safetensors); convert takes a GGUF file, a registry name or such a directory"
        )
    if p.is_file():
        return GGUFSource(p)
    from edgerun.api import resolve_model

    try:
        return GGUFSource(resolve_model(str(src), auto_pull=False))
    except ModelNotFoundError as e:
        raise ModelNotFoundError(f"convert source: {e}") from None


def _warn(msg: str) -> None:
    print(f"edgerun: warning: {msg}", file=sys.stderr)


def convert(
    src: str | os.PathLike,
    out: str | os.PathLike,
    quant: str = "q8_0",
    imatrix: str | os.PathLike | dict | None = None,
    method: str = "search",
    pure: bool = False,
    calib_tokens: int = 4096,
    calib_ctx: int = 512,
    save_imatrix: str | os.PathLike | None = None,
    progress: bool = True,
    source=None,
) -> Path:
    """Convert `src` into a pack directory `out` with recipe `quant`; returns `out`.

    imatrix: None, "auto" (calibrate now), a .npz path, or a dict name -> [cols].
    method: "search" (error-minimizing scale search) or "rtn" (plain round-to-nearest)
    for the low-bit formats.
    """
    from edgerun.formats.pack import PackWriter, is_pack, spec_to_json
    from edgerun.quant.quantize import quantize
    from edgerun.quant.recipes import plan_types

    out = Path(out)
    if out.exists() and not (out.is_dir() and (is_pack(out) or not any(out.iterdir()))):
        raise InvalidArgumentError(
            f"output {out} exists and is not an empty directory or a pack; choose another -o"
        )
    source = source if source is not None else open_source(src)
    spec = source.spec
    shapes = source.shapes()
    recipe = quant.strip().lower()
    src_types = source.source_types()
    plan = plan_types(recipe, shapes, spec.n_layers, src_types, pure)
    if recipe != "keep" and src_types is not None:
        quantized = sorted({q.name for q in src_types.values() if q not in _FLOAT})
        if quantized:
            _warn(
                f"{source.path.name} is already quantized ({', '.join(quantized)}); "
                f"requantizing to {recipe} starts from its dequantized weights and adds a "
                "second rounding error (double quantization). Convert from the original "
                "float checkpoint when you can."
            )
    imat_info = None
    if imatrix is not None and recipe != "keep":
        if isinstance(imatrix, dict):
            imat = imatrix
            imat_info = {"source": "given"}
        elif str(imatrix) == "auto":
            imat = _calibrate(source, calib_tokens, calib_ctx, progress)
            imat_info = {
                "source": "pydoc_data.topics (calibration part)",
                "tokens": calib_tokens,
                "n_ctx": calib_ctx,
            }
        else:
            from edgerun.quant.calibrate import load_imatrix

            imat = load_imatrix(imatrix)
            imat_info = {"source": str(imatrix)}
        if save_imatrix:
            from edgerun.quant.calibrate import save_imatrix as _save

            _save(save_imatrix, imat)
    else:
        imat = {}
    if plan.fallbacks:
        ex = next(iter(plan.fallbacks.items()))
        _warn(
            f"{len(plan.fallbacks)} tensors do not fit their format's block size and fall "
            f"back (e.g. {ex[0]}: {ex[1][0]} -> {ex[1][1]})"
        )
    names = list(shapes)
    writer = PackWriter(out, [(n, plan.types[n], shapes[n]) for n in names])
    with _progress(progress, f"converting to {recipe}", len(names)) as advance:
        for name in names:
            qt = plan.types[name]
            if recipe == "keep":
                data = source.tensor(name).data
            else:
                x = source.float_tensor(name)
                data = quantize(x, qt, imat.get(name), method)
            writer.write(name, data)
            advance(name)
    tok_section, extra = source.tokenizer_section()
    for fname, blob in extra.items():
        (out / fname).write_bytes(blob)
    from edgerun import __version__ as ver

    meta = {
        "created_by": f"edgerun {ver}",
        "spec": spec_to_json(spec),
        "tokenizer": tok_section,
        "quantization": {
            "recipe": recipe,
            "method": method,
            "pure": pure,
            "imatrix": imat_info,
            "types": plan.counts(),
            "fallbacks": {k: list(v) for k, v in plan.fallbacks.items()},
        },
        "source": {
            "path": str(Path(source.path).resolve()),
            "format": source.kind,
            "sha256": source.sha256(),
        },
    }
    return writer.close(meta)


def _calibrate(source, n_tokens: int, n_ctx: int, progress: bool) -> dict[str, np.ndarray]:
    from edgerun.model import Transformer
    from edgerun.perplexity import calibration_text
    from edgerun.quant.calibrate import collect_imatrix
    from edgerun.weights import ResidentStore

    if source.kind == "gguf":
        from edgerun.tokenizer import tokenizer_from_gguf_metadata

        tok = tokenizer_from_gguf_metadata(source.metadata)
    else:
        from edgerun.formats.pack import _tokenizer_from_section

        sec, extra = source.tokenizer_section()
        tok = _tokenizer_from_section(sec, extra)
    tokens = tok.encode(calibration_text(), add_bos=False, parse_special=False)[:n_tokens]
    tr = Transformer(source.spec, ResidentStore(source, str(source.path)), str(source.path))
    with _progress(progress, "calibrating (imatrix)", len(tokens)) as advance:
        last = [0]

        def on(done: int, total: int) -> None:
            advance(None, done - last[0])
            last[0] = done

        return collect_imatrix(
            tr, tokens, n_ctx=min(n_ctx, source.spec.context_length), on_progress=on
        )


class _progress:
    """A rich progress bar (or nothing): the context value is advance(label, n=1)."""

    def __init__(self, enabled: bool, what: str, total: int) -> None:
        self.enabled = enabled
        self.what = what
        self.total = total
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda label=None, n=1: None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[label]}"),
            transient=False,
        )
        self.bar.start()
        task = self.bar.add_task(self.what, total=self.total, label="")

        def advance(label=None, n=1):
            self.bar.update(task, advance=n, label=label or "")

        return advance

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()
