"""Transformer forward pass for every family, driven by a ModelSpec.

Every numeric step is an ops/ kernel; weights come only through the
WeightStore, so where they live (mmap, flash, GPU) is not this module's care.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import ModelFormatError
from edgerun.model.altup import AltUpExpand, AltUpMerge, AltUpWeights, LaurelWeights
from edgerun.model.decode_step import DecodeStep
from edgerun.model.ffn import DenseFFN, FFNExecutor
from edgerun.model.kvcache import (
    KEY_SCALE_SEED,
    KEY_SCALE_TOKENS,
    QUANTISED_KV_TYPES,
    KVCache,
    key_centre,
    key_scale,
    kv_types,
)
from edgerun.model.layer import Attention, InputNorm, Layer, Rows, Step, layer_matrices, layer_steps
from edgerun.model.mixers import build_mixer
from edgerun.model.per_layer import PerLayerInputs
from edgerun.model.state_cache import PassStates
from edgerun.model.weights import QueryProjections, ResidentProjections, WeightStore
from edgerun.ops import qmatvec
from edgerun.ops.attention import BatchAttention, attention
from edgerun.ops.rope import rope_tables
from edgerun.quant.formats import QuantTensor
from edgerun.runtime.compute_thread import compute_thread

__all__ = ["Transformer", "layer_matrices"]


class Transformer:
    """A decoder-only transformer bound to its weights."""

    def __init__(self, spec: ModelSpec, store: WeightStore, source: str = "model") -> None:
        self.spec = spec
        self.store = store
        self._source = source
        g = spec.global_tensors
        self.token_embd = store.matrix(g["token_embd"])
        self.output_norm = store.vector(g["output_norm"])
        self.output = store.matrix(g["output"]) if store.has(g["output"]) else self.token_embd
        self.layers: list[Layer] = []
        for i in range(spec.n_layers):
            layer = Layer()
            layer.mixer = None
            # no pre-norms (OLMo 2, EXAONE 4): each block reads the residual stream itself;
            # parallel blocks (Cohere) norm once per layer: the FFN reads the attention norm
            pre = spec.pre_norms
            ffn_norm = "attn_norm" if spec.parallel_blocks else "ffn_norm"
            layer.attn_norm = store.vector(spec.layer_tensor("attn_norm", i)) if pre else None
            layer.ffn_norm = store.vector(spec.layer_tensor(ffn_norm, i)) if pre else None
            if spec.mixer(i) != "attention":  # a recurrent layer: its mixer's own tensors
                self._recurrent_layer(layer, i, source)
                self.layers.append(layer)
                continue
            # a KV-shared layer (Gemma 4) has no k, v or k norm of its own
            owns_kv = spec.kv_source(i) == i
            for slot, role in (
                ("q", "attn_q"),
                ("k", "attn_k"),
                ("v", "attn_v"),
                ("o", "attn_output"),
            ):
                if (
                    slot == "v"
                    and owns_kv
                    and spec.v_norm
                    and not store.has(spec.layer_tensor(role, i))
                ):  # Gemma 4's K = V attention (attention_k_eq_v): v is k's projection
                    layer.v = layer.k
                elif owns_kv or slot in ("q", "o"):
                    setattr(layer, slot, self._layer_matrix(role, i))
                else:
                    setattr(layer, slot, None)
            optional = {
                "q_bias": ("attn_q_bias", spec.attn_bias),
                "k_bias": ("attn_k_bias", spec.attn_bias),
                "v_bias": ("attn_v_bias", spec.attn_bias),
                "q_norm": ("attn_q_norm", spec.qk_norm),
                "k_norm": ("attn_k_norm", spec.qk_norm and owns_kv),
                "post_attn_norm": ("post_attention_norm", spec.post_norms),
                "post_ffn_norm": ("post_ffw_norm", spec.post_norms),
            }
            for slot, (role, wanted) in optional.items():
                setattr(layer, slot, store.vector(spec.layer_tensor(role, i)) if wanted else None)
            self._optional_biases(layer, i)
            self._per_layer_parts(layer, i)
            layer.altup = AltUpWeights(store, spec, i, source) if spec.altup_inputs else None
            layer.laurel = LaurelWeights(store, spec, i, source) if spec.laurel else None
            layer.ffn = store.ffn(spec, i)
            self._check_shapes(layer, i, source)
            # q, k, v, o stay for shape checks and footprints; the projections go through
            # attn_proj, which gpu/place.move_layers may replace (this module never changes)
            if owns_kv:
                layer.attn_proj = ResidentProjections(layer.q, layer.k, layer.v, layer.o)
            else:
                layer.attn_proj = QueryProjections(layer.q, layer.o)
            self.layers.append(layer)
        # The layers as one program of steps (layer.py): the general path runs it, the
        # bound decode step (decode_step.py) binds it
        self.input_norm = InputNorm(self.layers[0].attn_norm, spec.norm_eps, spec.norm_kind)
        # Gemma 4's per-layer embeddings (model/per_layer.py), None without
        self.per_layer = PerLayerInputs(spec, store, source) if spec.per_layer_input else None
        self.program: list[list[Step]] = [
            layer_steps(spec, layer, i, self._norm_after(i)) for i, layer in enumerate(self.layers)
        ]
        if spec.altup_inputs:  # Gemma 3n: the AltUp streams open and close the program
            a, d = spec.altup_inputs, spec.d_model
            proj, unembd = (self._global_matrix(r) for r in ("altup_proj", "altup_unembd_proj"))
            self.program[0].insert(0, AltUpExpand(proj, a, d, source))
            merge = AltUpMerge(unembd, a, d, self.output_norm, spec.norm_eps, source)
            self.program[-1].append(merge)
        # A store may stream the head's rows under a budget (offload/store.py): logits
        # then come from its executor, asked for after the layers (the stream's order)
        head_of = getattr(store, "head_executor", None)
        tied = self.output is self.token_embd
        self.head = None if head_of is None or tied else head_of(g["output"])
        if self.token_embd.shape != (spec.vocab_size, spec.d_model):
            raise ModelFormatError(
                f"{source}: token_embd has shape {self.token_embd.shape}, expected "
                f"{(spec.vocab_size, spec.d_model)}"
            )
        self._rope_cache: dict[tuple, tuple[int, np.ndarray, np.ndarray]] = {}
        self.rope_freq_factors = self._rope_freq_factors(source)
        self.rope_factors = self._rope_factors(source)
        # Under a budget, called as kv_growth(caches, ends, tokens) before a pass of
        # `tokens` positions writes KV up to ends[i] of caches[i] (offload/kv_loan.py
        # gives rows back for its pages and temporaries)
        self.kv_growth: Callable[[Sequence[KVCache], Sequence[int], int], None] | None = None
        # decode steps of a resident model, bound once (decode_step.py); None until the
        # first one, False while the model has parts it does not cover; _decode_key: the
        # executors and kernel entry points it was decided for (_executors)
        self._decode_step: DecodeStep | bool | None = None
        self._decode_key: tuple | None = None
        # the matrices with interleaved copies whose mapped pages were let go, and how
        # (interleave_weights; empty without copies)
        self._copied: list[list[QuantTensor]] = []
        self._release: Callable[[str], int] | None = None

    def _recurrent_layer(self, layer: Layer, i: int, source: str) -> None:
        """Layer i's recurrent mixer (model/mixers.py) in place of attention, and its FFN."""
        for slot in Layer.__slots__:
            if slot not in ("attn_norm", "ffn_norm"):
                setattr(layer, slot, None)
        layer.mixer = build_mixer(self.spec, self.store, i, source)
        layer.ffn = self.store.ffn(self.spec, i)
        self._check_ffn(layer.ffn, i, source)

    def _interleave_candidates(self) -> list[QuantTensor]:
        """The matrices interleave_weights copies: resident attention and dense FFNs, and
        an in-memory head."""
        ts = []
        for layer in self.layers:
            if type(layer.attn_proj) is ResidentProjections:
                ts += [layer.q, layer.k, layer.v, layer.o]
            if type(layer.ffn) is DenseFFN:
                ts += [layer.ffn.gate, layer.ffn.up, layer.ffn.down]
        if self.head is None:
            ts.append(self.output)
        return ts

    def interleave_bytes(self) -> int:
        """About the bytes interleave_weights would add: each copied matrix's file bytes
        (a copy takes as many, plus Q4_1's / K-quants' few unpacked scales)."""
        return sum(qmatvec.copy_bytes(t) for t in self._interleave_candidates())

    def interleave_weights(self) -> int:
        """Give the resident block-format matrices (attention, dense FFNs, an in-memory
        head) interleaved copies for the decode kernels (qmatvec.interleave): one and
        several sequences' decode, and prompts, then read those. Each matrix's mapped
        pages leave this process as soon as its copy exists, so memory peaks at about one
        matrix above the file (a tied head's copy serves the embedding lookup too; an
        untied token_embd keeps its mapped rows). Returns the bytes the copies take."""
        added = 0
        release = getattr(self.store, "release_pages", None)
        tied = self.output.name == self.token_embd.name

        def copy(t: QuantTensor) -> QuantTensor:
            nonlocal added
            u = qmatvec.interleave(t)
            if u is not t:
                added += u.interleaved.nbytes
                if release is not None and (tied or t.name != self.token_embd.name):
                    release(t.name)
            return u

        for layer in self.layers:
            if type(layer.attn_proj) is ResidentProjections:
                qkvo = (layer.q, layer.k, layer.v, layer.o)
                layer.q, layer.k, layer.v, layer.o = (copy(t) for t in qkvo)
                layer.attn_proj = ResidentProjections(layer.q, layer.k, layer.v, layer.o)
            if type(layer.ffn) is DenseFFN:
                f = layer.ffn
                f.gate, f.up, f.down = copy(f.gate), copy(f.up), copy(f.down)
        if self.head is None:
            self.output = copy(self.output)
            if tied:  # the lookup reads the copy too (qmatvec.embedding_rows)
                self.token_embd = self.output
        # per layer, then the head: the copied matrices whose mapped pages a long prompt's
        # GEMM may read again (an untied token_embd keeps its own mapped rows)
        self._release = release
        self._copied = [self._with_copies(layer_matrices(layer)) for layer in self.layers]
        self._copied.append(self._with_copies([self.output]))
        self._decode_step = None  # rebound to the copies
        return added

    def _with_copies(self, ts: list[QuantTensor]) -> list[QuantTensor]:
        keep = self.token_embd.name if self.token_embd is not self.output else None
        return [t for t in ts if t.interleaved is not None and t.name != keep]

    def _release_rows_read(self, ts: list[QuantTensor], ntokens: int) -> None:
        """A prompt of ntokens past a copied matrix's batched limit took the GEMM on its
        mapped rows (qmatvec.reads_rows: the AMX GEMMs beat the copies' kernels on long
        prompts); let those pages go again as soon as the layer is done, so memory stays
        at the copies plus one layer's rows."""
        if self._release is not None:
            for t in ts:
                if qmatvec.reads_rows(t, ntokens):
                    self._release(t.name)

    def _optional_biases(self, layer: Layer, i: int) -> None:
        """Biases a family does not require but a file may carry (llama.cpp's optional
        llama biases): q/k/v when any of them is present (zeros for a missing one, as the
        kernels add all three), and the output projection's."""
        spec, store = self.spec, self.store
        if layer.q_bias is None:
            roles = (("q_bias", "attn_q_bias", spec.q_dim), ("k_bias", "attn_k_bias",
                     spec.kv_dim), ("v_bias", "attn_v_bias", spec.kv_dim))  # fmt: skip
            names = [spec.layer_tensor(role, i) for _, role, _ in roles]
            if any(store.has(n) for n in names):
                for (slot, _, width), name in zip(roles, names):
                    has = store.has(name)
                    v = self._bias(name, width) if has else np.zeros(width, np.float32)
                    setattr(layer, slot, v)
        name = spec.layer_tensors.get("attn_output_bias", "blk.{i}.attn_output.bias").format(i=i)
        layer.o_bias = self._bias(name, spec.d_model) if store.has(name) else None

    def _bias(self, name: str, width: int) -> np.ndarray:
        """A bias vector, checked against its width (the kernels index it by the spec)."""
        v = self.store.vector(name)
        if v.shape != (width,):
            raise ModelFormatError(
                f"{self._source}: tensor '{name}' should have {width} values (from the "
                f"model's metadata), found {v.size}"
            )
        return v

    def _layer_matrix(self, role: str, i: int) -> QuantTensor:
        """Layer i's matrix of a role, a clear error where the file lacks it."""
        name = self.spec.layer_tensor(role, i)
        if not self.store.has(name):
            raise ModelFormatError(f"{self._source}: tensor '{name}' (layer {i}) is missing")
        return self.store.matrix(name)

    def _global_matrix(self, role: str) -> QuantTensor:
        """A model-wide matrix of a role, a clear error where the file lacks it."""
        name = self.spec.global_tensors[role]
        if not self.store.has(name):
            raise ModelFormatError(f"{self._source}: tensor '{name}' is missing")
        return self.store.matrix(name)

    def _per_layer_parts(self, layer: Layer, i: int) -> None:
        """Gemma 4's per-layer embedding gate, projection and norm, and the layer's output
        scalar (None where the spec or the file has none), checked against the spec."""
        spec, d, w = self.spec, self.spec.d_model, self.spec.per_layer_input
        layer.ple_gate = layer.ple_proj = layer.ple_post_norm = layer.out_scale = None
        if w:
            layer.ple_gate = self._layer_matrix("ple_gate", i)
            layer.ple_proj = self._layer_matrix("ple_proj", i)
            for t, shape in ((layer.ple_gate, (w, d)), (layer.ple_proj, (d, w))):
                if t.shape != shape:
                    raise ModelFormatError(
                        f"{self._source}: tensor '{t.name}' has shape {t.shape}, expected {shape}"
                    )
            layer.ple_post_norm = self._bias(spec.layer_tensor("ple_post_norm", i), d)
        if spec.layer_output_scale:
            name = spec.layer_tensor("layer_output_scale", i)
            if self.store.has(name):
                layer.out_scale = self._bias(name, 1)

    def _rope_freq_factors(self, source: str) -> np.ndarray | None:
        """The file's per-frequency RoPE divisors (`rope_freqs.weight`, Llama 3's rope
        scaling), checked: rope_dim // 2 finite values > 0; None when it has none."""
        name = self.spec.global_tensors.get("rope_freqs", "rope_freqs.weight")
        if not self.store.has(name):
            return None
        f = self.store.vector(name)
        want = self.spec.rope_dim // 2
        if f.shape != (want,) or not (f > 0).all():
            raise ModelFormatError(
                f"{source}: tensor '{name}' should hold {want} RoPE frequency factors > 0 "
                f"(rope_dim / 2), found {f.size} values, smallest {f.min() if f.size else None}"
            )
        return f

    def _norm_after(self, i: int) -> np.ndarray | None:
        """The norm of the residual stream after layer i: the next layer's, or the output's."""
        return self.layers[i + 1].attn_norm if i + 1 < len(self.layers) else self.output_norm

    def _check_ffn(self, ffn: FFNExecutor, i: int, source: str) -> None:
        """Layer i's FFN against the spec: its width (a MoE FFN's per expert) and d_model."""
        s = self.spec
        d_ff = s.expert_ff if getattr(ffn, "n_expert", 0) else s.d_ff_of(i)
        if (ffn.d_ff, ffn.d_model) != (d_ff, s.d_model):
            raise ModelFormatError(
                f"{source}: layer {i} FFN is {ffn.d_ff}x{ffn.d_model}, expected {d_ff}x{s.d_model}"
            )

    def _check_shapes(self, layer: Layer, i: int, source: str) -> None:
        s = self.spec
        q_dim, kv_dim = s.n_heads * s.head_dim_of(i), s.kv_heads_of(i) * s.head_dim_of(i)
        want = {
            "q": (q_dim * (2 if s.attn_output_gate else 1), s.d_model),
            "k": (kv_dim, s.d_model),
            "v": (kv_dim, s.d_model),
            "o": (s.d_model, q_dim),
        }
        for slot, shape in want.items():
            t: QuantTensor | None = getattr(layer, slot)
            if t is not None and t.shape != shape:
                raise ModelFormatError(
                    f"{source}: tensor '{t.name}' (layer {i}) has shape {t.shape}, expected {shape}"
                )
        self._check_ffn(layer.ffn, i, source)

    def _rope(
        self, n_ctx: int, base: float | None, dim: int = 0, freqs: bool = True
    ) -> tuple[np.ndarray, np.ndarray]:
        """The RoPE tables of a base (None: no rotation) for n_ctx positions, cached.
        dim, freqs: a layer's own RoPE dims and whether it takes the file's rope_freqs
        (where layers differ: Gemma 4); 0 is the spec's rope_dim."""
        factors, long = self.rope_freq_factors, False
        if self.rope_factors is not None:
            # LongRoPE, as llama.cpp: a context past the trained one takes the long factors
            long = n_ctx > self.spec.rope_orig_context
            factors = self.rope_factors[long]
        key = (base, long) if not dim else (base, long, dim, freqs)
        if not freqs:
            factors = None
        cached = self._rope_cache.get(key)
        if cached is None or cached[0] < n_ctx:
            s = self.spec
            yarn = None
            if s.yarn_orig_context:  # YaRN: rope_scale through its ramp
                yarn = (s.rope_scale, s.yarn_orig_context, s.yarn_beta_fast, s.yarn_beta_slow)
            elif s.rope_scale != 1.0:  # linear scaling: every frequency times rope_scale
                ones = np.ones(s.rope_dim // 2)
                factors = (ones if factors is None else factors) / s.rope_scale
            if dim and factors is not None and factors.shape[0] != dim // 2:
                raise ModelFormatError(
                    f"{self._source}: rope_freqs holds {factors.shape[0]} factors, a layer "
                    f"rotating {dim} dims needs {dim // 2}"
                )
            cos, sin = rope_tables(n_ctx, dim or s.rope_dim, base, factors, s.rope_attn_factor,
                                   yarn)  # fmt: skip
            cached = self._rope_cache[key] = (n_ctx, cos, sin)
        return cached[1], cached[2]

    def _rope_factors(self, source: str) -> tuple[np.ndarray, np.ndarray] | None:
        """LongRoPE's (short, long) frequency factors [rope_dim / 2], or None without."""
        s = self.spec
        if s.rope_orig_context == 0:
            return None
        pair = []
        for role in ("rope_factors_short", "rope_factors_long"):
            name = s.global_tensors[role]
            if not self.store.has(name):
                raise ModelFormatError(
                    f"{source}: tensor '{name}' is missing (the metadata asks for LongRoPE)"
                )
            f = np.asarray(self.store.vector(name), dtype=np.float64).reshape(-1)
            if f.shape != (s.rope_dim // 2,) or not (np.isfinite(f).all() and (f > 0).all()):
                raise ModelFormatError(
                    f"{source}: tensor '{name}' should hold {s.rope_dim // 2} finite factors "
                    f"> 0, found shape {f.shape}"
                )
            pair.append(f)
        return pair[0], pair[1]

    def forward(self, tokens: list[int], cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run `tokens` after what `cache` holds; append them to the cache.

        Returns logits float32 [len(tokens), vocab] if all_logits else [vocab]
        for the last token. Runs on the process's compute thread (compute_thread.py:
        one OpenMP pool, whichever thread calls).
        """
        return compute_thread().call(self._forward, tokens, cache, all_logits)

    def embed(self, ids: np.ndarray) -> np.ndarray:
        """The residual stream's first rows: token embeddings [n, d_model], scaled."""
        h = qmatvec.embedding_rows(self.token_embd, ids)
        if self.spec.embed_scale != 1.0:
            h *= np.float32(self.spec.embed_scale)
        return h

    def check_ids(self, tokens: list[int]) -> np.ndarray:
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.spec.vocab_size):
            raise ValueError(f"token id out of range [0, {self.spec.vocab_size})")
        return ids

    def _run_layers(self, rows: Rows, release: bool = False) -> np.ndarray:
        """The general path: every step of the program on these rows. Returns the final
        hidden states, normed as the head takes them. release: let each copied matrix's
        mapped rows go after its layer (a prompt past the copies' batched limit)."""
        self.input_norm.run(rows)
        n = rows.h.shape[0]
        for li, steps in enumerate(self.program):
            for step in steps:
                step.run(rows)
            if release:
                self._release_rows_read(self._copied[li], n)
        return rows.x

    def _prompt_forward(self, tokens: list[int], cache: KVCache) -> np.ndarray:
        """Run `tokens` after what `cache` holds through the layers; their final hidden
        states [n, d_model], normed. The cache holds their KV rows, not yet their ids."""
        n = len(tokens)
        cache.check_fits(n)
        start = cache.length
        ids = self.check_ids(tokens)
        positions = np.arange(start, start + n, dtype=np.int64)
        if self.kv_growth is not None:
            self.kv_growth([cache], [start + n], n)

        def attend(li: int, q, k, v, window: int, softcap: float) -> np.ndarray:
            if self.spec.layered:  # per-layer shapes or shared KV (Gemma 4)
                if k is not None:
                    cache.store(li, start, k, v)
                kl, vl = cache.layer(li)
                end = start + n
                return attention(q, kl[:, :end], vl[:, :end], start, window, softcap=softcap)
            cache.store(li, start, k, v)
            q = cache.scaled_queries(li, q)
            return attention(q, cache.k[li], cache.v[li], start, window, softcap=softcap)

        rope = lambda base, *kind: self._rope(cache.n_ctx, base, *kind)  # noqa: E731
        states = PassStates([cache.state], [start], decode=False)
        rows = Rows(self.embed(ids), positions, False, attend, rope, states)
        self._add_per_layer(rows, ids)
        x = self._run_layers(rows, release=bool(self._copied) and n > 1)
        if n > 1:  # a prompt's end: a position a later prompt may go back to
            cache.state.snapshot(start + n)
        return x

    def _add_per_layer(self, rows: Rows, ids: np.ndarray) -> None:
        """The rows' per-layer embeddings, where the model has them (Gemma 4)."""
        if self.per_layer is not None:
            rows.ple = self.per_layer(ids, rows.h, rows.decode)

    def final_hidden(self, tokens: list[int], cache: KVCache) -> np.ndarray:
        """Run `tokens` after what `cache` holds and return their final hidden states
        [len(tokens), d_model], normed as the head gets them (no head: the offloaded
        head's sketch is fitted on these, offload/head.py)."""

        def run() -> np.ndarray:
            x = self._prompt_forward(tokens, cache)
            cache.tokens.extend(int(t) for t in tokens)
            return x

        return compute_thread().call(run)

    def final_hidden_batch(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        """Several independent sequences, each from position 0, through the layers in one
        pass: their rows are stacked so every projection reads its weights once for all of
        them, and each sequence attends only to its own keys (held as float32 for the pass,
        as an f32 KVCache holds them, so a sequence's states equal `final_hidden` of it
        alone on such a cache). Returns each sequence's final hidden states [n_i, d_model],
        normed as the head gets them. Nothing is cached."""
        return compute_thread().call(self._final_hidden_batch, sequences)

    def _final_hidden_batch(self, sequences: Sequence[Sequence[int]]) -> list[np.ndarray]:
        lengths = [len(s) for s in sequences]
        if not lengths or min(lengths) == 0:
            raise ValueError("final_hidden_batch: every sequence needs at least one token")
        if self.spec.recurrent_layers:  # each sequence's states from its own first token
            return [self._prompt_forward(list(s), KVCache(self.spec, len(s))) for s in sequences]
        bounds = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        ids = self.check_ids([int(t) for s in sequences for t in s])
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])
        n_ctx = max(lengths)

        shared: dict[int, tuple] = {}  # a KV source layer's rows, for the layers sharing them

        def attend(li: int, q, k, v, window: int, softcap: float) -> np.ndarray:
            if k is None:
                k, v = shared[self.spec.kv_source(li)]
            elif self.spec.layer_kv_source:
                shared[li] = (k, v)
            ctx = np.empty((q.shape[0], q.shape[1] * q.shape[2]), np.float32)
            for a, b in zip(bounds[:-1], bounds[1:]):
                ks = np.ascontiguousarray(k[a:b].transpose(1, 0, 2), dtype=np.float32)
                vs = np.ascontiguousarray(v[a:b].transpose(1, 0, 2), dtype=np.float32)
                ctx[a:b] = attention(q[a:b], ks, vs, 0, window, softcap=softcap)
            return ctx

        rope = lambda base, *kind: self._rope(n_ctx, base, *kind)  # noqa: E731
        rows = Rows(self.embed(ids), positions, False, attend, rope)
        self._add_per_layer(rows, ids)
        x = self._run_layers(rows, release=bool(self._copied) and len(ids) > 1)
        return [x[a:b] for a, b in zip(bounds[:-1], bounds[1:])]

    def softcap(self, logits: np.ndarray) -> np.ndarray:
        """The logits' last touches where the spec has them: division by logit_scale
        (Granite), then final logit softcapping (Gemma 2/3)."""
        if self.spec.logit_scale != 1.0:
            logits = logits / np.float32(self.spec.logit_scale)
        cap = self.spec.final_logit_softcap
        if cap > 0:
            c = np.float32(cap)
            logits = np.tanh(logits / c) * c
        return logits

    def _step(self) -> DecodeStep | None:
        """The bound decode step while it covers this model: rebuilt when what it bound
        changes (a layer's executor, the kernel path, a hook on the kernel entry points)."""
        key = self._executors()
        if self._decode_step is None or key != self._decode_key:
            if isinstance(self._decode_step, DecodeStep):
                self._decode_step.close()
            self._decode_step = DecodeStep(self) if DecodeStep.supports(self) else False
            self._decode_key = key
        return self._decode_step or None

    @functools.cached_property
    def key_centres(self) -> np.ndarray | None:
        """Each attention layer's key centre [attention layers, kv_heads, head_dim]
        (kvcache.key_centre: the k bias on the pairs RoPE barely turns), which a
        cache of q8_0 / q4_0 keys subtracts from every key; None where no centre applies:
        no k bias, an attention softcap (tanh(s / cap) of a shifted score is no longer a
        shifted score, so the softmax would change), layers that differ in shape (Gemma
        4). A layer whose k bias a k norm follows has a zero centre (the norm's output
        carries no fixed offset). Computed once; every cache of this model shares it."""
        s = self.spec
        if s.attn_softcap > 0 or s.layered:
            return None
        out = np.zeros((len(s.attention_layers), s.n_kv_heads, s.head_dim), np.float32)
        found = False
        for steps in self.program:
            for step in steps:
                if not isinstance(step, Attention):
                    continue
                layer, bias = step.layer, step.layer.k_bias
                if bias is None or layer.k_norm is not None:
                    continue
                cos, sin = self._rope(2, step.base)
                b = np.asarray(bias, np.float32).reshape(s.n_kv_heads, s.head_dim)
                out[step.slot] = key_centre(b, cos, sin, s.context_length, step.neox)
                found = True
        return out if found else None

    @functools.cached_property
    def key_scales(self) -> np.ndarray | None:
        """Each attention layer's key scales [attention layers, kv_heads, head_dim]
        (kvcache.key_scale: powers of two balancing the queries' and the centred keys'
        channel energies), by which a cache of q8_0 / q4_0 keys divides every key and
        multiplies every query; None where layers differ in shape (Gemma 4). Set by one
        pass of KEY_SCALE_TOKENS fixed token ids on a float32 cache, run the first time a
        cache of quantised keys is made; every cache of this model shares it."""
        s = self.spec
        if s.layered or not s.attention_layers:
            return None
        q_energy, k_energy = compute_thread().call(self._key_energies)
        neox = s.rope_style == "neox"
        return np.stack([key_scale(q, k, neox) for q, k in zip(q_energy, k_energy)])

    def _key_energies(self) -> tuple[np.ndarray, np.ndarray]:
        """The mean square per channel of every attention layer's queries (over the query
        heads of each KV head) and centred keys on KEY_SCALE_TOKENS fixed token ids:
        float64 [attention layers, kv_heads, head_dim] each."""
        s = self.spec
        n = min(KEY_SCALE_TOKENS, s.context_length or KEY_SCALE_TOKENS)
        ids = np.random.default_rng(KEY_SCALE_SEED).integers(0, s.vocab_size, n)
        cache = KVCache(s, n)  # float32 rows: the keys as they are
        centres = self.key_centres
        shape = (len(s.attention_layers), s.n_kv_heads, s.head_dim)
        q_energy, k_energy = np.zeros(shape), np.zeros(shape)

        def attend(li: int, q, k, v, window: int, softcap: float) -> np.ndarray:
            hkv, hd = k.shape[1], k.shape[2]
            q64 = q.astype(np.float64).reshape(n, hkv, q.shape[1] // hkv, hd)
            q_energy[li] = (q64 * q64).mean((0, 2))
            kc = k.astype(np.float64) - (0.0 if centres is None else centres[li])
            k_energy[li] = (kc * kc).mean(0)
            cache.store(li, 0, k, v)
            return attention(q, cache.k[li], cache.v[li], 0, window, softcap=softcap)

        positions = np.arange(n, dtype=np.int64)
        rope = lambda base, *kind: self._rope(n, base, *kind)  # noqa: E731
        states = PassStates([cache.state], [0], decode=False)
        h = self.embed(self.check_ids(ids.tolist()))
        rows = Rows(h, positions, False, attend, rope, states)
        self._add_per_layer(rows, ids)
        self._run_layers(rows)
        return q_energy, k_energy

    def new_cache(self, n_ctx: int, kv_type: str = "f32") -> KVCache:
        """An empty KV cache of this model: kv_type's rows, keys centred and scaled where
        they are quantised (key_centres, key_scales)."""
        if kv_types(kv_type)[0] not in QUANTISED_KV_TYPES:
            return KVCache(self.spec, n_ctx, kv_type)
        return KVCache(self.spec, n_ctx, kv_type, self.key_centres, self.key_scales)

    def decode_kernels(self, cache: KVCache) -> list[tuple]:
        """One call of each kernel a one-token step on `cache` runs (DecodeStep.kernels;
        none where the bound step does not take this model or cache)."""
        step = self._step()
        return step.kernels(cache) if step is not None and step.takes([cache]) else []

    def _executors(self) -> tuple:
        return (qmatvec.kernel_path(), qmatvec.matvec_many, self.head) + tuple(
            (layer.attn_proj, layer.ffn) for layer in self.layers
        )

    def _forward(self, tokens: list[int], cache: KVCache, all_logits: bool) -> np.ndarray:
        if len(tokens) == 1 and not all_logits:
            step = self._step()
            if step is not None and step.takes([cache]):
                return step(int(tokens[0]), cache)
        x = self._prompt_forward(tokens, cache)
        cache.tokens.extend(int(t) for t in tokens)
        if self.head is not None:  # streamed under a budget
            logits = self.head(x) if all_logits else self.head.next_logits(x[-1:])[0]
        elif all_logits:
            logits = qmatvec.project(self.output, x)
        else:
            logits = qmatvec.matvec(self.output, x[-1])
        if self._copied and len(tokens) > 1:
            self._release_rows_read(self._copied[-1], len(tokens))  # the head's
        return self.softcap(logits)

    def forward_batch(self, tokens: list[int], caches: list[KVCache]) -> np.ndarray:
        """One decode step of several sequences: token b after what caches[b] holds.

        The projections read each weight once for all sequences (qmatvec.matvec_batch);
        attention runs per sequence on its own cache. Row b of the logits [n, vocab] equals
        `forward([tokens[b]], caches[b])` bit for bit, so a session decodes the same tokens
        alone or batched with others. Runs on the process's compute thread, as forward.
        """
        return compute_thread().call(self._forward_batch, tokens, caches)

    def begin_decode_step(
        self, tokens: list[int], caches: Sequence[KVCache]
    ) -> tuple[np.ndarray, list[int]]:
        """Check a decode step (room in each cache, token ids in the vocabulary) and let
        a budget make room for the new KV rows; returns the ids and each cache's position."""
        for c in caches:
            c.check_fits(1)
        ids = self.check_ids(tokens)
        starts = [c.length for c in caches]
        if self.kv_growth is not None:
            self.kv_growth(caches, [p + 1 for p in starts], len(caches))
        return ids, starts

    def verify(self, tokens: list[int], cache: KVCache) -> np.ndarray:
        """Speculative decoding's verification pass: logits [n, vocab] of each of
        `tokens` (the last sampled token, then the drafted ones) after what `cache` holds
        and the tokens before it; appends them all (the caller truncates the rejected
        ones). Each weight is read once for the n rows, and row i equals the one-token
        step `forward([tokens[i]], cache)` would give at that point bit for bit: the rows
        go through the batched decode kernels (the resident bound step, or the general
        path's batched rows, streamed once under a budget) with one cache at
        consecutive positions. Runs on the process's compute thread, as forward."""
        return compute_thread().call(self._verify, tokens, cache)

    def begin_verify(self, tokens: list[int], cache: KVCache) -> tuple[np.ndarray, int]:
        """Check a verification pass (room for every token, ids in the vocabulary) and let
        a budget make room for its KV rows; returns the ids and the first position."""
        cache.check_fits(len(tokens))
        ids = self.check_ids(tokens)
        start = cache.length
        if self.kv_growth is not None:
            self.kv_growth([cache], [start + len(tokens)], len(tokens))
        return ids, start

    def _verify(self, tokens: list[int], cache: KVCache) -> np.ndarray:
        n = len(tokens)
        if n == 0:
            raise ValueError("verify: no tokens")
        if n == 1:
            return self._forward(tokens, cache, False).reshape(1, -1)
        step = self._step()
        if step is not None and step.takes([cache] * n):
            return step.verify(tokens, cache)
        ids, start = self.begin_verify(tokens, cache)
        x = self._decode_rows(tokens, [cache] * n, ids, list(range(start, start + n)))
        if self.head is None:
            logits = qmatvec.matvec_batch(self.output, x)
        else:  # each row's own candidates, as a one-token step reads them
            logits = np.concatenate([self.head.next_logits(x[i : i + 1]) for i in range(n)])
        return self.softcap(logits)

    def _forward_batch(self, tokens: list[int], caches: list[KVCache]) -> np.ndarray:
        n = len(tokens)
        if n != len(caches) or n == 0:
            raise ValueError(f"forward_batch: {n} tokens for {len(caches)} caches")
        if len({id(c) for c in caches}) != n:
            raise ValueError("forward_batch: each sequence needs its own cache")
        step = self._step()
        if step is not None and step.takes(caches):
            return step.rows(tokens, caches)
        ids, starts = self.begin_decode_step(tokens, caches)
        x = self._decode_rows(tokens, caches, ids, starts)
        logits = (
            qmatvec.matvec_batch(self.output, x) if self.head is None else self.head.decode_batch(x)
        )
        return self.softcap(logits)

    def _decode_rows(
        self, tokens: list[int], caches: list[KVCache], ids: np.ndarray, starts: list[int]
    ) -> np.ndarray:
        """The general path's batched decode rows: token b at position starts[b] of
        caches[b] (one cache may come back at consecutive positions: a verification
        pass) through the batched kernels; appends the tokens and returns the final
        hidden rows [n, d_model]."""
        n_ctx = max(c.n_ctx for c in caches)
        if self.spec.layered:  # per-layer shapes or shared KV (Gemma 4): row by row
            attend = self._layered_rows_attend(caches, starts)
        else:
            ctx = np.empty((len(tokens), self.spec.q_dim), np.float32)
            batch = BatchAttention(
                [c.k for c in caches], [c.v for c in caches], starts,
                [c.key_centre for c in caches], [c.key_scale for c in caches],
            )  # fmt: skip

            def attend(li: int, q, k, v, window: int, softcap: float) -> np.ndarray:
                batch(li, q, k, v, window, ctx, softcap)
                return ctx

        rope = lambda base, *kind: self._rope(n_ctx, base, *kind)  # noqa: E731
        states = PassStates([c.state for c in caches], starts, decode=True)
        positions = np.asarray(starts, dtype=np.int64)
        rows = Rows(self.embed(ids), positions, True, attend, rope, states)
        self._add_per_layer(rows, ids)
        x = self._run_layers(rows)
        states.finish()
        for c, t, p in zip(caches, tokens, starts):
            c.tokens.append(int(t))
            c.mark_written(p + 1)  # BatchAttention wrote row p (clear() gives pages back)
        return x

    def _layered_rows_attend(self, caches: list[KVCache], starts: list[int]) -> Callable:
        """Decode rows' attention where layers differ in shape or share KV: row b stores
        its k, v (a KV-shared layer stores none) in caches[b] at starts[b], then attends
        as a one-token pass does (the rows of one cache at consecutive positions, a
        verification pass, each see the ones before them)."""

        def attend(li: int, q, k, v, window: int, softcap: float) -> np.ndarray:
            out = np.empty((q.shape[0], q.shape[1] * q.shape[2]), np.float32)
            for b, (c, p) in enumerate(zip(caches, starts)):
                if k is not None:
                    c.store(li, p, k[b : b + 1], v[b : b + 1])
                kl, vl = c.layer(li)
                out[b] = attention(
                    q[b : b + 1], kl[:, : p + 1], vl[:, : p + 1], p, window, softcap=softcap
                )[0]
            return out

        return attend
