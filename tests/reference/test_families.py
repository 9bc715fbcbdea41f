"""Each GGUF family against transformers: tiny random reference models in tests/data/families/.

tests/data/families/make_family_models.py builds every folder there: a tiny randomly
initialised transformers model whose family features (rope scaling, sliding windows,
softcaps, multipliers, partial rotary, ...) change the logits within the test tokens,
converted to f32 / f16 / q8_0 GGUF by llama.cpp's own converter, with transformers'
float32 logits at every position of a fixed token sequence (reference.npz) and the config
and features (reference.json). llama.cpp itself reproduces every f32 file's logits to
~1e-5 of their spread (the figures are in each reference.json).

Errors are measured against the spread of the reference logits at each position
(max - min over the vocabulary): a scale-free yardstick, since these models' logits span
~5-20 depending on the family's scales and softcaps.

- f32: max |ours - ref| <= 1e-3 x spread at every position (float32 rounding, summation order).
- f16: <= 2e-2 x spread (weights rounded to 11 bits; llama.cpp's f16 files land at ~4e-3).
- q8_0: within twice llama.cpp's own error on the same file, at the worst position and on
  average (make_family_models.py records both in reference.json: ~0.06 and ~0.03 of the
  spread). Weights carry 8-bit blocks (llama.cpp also rounds activations to 8 bits), and
  the sharp attention of these random models (weights of std 0.2) amplifies the rounding.
  Argmax agreement >= 0.9 (or llama.cpp's own where that is lower: a tiny MoE's routing
  flips under 8-bit rounding). Where llama.cpp cannot run a variant as transformers does
  (reference.json's llama_cpp_differs), fixed bounds a little above the worst of the others.
- Argmax: f32 and f16 pick the reference's token at every position whose top-two margin
  exceeds twice the bound (where an error within the bound cannot swap them), and those
  positions are at least 90% of the sequence, so the check cannot quietly vanish.

Every data folder is either in FAMILIES_TESTED or in NOT_YET with a reason.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import edgerun

DATA = Path(__file__).resolve().parents[1] / "data" / "families"
OUTTYPES = ("f32", "f16", "q8_0")

# Data folders (tests/data/families/<name>/) that edgerun runs and this file checks.
FAMILIES_TESTED = [
    "qwen2",
    "llama",
    "llama3",
    "llama-bias",
    "qwen3",
    "granite",
    "gemma2",
    "phi3",
    "olmo2",
    "phi3-longrope",
    "smollm3",
    "exaone4",
    "exaone4-swa",
    "glm4",
    "cohere2",
    "mistral3",
    "qwen3moe",
    "qwen2moe",
    "lfm2",
    "lfm2moe",
    "gemma4",
    "gemma4-moe",
    "gemma3n",
    "qwen35",
    "qwen35moe",
    "granitehybrid",
    "granitehybrid-moe",
]

# Data folders holding only llama.cpp quantizations of a variant (<type>.gguf, with llama.cpp's
# own logits on the same file in reference.npz as llama_cpp_<type>): edgerun is held to
# llama.cpp there (test_quantized_family_matches_llama_cpp), each with the quantization.
QUANTIZED_ONLY = {"qwen3moe-q4k": "q4_k_m"}

# Data folders that exist but edgerun does not run yet, each with the reason.
NOT_YET: dict[str, str] = {}

# Per float outtype: the largest error at any position and the largest mean error, as
# fractions of that position's spread; q8_0's come from llama.cpp's measurement (x2).
MAX_ERR = {"f32": 1e-3, "f16": 2e-2}
MEAN_ERR = {"f32": 1e-3, "f16": 2e-2}
Q8_SLACK = 2.0
# q8_0 bounds where llama.cpp cannot run the variant as transformers does (reference.json's
# llama_cpp_differs says why): ~1.3x the worst llama.cpp figures over the other variants
# (0.19 at the worst position, 0.05 on average).
Q8_UNCHECKED = (0.25, 0.08)
MIN_ARGMAX = {"f32": 1.0, "f16": 1.0, "q8_0": 0.9}


def _folders() -> list[str]:
    return sorted(p.parent.name for p in DATA.glob("*/reference.npz"))


def test_every_data_folder_is_tested_or_listed_not_yet():
    folders = set(_folders())
    assert folders, f"no reference models under {DATA}"
    both = set(FAMILIES_TESTED) & set(NOT_YET)
    assert not both, f"in both FAMILIES_TESTED and NOT_YET: {sorted(both)}"
    untested = folders - set(FAMILIES_TESTED) - set(NOT_YET) - set(QUANTIZED_ONLY)
    assert not untested, f"data folders neither tested nor listed in NOT_YET: {sorted(untested)}"
    missing = (set(FAMILIES_TESTED) | set(NOT_YET) | set(QUANTIZED_ONLY)) - folders
    assert not missing, f"listed but no tests/data/families/<name>/reference.npz: {sorted(missing)}"
    for name in FAMILIES_TESTED:
        for outtype in OUTTYPES:
            assert (DATA / name / f"{outtype}.gguf").is_file(), f"{name}: no {outtype}.gguf"


def _reference(name: str) -> tuple[np.ndarray, np.ndarray, dict]:
    with np.load(DATA / name / "reference.npz") as ref:
        ids, logits = ref["ids"], ref["logits"]
    info = json.loads((DATA / name / "reference.json").read_text())
    return ids, logits, info


def _bounds(name: str, outtype: str, info: dict) -> tuple[float, float]:
    """(max, mean) error bounds as fractions of the spread for name's outtype file."""
    if outtype != "q8_0":
        return MAX_ERR[outtype], MEAN_ERR[outtype]
    if info.get("llama_cpp_differs"):
        return Q8_UNCHECKED
    measured = info.get("llama_cpp_vs_transformers", {}).get("q8_0")
    assert measured, (
        f"{name}: reference.json has no llama.cpp q8_0 measurement; rebuild it with "
        "make_family_models.py (without --no-check)"
    )
    return (
        Q8_SLACK * measured["max_diff_over_spread"],
        Q8_SLACK * measured["mean_diff_over_spread"],
    )


@pytest.mark.parametrize("outtype", OUTTYPES)
@pytest.mark.parametrize("name", FAMILIES_TESTED)
def test_family_logits_match_transformers(name, outtype):
    ids, ref, info = _reference(name)
    model = edgerun.load(DATA / name / f"{outtype}.gguf", n_ctx=len(ids), threads=2, kv_type="f32")
    assert model.spec.vocab_size == ref.shape[1]
    ours = model.logits(ids.tolist())
    assert ours.shape == ref.shape

    spread = ref.max(-1) - ref.min(-1)
    err = np.abs(ours - ref).max(-1) / spread
    where = f"{name} {outtype} ({', '.join(info['features'])})"
    max_err, mean_err = _bounds(name, outtype, info)
    worst = int(err.argmax())
    assert err.max() <= max_err, (
        f"{where}: max |ours - transformers| is {err.max():.3g} of the logits' spread at "
        f"position {worst} (bound {max_err:.3g})"
    )
    assert err.mean() <= mean_err, (
        f"{where}: mean error {err.mean():.3g} of the spread (bound {mean_err:.3g})"
    )

    agree = ours.argmax(-1) == ref.argmax(-1)
    least = MIN_ARGMAX[outtype]
    if outtype == "q8_0":  # a tiny MoE's routing flips under 8-bit rounding: there, as
        # much as llama.cpp's own agreement on the same file (qwen35moe: 0.86)
        measured = info.get("llama_cpp_vs_transformers", {}).get("q8_0", {})
        least = min(least, measured.get("argmax_agreement", least))
    assert agree.mean() >= least, f"{where}: argmax agreement {agree.mean():.3f}"
    if outtype != "q8_0":
        top2 = np.sort(ref, axis=-1)[:, -2:]
        decided = (top2[:, 1] - top2[:, 0]) / spread > 2 * max_err
        assert decided.mean() >= 0.9, f"{name}: the reference has too many near-ties to judge"
        flips = np.flatnonzero(decided & ~agree)
        assert flips.size == 0, f"{where}: argmax differs at positions {flips.tolist()}"


# A quantized file against llama.cpp on the same file: at most this fraction of the spread at
# every position but a few where a mixture of experts' router is near a tie (the second and
# third experts' logits within ~1e-2, so the rounding of either runtime may swap them and
# the position's output with them); argmax agreement at least MIN_ARGMAX["q8_0"].
QUANT_MAX_ERR = 0.05
QUANT_NEAR_TIES = 2


@pytest.mark.parametrize("name", sorted(QUANTIZED_ONLY))
def test_quantized_family_matches_llama_cpp(name):
    qtype = QUANTIZED_ONLY[name]
    with np.load(DATA / name / "reference.npz") as ref:
        ids, theirs, spread = ref["ids"], ref[f"llama_cpp_{qtype}"], np.ptp(ref["logits"], -1)
    model = edgerun.load(DATA / name / f"{qtype}.gguf", n_ctx=len(ids), threads=2, kv_type="f32")
    ours = model.logits(ids.tolist())
    err = np.abs(ours - theirs).max(-1) / spread
    far = np.flatnonzero(err > QUANT_MAX_ERR)
    assert far.size <= QUANT_NEAR_TIES, (
        f"{name} {qtype}: |ours - llama.cpp| above {QUANT_MAX_ERR} of the spread at positions "
        f"{far.tolist()} ({np.round(err[far], 3).tolist()})"
    )
    agree = (ours.argmax(-1) == theirs.argmax(-1)).mean()
    assert agree >= MIN_ARGMAX["q8_0"], f"{name} {qtype}: argmax agreement {agree:.3f}"
