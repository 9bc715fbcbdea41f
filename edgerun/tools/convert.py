"""`edgerun convert`: a GGUF file, registry model or Hugging Face checkpoint -> a pack.

    edgerun convert smollm2-135m -o smollm2-q8 --quant q8_0
    edgerun convert ./hf-llama-dir -o llama-q4 --quant q4_k_m --imatrix auto
    edgerun convert model.gguf -o model-pack --quant keep     # blocks copied unchanged

Sources are read tensor by tensor and each tensor is quantized and streamed into the
pack (edgerun.formats.repack, which knows no model), so memory stays at about one float
tensor. Requantizing a GGUF that is already quantized starts from its dequantized
weights: that adds a second rounding error on top of the first (double quantization),
which is printed as a warning.

--imatrix auto runs the source model on calibration text (edgerun.corpus's
calibration_text(), disjoint from the evaluation text) to collect per-column activation
importances; --imatrix FILE.npz reads ones saved with --save-imatrix.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from edgerun.errors import InvalidArgumentError, ModelNotFoundError
from edgerun.formats.gguf import GGUFSource
from edgerun.formats.repack import check_output, plan_pack, write_pack
from edgerun.runtime.progress import progress_bar

__all__ = ["GGUFSource", "convert", "open_source"]


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
    out = check_output(out)
    source = source if source is not None else open_source(src)
    recipe = quant.strip().lower()
    plan = plan_pack(source, recipe, pure)
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
            from edgerun.tools.calibrate import load_imatrix

            imat = load_imatrix(imatrix)
            imat_info = {"source": str(imatrix)}
        if save_imatrix:
            from edgerun.tools.calibrate import save_imatrix as _save

            _save(save_imatrix, imat)
    else:
        imat = {}
    n = len(source.shapes())
    what = f"converting to {recipe}"
    with progress_bar(what, n, unit="tensors", enabled=progress) as advance:

        def on_tensor(name: str) -> None:
            advance(1, description=f"{what}: {name}")

        return write_pack(source, out, recipe, plan, imat, method, pure, imat_info, on_tensor)


def _calibrate(source, n_tokens: int, n_ctx: int, progress: bool) -> dict[str, np.ndarray]:
    from edgerun.corpus import calibration_text
    from edgerun.model.transformer import Transformer
    from edgerun.model.weights import ResidentStore
    from edgerun.tools.calibrate import collect_imatrix

    if source.kind == "gguf":
        from edgerun.tokenizer import tokenizer_from_gguf_metadata

        tok = tokenizer_from_gguf_metadata(source.metadata)
    else:
        from edgerun.formats.pack import _tokenizer_from_section

        sec, extra = source.tokenizer_section()
        tok = _tokenizer_from_section(sec, extra)
    tokens = tok.encode(calibration_text(), add_bos=False, parse_special=False)[:n_tokens]
    tr = Transformer(source.spec, ResidentStore(source, str(source.path)), str(source.path))
    with progress_bar(
        "calibrating (imatrix)", len(tokens), unit="tokens", enabled=progress
    ) as advance:
        return collect_imatrix(
            tr,
            tokens,
            n_ctx=min(n_ctx, source.spec.context_length),
            on_progress=lambda done, total: advance.update(done, total),
        )
