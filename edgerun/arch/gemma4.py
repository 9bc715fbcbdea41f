"""Gemma 4 text (E2B / E4B).

Gemma 3's layer (GeGLU, q/k norms, pre and post norms, sqrt(d)-scaled embeddings, sliding
and full attention layers) with

- per-layer head dims and KV heads: sliding layers take '.attention.key_length_swa',
  full layers '.attention.key_length'; '.attention.head_count_kv' may be one per layer;
- KV shared across the last '.attention.shared_kv_layers' layers: each attends to the
  keys and values of the last earlier layer of its own kind (sliding or full) that stores
  its own (transformers' kv_sharing_modes; llama.cpp's reuse callback names the same
  layers in Gemma 4's files);
- v RMSNormed per head (no gain), attention scale 1 (q.k unscaled);
- RoPE per kind: sliding layers rotate '.rope.dimension_count_swa' dims with base
  '.rope.freq_base_swa'; full layers rotate every dim with '.rope.freq_base', divided by
  the file's rope_freqs (proportional RoPE: factors of 1e30 stop the unrotated pairs);
- per-layer embeddings (PLE, '.embedding_length_per_layer_input' > 0): a second token
  table of n_layers * ple values per token plus a projection of the embeddings
  (model/per_layer.py), injected after each layer through a gate, a projection and a norm;
- each layer's output times its own scalar (blk.i.layer_output_scale, where present);
- '.feed_forward_length' one per layer (the double-wide FFN of the KV-shared layers).

GGUF stores Gemma 4's norm gains as they are (no 1 + w offset). A layer without attn_v
(K = V attention, attention_k_eq_v) takes k's projection as v (llama.cpp does the same).

The MoE variant (26B-A4B, '.expert_count' > 0) runs routed experts beside each layer's
dense MLP (ModelSpec.experts_beside_mlp; model/moe.py), softmax-routed, renormalised and
scaled per expert (ffn_down_exps.scale), gate and up fused in one tensor.
"""

from __future__ import annotations

from typing import Any

from edgerun.arch.gemma3 import gemma_switches
from edgerun.arch.spec import (
    GLOBAL_TENSORS,
    LAYER_TENSORS,
    ModelSpec,
    common_fields,
    meta_float,
    meta_int,
    meta_layer_pattern,
    moe_fields,
)
from edgerun.errors import ModelFormatError, UnsupportedError

_MAX = 1 << 20

# Gemma 4's own tensors, beside the roles every family has
PER_LAYER_TENSORS = {
    "ple_gate": "blk.{i}.inp_gate.weight",
    "ple_proj": "blk.{i}.proj.weight",
    "ple_post_norm": "blk.{i}.post_norm.weight",
    "layer_output_scale": "blk.{i}.layer_output_scale.weight",
}
PLE_TENSORS = {
    "ple_token_embd": "per_layer_token_embd.weight",
    "ple_model_proj": "per_layer_model_proj.weight",
    "ple_proj_norm": "per_layer_proj_norm.weight",
}


def per_layer_ints(
    meta: dict[str, Any], key: str, source: str, n: int, default: int | None
) -> list:
    """An integer field given once or one per layer (llama.cpp's get_key_or_arr)."""
    value = meta.get(key, default)
    if value is None:
        raise ModelFormatError(f"{source}: metadata field '{key}' is missing")
    if isinstance(value, int) and not isinstance(value, bool):
        return [meta_int(meta, key, source, default, hi=_MAX)] * n
    try:
        values = [int(v) for v in value]
        ok = len(values) == n and all(1 <= v <= _MAX for v in values)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be an integer or {n} integers in "
            f"1..{_MAX} (one per layer)"
        )
    return values


def kv_sources(
    sliding: tuple[bool, ...], shared: int, source: str, arch: str = "gemma4"
) -> tuple[int, ...]:
    """Each layer's KV source: itself before the shared ones, else the last earlier
    layer of its kind that stores its own."""
    n = len(sliding)
    first = n - shared
    out = []
    for i in range(n):
        if i < first:
            out.append(i)
            continue
        owners = [j for j in range(first) if sliding[j] == sliding[i]]
        if not owners:
            kind = "sliding" if sliding[i] else "full"
            raise ModelFormatError(
                f"{source}: layer {i} shares KV ('{arch}.attention.shared_kv_layers' = "
                f"{shared}) but no earlier {kind} attention layer stores any"
            )
        out.append(owners[-1])
    return tuple(out)


def spec_from_gguf(meta: dict[str, Any], source: str) -> ModelSpec:
    a = "gemma4"
    n = meta_int(meta, f"{a}.block_count", source, hi=4096)
    kv_heads = per_layer_ints(meta, f"{a}.attention.head_count_kv", source, n, None)
    d_ff = per_layer_ints(meta, f"{a}.feed_forward_length", source, n, None)
    # common_fields reads these as one number: give it the largest, which sizes the buffers
    flat = dict(meta)
    flat[f"{a}.attention.head_count_kv"] = max(kv_heads)
    flat[f"{a}.feed_forward_length"] = max(d_ff)
    fields = common_fields(flat, a, source)
    # Gemma 4 26B-A4B: a softmax router's top experts, renormalised, beside the dense MLP
    experts = moe_fields(flat, a, source, norm=True) if meta.get(f"{a}.expert_count") else {}
    if experts:
        experts["experts_beside_mlp"] = True
    hd_full = fields["head_dim"]
    hd_swa = meta_int(meta, f"{a}.attention.key_length_swa", source, hd_full, hi=4096)
    for key, want in ((f"{a}.attention.value_length", hd_full),
                      (f"{a}.attention.value_length_swa", hd_swa)):  # fmt: skip
        if meta_int(meta, key, source, want, hi=4096) != want:
            raise UnsupportedError(f"{source}: '{key}' differs from the key length")
    sliding = meta_layer_pattern(meta, f"{a}.attention.sliding_window_pattern", source, n, 0)
    window = meta_int(meta, f"{a}.attention.sliding_window", source, 0, lo=0, hi=1 << 24)
    rope_swa = meta_int(meta, f"{a}.rope.dimension_count_swa", source, hd_swa, hi=hd_swa)
    rope_full = fields["rope_dim"]
    if rope_full > hd_full:
        raise ModelFormatError(
            f"{source}: '{a}.rope.dimension_count' {rope_full} exceeds key_length {hd_full}"
        )
    base_swa = meta_float(meta, f"{a}.rope.freq_base_swa", source, 10000.0)
    shared = meta_int(meta, f"{a}.attention.shared_kv_layers", source, 0, lo=0, hi=n)
    ple = meta_int(meta, f"{a}.embedding_length_per_layer_input", source, 0, lo=0, hi=_MAX)
    head_dims = tuple(hd_swa if s else hd_full for s in sliding)
    for i, kvh in enumerate(kv_heads):
        if fields["n_heads"] % kvh:
            raise ModelFormatError(
                f"{source}: layer {i}'s head_count_kv {kvh} does not divide head_count "
                f"{fields['n_heads']}"
            )
    fields.update(head_dim=max(head_dims), rope_dim=max(rope_full, rope_swa))
    return ModelSpec(
        **fields,
        **gemma_switches(meta, a, source, fields["d_model"]),
        attention_scale=1.0,
        layer_windows=tuple(window if s else 0 for s in sliding),
        layer_rope_bases=tuple(base_swa if s else fields["rope_base"] for s in sliding),
        layer_head_dims=head_dims,
        layer_kv_heads=tuple(kv_heads),
        layer_d_ff=tuple(d_ff),
        layer_rope_dims=tuple(rope_swa if s else rope_full for s in sliding),
        layer_rope_freqs=tuple(not s for s in sliding),
        layer_kv_source=kv_sources(sliding, shared, source),
        v_norm=True,
        per_layer_input=ple,
        layer_output_scale=True,
        **experts,
        layer_tensors={**LAYER_TENSORS, **PER_LAYER_TENSORS},
        global_tensors={**GLOBAL_TENSORS, **PLE_TENSORS},
    )
