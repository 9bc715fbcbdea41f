"""Cheap draft forms (edgerun.generate.draft_forms): the cached copy is made once and
reused, remade when its source changes or it no longer reads, refused for a file that
is no model; a first-layers copy computes what the full model's first layers compute,
followed by the final norm and the head."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

import edgerun
from edgerun.errors import InvalidArgumentError, ModelFormatError
from edgerun.formats.pack import read_pack
from edgerun.generate import draft_forms
from edgerun.generate.draft_forms import cheap_draft, parse_form
from edgerun.model.kvcache import KVCache
from edgerun.model.layer import Rows
from edgerun.ops.attention import attention
from edgerun.quant.formats import QuantType
from edgerun.quant.reference import dequantize

FAMILIES = Path(__file__).resolve().parents[1] / "data" / "families"
QWEN2 = FAMILIES / "qwen2" / "f32.gguf"
IDS = [5, 17, 42, 99, 3, 250, 7, 64, 128, 11]


@pytest.fixture
def source(tmp_path: Path) -> Path:
    p = tmp_path / "src" / "tiny-qwen2.gguf"
    p.parent.mkdir()
    shutil.copy(QWEN2, p)
    return p


def test_copy_is_made_once_then_reused(source: Path, tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "drafts"
    out = cheap_draft(source, "q4_0", cache_dir=cache)
    assert out.parent == cache
    pack = read_pack(out)
    types = {n: pack.tensor(n).qtype for n in pack.tensor_names()}
    # pure: every matrix, the tied embedding / head included, in the form's format
    assert types["token_embd.weight"] == QuantType.Q4_0
    assert types["blk.0.ffn_down.weight"] == QuantType.Q4_0
    assert pack.metadata["draft"]["form"] == "q4_0"
    made = (out / "edgerun.json").stat().st_mtime_ns

    def fail(*a, **k):
        raise AssertionError("the cached copy was made again")

    monkeypatch.setattr(draft_forms, "_make", fail)
    assert cheap_draft(source, "q4_0", cache_dir=cache) == out
    assert (out / "edgerun.json").stat().st_mtime_ns == made
    # another form is another copy
    monkeypatch.undo()
    other = cheap_draft(source, "q8_0", cache_dir=cache)
    assert other != out and out.is_dir()
    # the copy runs and stays close to its source (Q8_0's error: about 1% of the logits)
    ref = edgerun.load(str(source), threads=1).logits(IDS)
    got = edgerun.load(str(other), threads=1).logits(IDS)
    assert np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_source_form_is_the_file_itself(source: Path, tmp_path: Path) -> None:
    assert cheap_draft(source, "source", cache_dir=tmp_path / "drafts") == source
    assert not (tmp_path / "drafts").exists()


def test_changed_source_makes_a_new_copy_and_drops_the_old(source: Path, tmp_path: Path) -> None:
    cache = tmp_path / "drafts"
    first = cheap_draft(source, "q8_0", cache_dir=cache)
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    second = cheap_draft(source, "q8_0", cache_dir=cache)
    assert second != first
    assert not first.exists()
    assert read_pack(second).metadata["draft"]["mtime_ns"] == st.st_mtime_ns + 10**9


def test_a_copy_that_no_longer_reads_is_made_again(source: Path, tmp_path: Path) -> None:
    cache = tmp_path / "drafts"
    out = cheap_draft(source, "q8_0", cache_dir=cache)
    (out / "edgerun.json").write_text("{ not json")
    again = cheap_draft(source, "q8_0", cache_dir=cache)
    assert again == out
    assert read_pack(again).metadata["draft"]["form"] == "q8_0"
    # a pack at that name whose draft section names another source is not taken either
    meta = json.loads((out / "edgerun.json").read_text())
    meta["draft"]["path"] = "/elsewhere/model.gguf"
    (out / "edgerun.json").write_text(json.dumps(meta))
    cheap_draft(source, "q8_0", cache_dir=cache)
    assert read_pack(out).metadata["draft"]["path"] == str(source.resolve())


def test_corrupt_or_foreign_file_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "notes.gguf"
    foreign.write_text("these are notes, not a model\n" * 20)
    with pytest.raises(ModelFormatError, match="notes.gguf"):
        cheap_draft(foreign, "q4_0", cache_dir=tmp_path / "drafts")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(QWEN2.read_bytes()[: QWEN2.stat().st_size // 2])
    with pytest.raises(ModelFormatError, match="cut.gguf"):
        cheap_draft(cut, "q4_0", cache_dir=tmp_path / "drafts")
    assert not (tmp_path / "drafts").exists()  # nothing made for either


def test_form_names_are_checked(source: Path, tmp_path: Path) -> None:
    assert parse_form("auto") == parse_form(draft_forms.AUTO_FORM)
    assert parse_form("Q4_0:3").layers == 3
    for bad in ("q9_9", "q4_0:", "q4_0:0", "iq4_nl", "q4_0:two"):
        with pytest.raises(InvalidArgumentError, match="draft form"):
            parse_form(bad)
    with pytest.raises(InvalidArgumentError, match="cannot keep 9 layers of 4"):
        cheap_draft(source, "keep:9", cache_dir=tmp_path / "drafts")


def _first_layers_reference(model, ids: list[int], layers: int) -> np.ndarray:
    """Logits [n, vocab]: the full model's first `layers` layers (its own steps), then
    the final norm and the head in numpy."""
    tr = model.transformer
    cache = KVCache(tr.spec, 64, "f32")

    def attend(li: int, q, k, v, window: int, softcap: float) -> np.ndarray:
        cache.store(li, 0, k, v)
        return attention(q, cache.k[li], cache.v[li], 0, window, softcap=softcap)

    rows = Rows(
        tr.embed(np.asarray(ids)),
        np.arange(len(ids), dtype=np.int64),
        False,
        attend,
        lambda base: tr._rope(cache.n_ctx, base),
    )
    tr.input_norm.run(rows)
    for steps in tr.program[:layers]:
        for step in steps:
            step.run(rows)
    h = rows.h.astype(np.float64)
    normed = h / np.sqrt((h * h).mean(axis=1, keepdims=True) + tr.spec.norm_eps)
    normed *= np.asarray(tr.output_norm, np.float64)
    head = dequantize(tr.output.qtype, tr.output.data).reshape(tr.output.shape)
    return normed @ head.astype(np.float64).T


@pytest.mark.parametrize("family", ["qwen2", "exaone4-swa"])
@pytest.mark.parametrize("layers", [1, 3])
def test_first_layers_equal_the_full_models_first_layers(
    family: str, layers: int, tmp_path: Path
) -> None:
    src = FAMILIES / family / "f32.gguf"
    out = cheap_draft(src, f"keep:{layers}", cache_dir=tmp_path / "drafts")
    pack = read_pack(out)
    assert pack.spec.n_layers == layers
    assert not any(n.startswith(f"blk.{layers}.") for n in pack.tensor_names())
    full = edgerun.load(str(src), threads=1, interleave=False)
    cut = edgerun.load(str(out), threads=1, interleave=False)
    # per-layer lists (sliding windows, NoPE layers) are cut to the kept layers
    assert cut.spec.layer_windows == full.spec.layer_windows[:layers]
    assert cut.spec.layer_nope == full.spec.layer_nope[:layers]
    ref = _first_layers_reference(full, IDS, layers)
    got = cut.logits(IDS).astype(np.float64)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    assert np.array_equal(got.argmax(1), ref.argmax(1))
    # and it is not the full model's output
    assert not np.allclose(got, full.logits(IDS), atol=1e-3)


def test_api_resolves_a_draft_to_its_cached_form(source: Path, tmp_path: Path, monkeypatch) -> None:
    from edgerun.api import resolve_draft

    monkeypatch.setenv("EDGERUN_HOME", str(tmp_path / "home"))
    out = resolve_draft(str(source), "q8_0")
    assert out.parent == tmp_path / "home" / "drafts"
    assert read_pack(out).metadata["draft"]["form"] == "q8_0"
    assert resolve_draft(str(source), "source") == source
    assert resolve_draft(str(out)) == out  # a pack is taken as it is
