"""Gemma 3n text (E2B / E4B): the language model of the multimodal Gemma 3n.

Gemma 3's layer (GeGLU, q/k norms, pre and post norms, sqrt(d)-scaled embeddings, sliding
and full attention layers; RoPE base '.rope.freq_base_swa' on sliding layers) with Gemma
4's per-layer embeddings (PLE), KV sharing across the last '.attention.shared_kv_layers'
layers and v norm, and three parts of its own (model/altup.py):

- AltUp: the residual stream is '.altup.num_inputs' streams; the embedding is projected
  to the others (altup_proj, magnitudes matched), every layer predicts each stream from
  all of them (router modalities of the active one, '.altup.active_idx'), runs the active
  one through the block and corrects all by what the block did; the streams are merged
  back (altup_unembd_proj, mean) before the output norm;
- Laurel: a low-rank residual of the normed input beside attention, (attn + laurel) /
  sqrt(2);
- activation sparsity: on layers whose '.activation_sparsity_scale' is finite, the FFN's
  gate keeps only what exceeds its mean by that many standard deviations.

The per-layer embedding joins after each layer: gelu(inp_gate(corrected active stream *
altup_correct_scale)) * the layer's embedding, projected and normed, added to every
stream but the first.

GGUF stores Gemma 3n's norm gains as they are (no 1 + w offset).
"""

from __future__ import annotations

import math
from typing import Any

from edgerun.arch.gemma3 import gemma_switches
from edgerun.arch.gemma4 import PLE_TENSORS, kv_sources, per_layer_ints
from edgerun.arch.spec import (
    GLOBAL_TENSORS,
    LAYER_TENSORS,
    ModelSpec,
    common_fields,
    meta_float,
    meta_int,
    meta_layer_pattern,
)
from edgerun.errors import ModelFormatError

ALTUP_LAYER_TENSORS = {
    "ple_gate": "blk.{i}.inp_gate.weight",
    "ple_proj": "blk.{i}.proj.weight",
    "ple_post_norm": "blk.{i}.post_norm.weight",
    "altup_correct_coef": "blk.{i}.altup_correct_coef.weight",
    "altup_correct_scale": "blk.{i}.altup_correct_scale.weight",
    "altup_predict_coef": "blk.{i}.altup_predict_coef.weight",
    "altup_router": "blk.{i}.altup_router.weight",
    "altup_router_norm": "blk.{i}.altup_router_norm.weight",
    "laurel_l": "blk.{i}.laurel_l.weight",
    "laurel_r": "blk.{i}.laurel_r.weight",
    "laurel_post_norm": "blk.{i}.laurel_post_norm.weight",
}
ALTUP_TENSORS = {
    "altup_proj": "altup_proj.weight",
    "altup_unembd_proj": "altup_unembd_proj.weight",
}
# llama.cpp's gemma3n graph, which reads neither key, where a file lacks it: without
# '.attention.shared_kv_layers' the first 20 layers store KV (its n_layer_kv_from_start);
# without '.activation_sparsity_scale' the first 10 layers cut at the 0.95 quantile of a
# normal (its n_layer_sparsity, f_sparsity_std_mul)
DEFAULT_KV_LAYERS = 20
DEFAULT_SPARSE_LAYERS = 10
DEFAULT_SPARSITY_STD = 1.6448533535003662


def _sparsity(meta: dict[str, Any], key: str, source: str, n: int) -> tuple[float | None, ...]:
    """Each layer's gate cutoff in standard deviations (None: dense). The converter writes
    the normal quantile of each layer's target sparsity, -inf for a dense layer (0)."""
    if key not in meta:
        return tuple(DEFAULT_SPARSITY_STD if i < DEFAULT_SPARSE_LAYERS else None
                     for i in range(n))  # fmt: skip
    value = meta[key]
    try:
        values = [float(v) for v in value]
        ok = len(values) == n and not any(isinstance(v, bool) for v in value)
    except (TypeError, ValueError):
        ok = False
    if not ok or any(math.isnan(v) or v == math.inf for v in values):
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be {n} numbers (one per layer: a "
            "normal quantile, -inf for a dense layer)"
        )
    return tuple(None if v == -math.inf else v for v in values)


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "gemma3n"
    n = meta_int(meta, f"{a}.block_count", source, hi=4096)
    d_ff = per_layer_ints(meta, f"{a}.feed_forward_length", source, n, None)
    flat = dict(meta)
    flat[f"{a}.feed_forward_length"] = max(d_ff)  # common_fields reads one: the largest
    fields = common_fields(flat, a, source)
    sliding = meta_layer_pattern(meta, f"{a}.attention.sliding_window_pattern", source, n, 5)
    window = meta_int(meta, f"{a}.attention.sliding_window", source, 0, lo=0, hi=1 << 24)
    base_swa = meta_float(meta, f"{a}.rope.freq_base_swa", source, 10000.0)
    # absent (files before the key): llama.cpp's fixed layout, KV stored by the first 20
    shared = meta_int(
        meta, f"{a}.attention.shared_kv_layers", source, max(0, n - DEFAULT_KV_LAYERS), lo=0,
        hi=n,
    )  # fmt: skip
    ple = meta_int(meta, f"{a}.embedding_length_per_layer_input", source, lo=1, hi=1 << 20)
    n_altup = meta_int(meta, f"{a}.altup.num_inputs", source, 4, lo=2, hi=16)
    active = meta_int(meta, f"{a}.altup.active_idx", source, 0, lo=0, hi=n_altup - 1)
    return ModelSpec(
        **fields,
        **gemma_switches(meta, a, source, fields["d_model"]),
        attention_scale=1.0,
        layer_windows=tuple(window if s else 0 for s in sliding),
        layer_rope_bases=tuple(base_swa if s else fields["rope_base"] for s in sliding),
        layer_d_ff=tuple(d_ff) if len(set(d_ff)) > 1 else (),
        layer_kv_source=kv_sources(sliding, shared, source, a),
        v_norm=True,
        per_layer_input=ple,
        altup_inputs=n_altup,
        altup_active=active,
        laurel=True,
        layer_ffn_sparsity=_sparsity(meta, f"{a}.activation_sparsity_scale", source, n),
        layer_tensors={**LAYER_TENSORS, **ALTUP_LAYER_TENSORS},
        global_tensors={**GLOBAL_TENSORS, **PLE_TENSORS, **ALTUP_TENSORS},
    )
