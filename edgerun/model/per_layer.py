"""Per-layer embeddings (Gemma 4's PLE): each token's inputs to every layer.

A second token table holds n_layers * width values per token (in E2B about 40% of the
file); a token's rows are looked up, never multiplied, so the table stays on storage and
only the current tokens' rows are read: from the mapped file, or under a RAM budget with
direct I/O (the store's row_reader), as llama.cpp's lazy per-layer tables do. The token's
embedding adds a context part through a projection:

    e = (RMSNorm(proj(h) / sqrt(d_model)) per layer + rows(ids) * sqrt(width)) / sqrt(2)

with h the scaled token embeddings (transformers' project_per_layer_inputs, llama.cpp's
gemma4 graph). Layer i then reads e[:, i] (layer.PerLayerOutput).
"""

from __future__ import annotations

import math

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import ModelFormatError
from edgerun.model.weights import WeightStore
from edgerun.ops import qmatvec
from edgerun.ops.norm import rmsnorm

__all__ = ["PerLayerInputs"]


class PerLayerInputs:
    """The per-layer embedding table, the model projection and its norm of a model whose
    spec has per_layer_input > 0."""

    def __init__(self, spec: ModelSpec, store: WeightStore, source: str = "model") -> None:
        g = spec.global_tensors
        self.width, self.n_layers = spec.per_layer_input, spec.n_layers
        total = self.width * self.n_layers
        for role in ("ple_token_embd", "ple_model_proj", "ple_proj_norm"):
            if not store.has(g[role]):
                raise ModelFormatError(
                    f"{source}: tensor '{g[role]}' is missing (the metadata asks for "
                    f"per-layer embeddings of {self.width} per layer)"
                )
        self.table = store.matrix(g["ple_token_embd"])
        # a store that streams from storage reads the tokens' rows with direct I/O
        # (offload/store.DenseStreamStore.row_reader); else they come from the table
        row_reader = getattr(store, "row_reader", None)
        self.read_rows = row_reader(g["ple_token_embd"]) if row_reader is not None else None
        self.proj = store.matrix(g["ple_model_proj"])
        self.norm = store.vector(g["ple_proj_norm"])
        for t, shape in ((self.table, (spec.vocab_size, total)),
                         (self.proj, (total, spec.d_model))):  # fmt: skip
            if t.shape != shape:
                raise ModelFormatError(
                    f"{source}: tensor '{t.name}' has shape {t.shape}, expected {shape}"
                )
        if self.norm.shape != (self.width,):
            raise ModelFormatError(
                f"{source}: tensor '{g['ple_proj_norm']}' should have {self.width} values, "
                f"found {self.norm.size}"
            )
        self.eps = np.float64(spec.norm_eps)
        self.proj_scale = np.float32(1.0 / math.sqrt(spec.d_model))
        self.table_scale = np.float32(math.sqrt(self.width))
        self.mix = np.float32(1.0 / math.sqrt(2.0))

    def __call__(self, ids: np.ndarray, h: np.ndarray, decode: bool = False) -> np.ndarray:
        """Per-layer inputs [n, n_layers, width] of tokens ids with scaled embeddings h
        [n, d_model]. decode: h's rows are different sequences' decode rows (each row then
        as a one-token pass computes it)."""
        n = h.shape[0]
        p = qmatvec.matvec_batch(self.proj, h) if decode else qmatvec.project(self.proj, h)
        p = p * self.proj_scale
        p = rmsnorm(p.reshape(n * self.n_layers, self.width), self.norm, self.eps)
        if self.read_rows is not None:
            ids = np.asarray(ids, np.int64)
            rows = qmatvec.embedding_rows(self.read_rows(ids), np.arange(ids.size))
        else:
            rows = qmatvec.embedding_rows(self.table, ids)
        rows *= self.table_scale
        e = (p.reshape(n, -1) + rows) * self.mix
        return e.reshape(n, self.n_layers, self.width)

    @property
    def table_bytes(self) -> int:
        """Bytes of the token table (read by rows: a token reads width * n_layers values)."""
        return self.table.nbytes
