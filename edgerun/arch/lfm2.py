"""LFM2 / LFM2.5 (Liquid AI's short-convolution hybrids): double-gated short-convolution
layers between attention layers (per-head q/k RMSNorm, NeoX RoPE), each followed by a
SwiGLU FFN. The file marks the convolution layers by a head_count_kv of 0 in its
per-layer array; the output norm is stored as 'token_embd_norm'; a sliding window, if
any, applies to the attention layers."""

from __future__ import annotations

from typing import Any

from edgerun.arch.spec import GLOBAL_TENSORS, ModelSpec, common_fields, meta_int, rope_scaling
from edgerun.errors import ModelFormatError


def kv_marked_mixers(
    meta: dict[str, Any], a: str, source: str, kind: str
) -> tuple[dict[str, Any], tuple[str, ...]]:
    """Each layer's mixer from '<a>.attention.head_count_kv' as an array per layer: 0
    marks a recurrent layer (mixer `kind`), else the one KV head count of the attention
    layers. Returns the metadata with that count in place of the array, and the mixers."""
    key = f"{a}.attention.head_count_kv"
    n_layers = meta_int(meta, f"{a}.block_count", source, hi=4096)
    kv = meta.get(key)
    if isinstance(kv, int) and not isinstance(kv, bool):
        per_layer = [kv] * n_layers
    else:
        try:
            per_layer = [int(v) for v in kv]
        except (TypeError, ValueError):
            raise ModelFormatError(
                f"{source}: metadata field '{key}' should be an array of {n_layers} integers "
                f"(0 marks a {kind} layer)"
            ) from None
    attn = sorted({v for v in per_layer if v})
    if len(per_layer) != n_layers or len(attn) != 1 or min(per_layer) < 0:
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should hold {n_layers} values, 0 (a "
            f"{kind} layer) or one KV head count, found {per_layer[:16]}"
        )
    mixers = tuple("attention" if v else kind for v in per_layer)
    return dict(meta, **{key: attn[0]}), mixers


def spec_from_gguf(meta: dict[str, Any], source: str, a: str = "lfm2") -> ModelSpec:
    """The spec of an LFM2 file; `a` the metadata prefix (lfm2moe's files share the rest)."""
    meta, mixers = kv_marked_mixers(meta, a, source, "shortconv")
    # a sliding window, where the file sets one, on every attention layer (llama.cpp)
    window = meta_int(meta, f"{a}.attention.sliding_window", source, 0, lo=0, hi=1 << 24)
    windows = tuple(window if m == "attention" else 0 for m in mixers) if window else ()
    return ModelSpec(
        **common_fields(meta, a, source),
        rope_style="neox",
        qk_norm=True,
        rope_scale=rope_scaling(meta, a, source),
        layer_mixers=mixers,
        layer_windows=windows,
        shortconv_l_cache=meta_int(meta, f"{a}.shortconv.l_cache", source, lo=2, hi=64),
        global_tensors=dict(GLOBAL_TENSORS, output_norm="token_embd_norm.weight"),
    )
