"""WeightStore: the only way model code reaches weights.

Offloading (flash) and GPU hand-off become other stores that return other FFN
executors from `ffn()` (and, for the GPU, other attention projections than
ResidentProjections); the model code stays unchanged. ResidentStore keeps everything
where the file reader put it (for GGUF: views over one mmap, so "resident" costs
page cache, not copies).
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from edgerun.arch.spec import LAYER_TENSORS, ModelSpec
from edgerun.errors import ModelFormatError
from edgerun.model.ffn import DenseFFN, FFNExecutor
from edgerun.model.moe import is_moe_layer, moe_ffn
from edgerun.ops import qmatvec
from edgerun.quant.formats import QuantTensor, QuantType


class AttentionProjections(Protocol):
    """What the model needs of a layer's attention projections (float32 [n, dim] rows)."""

    def qkv(self, x: np.ndarray) -> list[np.ndarray]:
        """x [n, d_model] -> [q [n, q_dim], k [n, kv_dim], v [n, kv_dim]] (forward)."""
        ...

    def out(self, ctx: np.ndarray) -> np.ndarray:
        """ctx [n, q_dim] -> [n, d_model] (forward)."""
        ...

    def qkv_batch(self, x: np.ndarray) -> list[np.ndarray]:
        """Decode rows of different sequences (forward_batch)."""
        ...

    def out_batch(self, ctx: np.ndarray) -> np.ndarray: ...


class ResidentProjections:
    """q, k, v, o on the resident quantized matrices: the CPU kernels. Every row of the
    batch methods equals the one-token result bit for bit (qmatvec.matvec_batch)."""

    __slots__ = ("q", "k", "v", "o")

    def __init__(self, q: QuantTensor, k: QuantTensor, v: QuantTensor, o: QuantTensor) -> None:
        self.q, self.k, self.v, self.o = q, k, v, o

    def qkv(self, x: np.ndarray) -> list[np.ndarray]:
        return qmatvec.project_many((self.q, self.k, self.v), x)

    def out(self, ctx: np.ndarray) -> np.ndarray:
        return qmatvec.project(self.o, ctx)

    def qkv_batch(self, x: np.ndarray) -> list[np.ndarray]:
        return qmatvec.matvec_batch_many((self.q, self.k, self.v), x)

    def out_batch(self, ctx: np.ndarray) -> np.ndarray:
        return qmatvec.matvec_batch(self.o, ctx)


class QueryProjections:
    """q and o alone, for a layer that attends to another layer's keys and values (Gemma
    4's KV-shared layers): qkv gives [q, None, None]."""

    __slots__ = ("q", "o")

    def __init__(self, q: QuantTensor, o: QuantTensor) -> None:
        self.q, self.o = q, o

    def qkv(self, x: np.ndarray) -> list[np.ndarray | None]:
        return [qmatvec.project(self.q, x), None, None]

    def out(self, ctx: np.ndarray) -> np.ndarray:
        return qmatvec.project(self.o, ctx)

    def qkv_batch(self, x: np.ndarray) -> list[np.ndarray | None]:
        return [qmatvec.matvec_batch(self.q, x), None, None]

    def out_batch(self, ctx: np.ndarray) -> np.ndarray:
        return qmatvec.matvec_batch(self.o, ctx)


class WeightStore(Protocol):
    def has(self, name: str) -> bool: ...

    def matrix(self, name: str) -> QuantTensor:
        """A 2-D weight in its block format, for the matvec/matmul kernels."""
        ...

    def vector(self, name: str) -> np.ndarray:
        """A small 1-D weight (norm gains, biases) as float32."""
        ...

    def ffn(self, spec: ModelSpec, layer: int) -> FFNExecutor:
        """The executor that computes layer `layer`'s FFN wherever its weights live."""
        ...

    def resident_bytes(self) -> int: ...


class ResidentStore:
    """All tensors held by a reader exposing `tensor(name)` and `tensor_names()`."""

    def __init__(self, reader, source: str) -> None:
        self._reader = reader
        self._names = set(reader.tensor_names())
        self._source = source
        self._matrices: dict[str, QuantTensor] = {}
        self._vectors: dict[str, np.ndarray] = {}

    def has(self, name: str) -> bool:
        return name in self._names

    def release_pages(self, name: str) -> int:
        """Let go of the mapped pages of a matrix the model now reads from a copy, where
        the reader maps its file (GGUFFile.release_pages); returns the bytes."""
        release = getattr(self._reader, "release_pages", None)
        return release(name) if release is not None else 0

    def matrix(self, name: str) -> QuantTensor:
        t = self._matrices.get(name)
        if t is None:
            t = self._reader.tensor(name)
            self._matrices[name] = t
        return t

    def vector(self, name: str) -> np.ndarray:
        v = self._vectors.get(name)
        if v is None:
            t = self._reader.tensor(name)
            if t.rows != 1:
                raise ModelFormatError(
                    f"{self._source}: tensor '{name}' should be 1-D, found shape {t.shape}"
                )
            if t.qtype == QuantType.F32:
                v = t.data.view(np.float32).reshape(-1).copy()
            elif t.qtype == QuantType.F16:
                v = t.data.view(np.float16).reshape(-1).astype(np.float32)
            elif t.qtype == QuantType.BF16:
                v = (t.data.view(np.uint16).reshape(-1).astype(np.uint32) << 16).view(np.float32)
            else:
                from edgerun.quant.reference import dequantize

                v = dequantize(t.qtype, t.data).reshape(-1)
            # Norm gains and biases are small, so checking them all is cheap; one NaN or inf
            # would turn every output into NaN without any error.
            if not np.isfinite(v).all():
                bad = int(np.flatnonzero(~np.isfinite(v))[0])
                raise ModelFormatError(
                    f"{self._source}: tensor '{name}' should hold finite values, found "
                    f"{v[bad]} at index {bad} (a corrupt or hostile file)"
                )
            self._vectors[name] = v
        return v

    def check_vectors(self, spec: ModelSpec, layer: int) -> None:
        """Check layer ``layer``'s 1-D weights (and, for layer 0, the output ones) against the
        spec. The kernels index them by the spec's sizes without bounds checks, so a norm
        vector of the wrong length would read outside its buffer."""
        want = {"attn_norm": spec.d_model, "ffn_norm": spec.d_model}
        # biases are checked wherever present: a family may carry them optionally (llama)
        want |= {"attn_q_bias": spec.q_dim, "attn_k_bias": spec.kv_dim}
        want |= {"attn_v_bias": spec.kv_dim, "attn_output_bias": spec.d_model}
        if spec.qk_norm:
            hd = spec.head_dim_of(layer)
            qn, kn = (spec.q_dim, spec.kv_dim) if spec.qk_norm_full else (hd, hd)
            want |= {"attn_q_norm": qn, "attn_k_norm": kn}
        if spec.post_norms:
            want |= {"post_attention_norm": spec.d_model, "post_ffw_norm": spec.d_model}
        names = {
            spec.layer_tensors.get(role, LAYER_TENSORS[role]).format(i=layer): n
            for role, n in want.items()
        }
        if layer == 0:
            names[spec.global_tensors["output_norm"]] = spec.d_model
        for name, n in names.items():
            if name in self._names and self.vector(name).shape != (n,):
                raise ModelFormatError(
                    f"{self._source}: tensor '{name}' should have {n} values (from the model's "
                    f"metadata), found {self.vector(name).size}"
                )
        out = spec.global_tensors["output"]
        if layer == 0 and out in self._names:
            shape = self.matrix(out).shape
            if shape != (spec.vocab_size, spec.d_model):
                raise ModelFormatError(
                    f"{self._source}: tensor '{out}' should have shape "
                    f"{(spec.vocab_size, spec.d_model)} (from the model's metadata), found {shape}"
                )

    def expert_matrices(
        self, name: str, n_expert: int, shape: tuple[int, int]
    ) -> list[QuantTensor]:
        """Each expert's 2-D matrix of a 3-D expert tensor, as views of the reader's bytes
        (GGUFFile.expert_matrices, which checks the 3-D shape; a reader of 2-D tensors
        only, an edgerun pack, holds them as [n_expert * rows, cols]); the whole tensor
        counts as resident."""
        get = getattr(self._reader, "expert_matrices", None)
        if get is not None:
            views = get(name, n_expert, shape)
            self.matrix(name)
            return views
        whole = self.matrix(name)
        want = (n_expert * shape[0], shape[1])
        if whole.shape != want:
            raise ModelFormatError(
                f"{self._source}: expert tensor '{name}' has shape {whole.shape}, expected "
                f"{want} ({n_expert} experts of {shape} from the model's metadata)"
            )
        return whole.stacked(n_expert)

    def ffn(self, spec: ModelSpec, layer: int) -> FFNExecutor:
        self.check_vectors(spec, layer)
        if is_moe_layer(spec, self, layer):
            return moe_ffn(self, spec, layer, self._source)
        return DenseFFN(
            self.matrix(spec.layer_tensor("ffn_gate", layer)),
            self.matrix(spec.layer_tensor("ffn_up", layer)),
            self.matrix(spec.layer_tensor("ffn_down", layer)),
            spec.activation,
            expected=(spec.d_ff_of(layer), spec.d_model),
            source=self._source,
            sparsity=spec.ffn_sparsity_of(layer),
        )

    def resident_bytes(self) -> int:
        return sum(t.nbytes for t in self._matrices.values()) + sum(
            v.nbytes for v in self._vectors.values()
        )
