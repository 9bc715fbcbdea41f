"""Cheap forms of a draft model: a low-bit copy, or only its first layers, made once.

Speculative decoding gains (tokens accepted per target pass) / (cost of the pass plus
k draft steps). A draft that costs a third of the target eats most of that gain, so the
draft runs in the cheapest form that still agrees with the target: its weights
requantized to fewer bits (the head too, "pure": on Qwen2.5-Coder-0.5B the tied
151936 x 896 embedding is more than a quarter of the weights), and/or only its first
L layers followed by the final norm and the head (early exit).

A form is written `<quant>` or `<quant>:<L>`: <quant> is a plain quant.recipes format
(q8_0, q4_0, q4_k, q3_g64, ...; every matrix, the head included, in that format) or
"keep" (the source's blocks unchanged); L keeps layers 0..L-1. "source" is the file
itself, unchanged. "auto" is AUTO_FORM, chosen by benchmarks/draft_forms.py's
measured acceptance x cost (docs/draft_forms.md has the table). For Qwen2.5-Coder-0.5B
drafting for the 1.5B (2 threads, the shared 2-vCPU Zen 4 host) that is the source file:
q4_0 keeps its agreement (code 0.901 vs 0.911, prose 0.625 vs 0.650) at 355 of 485 MB
but its step is no cheaper there (66.5 vs 63.5 ms; the draft's step is not bound by its
bytes on that host: q2_g64 at 41% of the bytes still costs 75%), q3_g64 loses agreement
(0.866) for no gain, q2_g64 collapses (0.371), and early exit collapses (first 20 of 24
layers: 0.53; 22: 0.83 at 0.89 of the cost). Expected speedups at the best k (k = 1):
source 1.05, q4_0 1.04, q3_g64 1.03, q4_0:22 1.03. Where a draft's bytes set its cost
(an idle bandwidth-bound host, or a RAM budget that must hold it), pass form="q4_0".

`cheap_draft(path, form, cache_dir)` returns the pack (edgerun.formats.pack) holding
that form, made on first use and reused after: its name carries a key of the source's
identity (resolved path, size, modification time) and the form, and its edgerun.json
records them ("draft" section), so a changed source or a pack that no longer reads is
made again, and a stray or foreign directory at that name is never taken as the copy.
PackWriter stages the pack beside its place and renames it in, so a killed process
leaves no half-written copy. The caller names the cache directory (the API passes
registry.cache_dir() / "drafts").
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import InvalidArgumentError, ModelFormatError, ModelNotFoundError
from edgerun.quant.formats import QuantTensor, QuantType

__all__ = [
    "AUTO_FORM",
    "DraftForm",
    "FirstLayers",
    "cheap_draft",
    "draft_key",
    "first_layers_spec",
    "parse_form",
]

# the form "auto" stands for: see the docstring and docs/draft_forms.md for the
# measurements behind it
AUTO_FORM = "source"
# bumped when the way a form is made changes, so older copies are made again
FORM_REVISION = 1
_QUANTS = ("keep", "f16", "q8_0", "q6_k", "q5_0", "q4_k", "q4_1", "q4_0", "q3_g64", "q2_g64")
_FORM = re.compile(r"^([a-z0-9_]+)(?::(\d+))?$")


@dataclass(frozen=True)
class DraftForm:
    """How a draft is made from its source: every matrix in `quant` (or "keep": the
    source's blocks), only the first `layers` layers (None: all)."""

    quant: str
    layers: int | None = None

    @property
    def name(self) -> str:
        return self.quant if self.layers is None else f"{self.quant}:{self.layers}"


def parse_form(form: str) -> DraftForm | None:
    """A DraftForm from its name; None for "source" (the file itself). "auto" is
    AUTO_FORM."""
    text = str(form).strip().lower()
    if text == "auto":
        text = AUTO_FORM
    if text == "source":
        return None
    m = _FORM.match(text)
    if m is None or m.group(1) not in _QUANTS:
        raise InvalidArgumentError(
            f"unknown draft form {form!r}: expected auto, source, or <quant>[:<layers>] with "
            f"<quant> one of {', '.join(_QUANTS)} (e.g. q4_0, q4_0:18, keep:16)"
        )
    layers = int(m.group(2)) if m.group(2) is not None else None
    if layers is not None and layers < 1:
        raise InvalidArgumentError(f"draft form {form!r}: keeps at least 1 layer, got {layers}")
    return DraftForm(m.group(1), layers)


def first_layers_spec(spec: ModelSpec, layers: int) -> ModelSpec:
    """The spec of the model's first `layers` layers (per-layer lists cut to them)."""
    if not 1 <= layers <= spec.n_layers:
        raise InvalidArgumentError(
            f"{spec.name or spec.arch}: cannot keep {layers} layers of {spec.n_layers}"
        )
    return dataclasses.replace(
        spec,
        n_layers=layers,
        layer_windows=spec.layer_windows[:layers],
        layer_rope_bases=spec.layer_rope_bases[:layers],
        layer_nope=spec.layer_nope[:layers],
    )


_LAYER = re.compile(r"^blk\.(\d+)\.")


class FirstLayers:
    """A conversion source (edgerun.formats.repack) seen through its first `layers`
    layers: the later layers' tensors are left out and the spec says `layers`; the
    embedding, the final norm and the head stay."""

    def __init__(self, source: Any, layers: int) -> None:
        self.source = source
        self.spec = first_layers_spec(source.spec, layers)
        self.kind = source.kind
        self.path = source.path

    def _kept(self, name: str) -> bool:
        m = _LAYER.match(name)
        return m is None or int(m.group(1)) < self.spec.n_layers

    def shapes(self) -> dict[str, tuple[int, int]]:
        return {n: s for n, s in self.source.shapes().items() if self._kept(n)}

    def source_types(self) -> dict[str, QuantType] | None:
        types = self.source.source_types()
        return None if types is None else {n: q for n, q in types.items() if self._kept(n)}

    def tensor(self, name: str) -> QuantTensor:
        return self.source.tensor(name)

    def float_tensor(self, name: str) -> np.ndarray:
        return self.source.float_tensor(name)

    def tokenizer_section(self) -> tuple[dict[str, Any], dict[str, bytes]]:
        return self.source.tokenizer_section()

    def sha256(self) -> str:
        return self.source.sha256()


def _identity(path: Path) -> dict[str, Any]:
    st = path.stat()
    return {"path": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def draft_key(path: str | os.PathLike, form: DraftForm) -> dict[str, Any]:
    """What a cached copy is made from: the source's identity, the form, the revision."""
    p = Path(path).expanduser().resolve()
    return {**_identity(p), "form": form.name, "revision": FORM_REVISION}


def _copy_dir(cache_dir: Path, path: Path, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    form = key["form"].replace(":", "-l")
    return cache_dir / f"{path.stem}.{form}.{digest}"


def _reusable(out: Path, key: dict[str, Any]) -> bool:
    from edgerun.formats.pack import is_pack, read_pack

    if not is_pack(out):
        return False
    try:
        pack = read_pack(out)
    except (ModelFormatError, OSError):
        return False
    return pack.metadata.get("draft") == key


def cheap_draft(
    path: str | os.PathLike,
    form: str = "auto",
    *,
    cache_dir: str | os.PathLike,
    progress: bool = False,
) -> Path:
    """The draft model `path` (a GGUF file) in `form`: the path to load.

    "source" returns `path` itself. Any other form returns a pack under `cache_dir`,
    made now if no valid copy for this source and form is there yet (minutes for the
    K-quant and G64 formats' scale searches, seconds for q4_0 / q8_0 / keep). Copies of
    the same source and form made from an older version of the file are removed.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelNotFoundError(f"draft model not found: {p}")
    parsed = parse_form(form)
    if parsed is None:
        return p
    if not p.is_file():
        raise InvalidArgumentError(
            f"draft model {p}: a cheap form is made from a GGUF file; pass the file, or "
            "form='source' to use this model as it is"
        )
    from edgerun.formats.gguf import GGUFSource

    source: Any = GGUFSource(p)  # a corrupt or foreign file raises ModelFormatError here
    key = draft_key(p, parsed)
    cache = Path(cache_dir).expanduser()
    out = _copy_dir(cache, p.resolve(), key)
    if _reusable(out, key):
        return out
    if parsed.layers is not None:
        source = FirstLayers(source, parsed.layers)
    _make(source, out, parsed, key, progress)
    _remove_stale(cache, out, key)
    return out


def _make(source: Any, out: Path, form: DraftForm, key: dict[str, Any], progress: bool) -> None:
    from edgerun.formats.repack import write_pack
    from edgerun.quant.recipes import plan_types
    from edgerun.runtime.progress import progress_bar

    if out.exists() and not (out / "edgerun.json").is_file():
        shutil.rmtree(out)  # ours by its name, but not a pack: a leftover, made again
    shapes = source.shapes()
    plan = plan_types(form.quant, shapes, source.spec.n_layers, source.source_types(), pure=True)
    what = f"making the draft form {form.name} of {Path(source.path).name}"
    with progress_bar(what, len(shapes), unit="tensors", enabled=progress) as advance:
        write_pack(
            source,
            out,
            form.quant,
            plan,
            method="search",
            pure=True,
            on_tensor=lambda name: advance(1),
            extra_meta={"draft": key},
        )


def _remove_stale(cache: Path, keep: Path, key: dict[str, Any]) -> None:
    """Remove this source's older copies of the same form (made from an earlier version
    of the file), so the cache holds one copy per source and form."""
    prefix = keep.name.rsplit(".", 1)[0] + "."
    for other in cache.iterdir():
        if other == keep or not other.name.startswith(prefix) or not other.is_dir():
            continue
        try:
            draft = json.loads((other / "edgerun.json").read_text()).get("draft")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(draft, dict) and (draft.get("path"), draft.get("form")) == (
            key["path"],
            key["form"],
        ):
            shutil.rmtree(other, ignore_errors=True)
