"""ModelSpec: everything the forward pass needs to know about a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from edgerun.errors import ModelFormatError

# Per-layer tensor roles, mapped to GGUF names with "{i}" for the layer index.
LAYER_TENSORS = {
    "attn_norm": "blk.{i}.attn_norm.weight",
    "attn_q": "blk.{i}.attn_q.weight",
    "attn_k": "blk.{i}.attn_k.weight",
    "attn_v": "blk.{i}.attn_v.weight",
    "attn_output": "blk.{i}.attn_output.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "ffn_gate": "blk.{i}.ffn_gate.weight",
    "ffn_up": "blk.{i}.ffn_up.weight",
    "ffn_down": "blk.{i}.ffn_down.weight",
}
GLOBAL_TENSORS = {
    "token_embd": "token_embd.weight",
    "output_norm": "output_norm.weight",
    "output": "output.weight",
}


@dataclass(frozen=True)
class ModelSpec:
    """Hyperparameters plus the per-family switches model.py obeys."""

    arch: str
    name: str
    n_layers: int
    d_model: int
    d_ff: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    vocab_size: int
    context_length: int
    norm_eps: float
    rope_base: float
    rope_dim: int
    # "interleaved": rotate (x[2i], x[2i+1]) (llama.cpp's NORM; GGUF permutes
    # llama q/k weights for it); "neox": rotate (x[i], x[i + d/2]).
    rope_style: str = "interleaved"
    activation: str = "silu"
    tied_embeddings: bool = False
    layer_tensors: dict[str, str] = field(default_factory=lambda: dict(LAYER_TENSORS))
    global_tensors: dict[str, str] = field(default_factory=lambda: dict(GLOBAL_TENSORS))

    def layer_tensor(self, role: str, i: int) -> str:
        return self.layer_tensors[role].format(i=i)

    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def require(meta: dict[str, Any], key: str, source: str, kind: type = int) -> Any:
    """A metadata field that must be present, with a clear error if it is not."""
    if key not in meta:
        raise ModelFormatError(f"{source}: metadata field '{key}' is missing")
    value = meta[key]
    try:
        return kind(value)
    except (TypeError, ValueError):
        raise ModelFormatError(
            f"{source}: metadata field '{key}' should be {kind.__name__}, found {value!r}"
        ) from None
