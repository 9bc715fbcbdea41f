"""Transformer forward pass for the Llama family, driven by a ModelSpec.

Every numeric step is an ops/ kernel; weights come only through the
WeightStore, so where they live (mmap, flash, GPU) is not this module's care.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.compute_thread import compute_thread
from edgerun.decode_step import DecodeStep
from edgerun.errors import ModelFormatError
from edgerun.ffn import DenseFFN, FFNExecutor, decode_rows
from edgerun.kvcache import KVCache
from edgerun.ops import qmatvec
from edgerun.ops.attention import BatchAttention, attention
from edgerun.ops.norm import rmsnorm
from edgerun.ops.rope import rope_inplace, rope_tables
from edgerun.quant.formats import QuantTensor
from edgerun.weights import AttentionProjections, ResidentProjections, WeightStore


class _Layer:
    __slots__ = (
        "attn_norm",
        "q",
        "k",
        "v",
        "o",
        "attn_proj",
        "ffn_norm",
        "ffn",
        "q_bias",
        "k_bias",
        "v_bias",
        "q_norm",
        "k_norm",
        "post_attn_norm",
        "post_ffn_norm",
    )


def layer_matrices(layer: _Layer) -> list[QuantTensor]:
    """A layer's attention matrices and, for a dense FFN, its three."""
    ts = [layer.q, layer.k, layer.v, layer.o]
    if type(layer.ffn) is DenseFFN:
        ts += [layer.ffn.gate, layer.ffn.up, layer.ffn.down]
    return ts


class Transformer:
    """A decoder-only transformer bound to its weights."""

    def __init__(self, spec: ModelSpec, store: WeightStore, source: str = "model") -> None:
        self.spec = spec
        self.store = store
        g = spec.global_tensors
        self.token_embd = store.matrix(g["token_embd"])
        self.output_norm = store.vector(g["output_norm"])
        self.output = store.matrix(g["output"]) if store.has(g["output"]) else self.token_embd
        self.layers: list[_Layer] = []
        for i in range(spec.n_layers):
            layer = _Layer()
            layer.attn_norm = store.vector(spec.layer_tensor("attn_norm", i))
            layer.ffn_norm = store.vector(spec.layer_tensor("ffn_norm", i))
            for slot, role in (
                ("q", "attn_q"),
                ("k", "attn_k"),
                ("v", "attn_v"),
                ("o", "attn_output"),
            ):
                setattr(layer, slot, store.matrix(spec.layer_tensor(role, i)))
            optional = {
                "q_bias": ("attn_q_bias", spec.attn_bias),
                "k_bias": ("attn_k_bias", spec.attn_bias),
                "v_bias": ("attn_v_bias", spec.attn_bias),
                "q_norm": ("attn_q_norm", spec.qk_norm),
                "k_norm": ("attn_k_norm", spec.qk_norm),
                "post_attn_norm": ("post_attention_norm", spec.post_norms),
                "post_ffn_norm": ("post_ffw_norm", spec.post_norms),
            }
            for slot, (role, wanted) in optional.items():
                setattr(layer, slot, store.vector(spec.layer_tensor(role, i)) if wanted else None)
            layer.ffn = store.ffn(spec, i)
            self._check_shapes(layer, i, source)
            # q, k, v, o stay for shape checks and footprints; the projections go through
            # attn_proj, which gpu/place.move_layers may replace (model.py never changes)
            layer.attn_proj: AttentionProjections = ResidentProjections(
                layer.q, layer.k, layer.v, layer.o
            )
            self.layers.append(layer)
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
        self._rope_cache: dict[float, tuple[int, np.ndarray, np.ndarray]] = {}
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

    def _check_shapes(self, layer: _Layer, i: int, source: str) -> None:
        s = self.spec
        want = {
            "q": (s.q_dim, s.d_model),
            "k": (s.kv_dim, s.d_model),
            "v": (s.kv_dim, s.d_model),
            "o": (s.d_model, s.q_dim),
        }
        for slot, shape in want.items():
            t: QuantTensor = getattr(layer, slot)
            if t.shape != shape:
                raise ModelFormatError(
                    f"{source}: tensor '{t.name}' (layer {i}) has shape {t.shape}, expected {shape}"
                )
        ffn: FFNExecutor = layer.ffn
        if (ffn.d_ff, ffn.d_model) != (s.d_ff, s.d_model):
            raise ModelFormatError(
                f"{source}: layer {i} FFN is {ffn.d_ff}x{ffn.d_model}, "
                f"expected {s.d_ff}x{s.d_model}"
            )

    def _rope(self, n_ctx: int, base: float) -> tuple[np.ndarray, np.ndarray]:
        cached = self._rope_cache.get(base)
        if cached is None or cached[0] < n_ctx:
            cos, sin = rope_tables(n_ctx, self.spec.rope_dim, base)
            cached = self._rope_cache[base] = (n_ctx, cos, sin)
        return cached[1], cached[2]

    def _qkv(self, layer: _Layer, qkv, positions, cos, sin):
        """Projected q, k, v [n, dim] -> per-head, biased, q/k-normed and rotated."""
        s = self.spec
        q, k, v = qkv
        n = q.shape[0]
        if layer.q_bias is not None:
            q += layer.q_bias
            k += layer.k_bias
            v += layer.v_bias
        q = q.reshape(n, s.n_heads, s.head_dim)
        k = k.reshape(n, s.n_kv_heads, s.head_dim)
        v = v.reshape(n, s.n_kv_heads, s.head_dim)
        if layer.q_norm is not None:
            q = rmsnorm(q, layer.q_norm, s.norm_eps)
            k = rmsnorm(k, layer.k_norm, s.norm_eps)
        neox = s.rope_style == "neox"
        rope_inplace(q, positions, cos, sin, neox)
        rope_inplace(k, positions, cos, sin, neox)
        return q, k, v

    def forward(self, tokens: list[int], cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run `tokens` after what `cache` holds; append them to the cache.

        Returns logits float32 [len(tokens), vocab] if all_logits else [vocab]
        for the last token. Runs on the process's compute thread (compute_thread.py:
        one OpenMP pool, whichever thread calls).
        """
        return compute_thread().call(self._forward, tokens, cache, all_logits)

    def _layers_forward(self, tokens: list[int], cache: KVCache) -> np.ndarray:
        s = self.spec
        n = len(tokens)
        cache.check_fits(n)
        start = cache.length
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= s.vocab_size):
            raise ValueError(f"token id out of range [0, {s.vocab_size})")
        positions = np.arange(start, start + n, dtype=np.int64)
        if self.kv_growth is not None:
            self.kv_growth([cache], [start + n], n)
        eps = s.norm_eps
        h = qmatvec.embedding_rows(self.token_embd, ids)
        if s.embed_scale != 1.0:
            h *= np.float32(s.embed_scale)
        for li, layer in enumerate(self.layers):
            cos, sin = self._rope(cache.n_ctx, s.rope_base_of(li))
            x = rmsnorm(h, layer.attn_norm, eps)
            qkv = layer.attn_proj.qkv(x)
            q, k, v = self._qkv(layer, qkv, positions, cos, sin)
            cache.store(li, start, k, v)
            ctx = attention(q, cache.k[li], cache.v[li], start, s.window(li))
            att = layer.attn_proj.out(ctx)
            if layer.post_attn_norm is not None:
                att = rmsnorm(att, layer.post_attn_norm, eps)
            h += att
            x = rmsnorm(h, layer.ffn_norm, eps)
            f = layer.ffn(x)
            if layer.post_ffn_norm is not None:
                f = rmsnorm(f, layer.post_ffn_norm, eps)
            h += f
            if self._copied and n > 1:
                self._release_rows_read(self._copied[li], n)
        return h

    def final_hidden(self, tokens: list[int], cache: KVCache) -> np.ndarray:
        """Run `tokens` after what `cache` holds and return their final hidden states
        [len(tokens), d_model], normed as the head gets them (no head: the offloaded
        head's sketch is fitted on these, offload/head.py)."""

        def run() -> np.ndarray:
            h = self._layers_forward(tokens, cache)
            cache.tokens.extend(int(t) for t in tokens)
            return rmsnorm(h, self.output_norm, self.spec.norm_eps)

        return compute_thread().call(run)

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

    def _executors(self) -> tuple:
        return (qmatvec.kernel_path(), qmatvec.matvec_many, self.head) + tuple(
            (layer.attn_proj, layer.ffn) for layer in self.layers
        )

    def _forward(self, tokens: list[int], cache: KVCache, all_logits: bool) -> np.ndarray:
        s = self.spec
        if len(tokens) == 1 and not all_logits:
            step = self._step()
            if step is not None and step.takes([cache]):
                return step(int(tokens[0]), cache)
        eps = s.norm_eps
        h = self._layers_forward(tokens, cache)
        cache.tokens.extend(int(t) for t in tokens)
        if self.head is not None:  # streamed under a budget
            if all_logits:
                logits = self.head(rmsnorm(h, self.output_norm, eps))
            else:
                logits = self.head.next_logits(rmsnorm(h[-1:], self.output_norm, eps))[0]
        elif all_logits:
            logits = qmatvec.project(self.output, rmsnorm(h, self.output_norm, eps))
        else:
            logits = qmatvec.matvec(self.output, rmsnorm(h[-1:], self.output_norm, eps)[0])
        if self._copied and len(tokens) > 1:
            self._release_rows_read(self._copied[-1], len(tokens))  # the head's
        if s.final_logit_softcap > 0:
            cap = np.float32(s.final_logit_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits

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
        ids = np.asarray(tokens, dtype=np.int64)
        if ids.min() < 0 or ids.max() >= self.spec.vocab_size:
            raise ValueError(f"token id out of range [0, {self.spec.vocab_size})")
        starts = [c.length for c in caches]
        if self.kv_growth is not None:
            self.kv_growth(caches, [p + 1 for p in starts], len(caches))
        return ids, starts

    def _forward_batch(self, tokens: list[int], caches: list[KVCache]) -> np.ndarray:
        s = self.spec
        n = len(tokens)
        if n != len(caches) or n == 0:
            raise ValueError(f"forward_batch: {n} tokens for {len(caches)} caches")
        if len({id(c) for c in caches}) != n:
            raise ValueError("forward_batch: each sequence needs its own cache")
        step = self._step()
        if step is not None and step.takes(caches):
            return step.rows(tokens, caches)
        ids, starts = self.begin_decode_step(tokens, caches)
        positions = np.asarray(starts, dtype=np.int64)
        n_ctx = max(c.n_ctx for c in caches)
        eps = s.norm_eps
        mvb = qmatvec.matvec_batch
        h = qmatvec.embedding_rows(self.token_embd, ids)
        if s.embed_scale != 1.0:
            h *= np.float32(s.embed_scale)
        ctx = np.empty((n, s.q_dim), np.float32)
        attend = BatchAttention([c.k for c in caches], [c.v for c in caches], starts)
        for li, layer in enumerate(self.layers):
            cos, sin = self._rope(n_ctx, s.rope_base_of(li))
            x = rmsnorm(h, layer.attn_norm, eps)
            qkv = layer.attn_proj.qkv_batch(x)
            q, k, v = self._qkv(layer, qkv, positions, cos, sin)
            attend(li, q, k, v, s.window(li), ctx)
            att = layer.attn_proj.out_batch(ctx)
            if layer.post_attn_norm is not None:
                att = rmsnorm(att, layer.post_attn_norm, eps)
            h += att
            x = rmsnorm(h, layer.ffn_norm, eps)
            f = decode_rows(layer.ffn, x)
            if layer.post_ffn_norm is not None:
                f = rmsnorm(f, layer.post_ffn_norm, eps)
            h += f
        for c, t, p in zip(caches, tokens, starts):
            c.tokens.append(int(t))
            c.mark_written(p + 1)  # BatchAttention wrote row p (clear() gives pages back)
        x = rmsnorm(h, self.output_norm, eps)
        logits = mvb(self.output, x) if self.head is None else self.head.decode_batch(x)
        if s.final_logit_softcap > 0:
            cap = np.float32(s.final_logit_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits
