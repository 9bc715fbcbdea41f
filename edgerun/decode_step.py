"""Decode steps through a resident model with ~8 kernel calls a layer and no glue.

The general forward pass (model.Transformer._layers_forward) is written for any
number of tokens and any executor; for one token it spends more time in Python
between kernels than a small model spends in them (SmolLM2-135M, 2 threads: ~4.3 ms
of a 14 ms token: argument checks, reshapes, temporaries, numpy adds). A decode step
only ever has one token, so everything a layer needs is bound once, into buffers it
reuses: the projections' kernel calls (qmatvec.bound_matvecs), the attention block
(bias, q/k norm, RoPE, KV store, attention: ops/token_step.attend_token) and the
residual add with the next norm (token_step.add_normed). Only the position changes
between tokens.

It runs the same compiled kernels in the same order as the general path, so its
logits equal it bit for bit (and so batched decode, which matches the general path).
It covers resident weights (DenseFFN, ResidentProjections, an in-memory head); other
executors (offloaded, GPU, recording wrappers) take the general path, and so does a
process whose qmatvec entry points a hook has wrapped (tools/calibrate.py). The model
rebuilds the step when any of these change (Transformer._step).
"""

from __future__ import annotations

import weakref

import numpy as np

from edgerun.ffn import DenseFFN
from edgerun.kvcache import KVCache
from edgerun.ops import activations, norm, qmatvec
from edgerun.ops.attention import BatchAttention
from edgerun.ops.token_step import add_normed, attend_rows, attend_token
from edgerun.weights import ResidentProjections

__all__ = ["DecodeStep"]

_NONE = np.empty(0, np.float32)  # an absent bias or norm
# The wrapped-or-not test: a hook replaces these module attributes
_MATVEC_MANY = qmatvec.matvec_many


class _Rows:
    """Buffers and bound calls for steps of n sequences at once (n = 1: one token)."""

    def __init__(self, step: DecodeStep, n: int) -> None:
        model, s = step.model, step.spec
        f32 = np.float32
        self.n = n
        self.h, self.x, self.a = (np.zeros((n, s.d_model), f32) for _ in range(3))
        self.q, self.ctx = np.zeros((n, s.q_dim), f32), np.zeros((n, s.q_dim), f32)
        self.k, self.v = np.zeros((n, s.kv_dim), f32), np.zeros((n, s.kv_dim), f32)
        self.g, self.u, self.act = (np.zeros((n, s.d_ff), f32) for _ in range(3))
        self.positions = np.zeros(n, np.int64)
        glu = activations._glu_rows_serial
        if n * s.d_ff >= activations.PARALLEL_MIN:
            glu = activations._glu_rows  # as activations.glu chooses
        gelu = activations._GELU[model.layers[0].ffn.activation]
        if n == 1:
            x, a, act, ctx = self.x[0], self.a[0], self.act[0], self.ctx[0]
            q, k, v, g, u = self.q[0], self.k[0], self.v[0], self.g[0], self.u[0]
            bind = qmatvec.bound_matvecs
        else:
            x, a, act, ctx = self.x, self.a, self.act, self.ctx
            q, k, v, g, u = self.q, self.k, self.v, self.g, self.u
            bind = qmatvec.bound_matvecs_batch
        # per layer: (qkv, o, gate_up, down) kernel calls, then the GLU's
        self.calls = []
        for layer in model.layers:
            p, ffn = layer.attn_proj, layer.ffn
            self.calls.append(
                (
                    bind((p.q, p.k, p.v), x, (q, k, v)),
                    bind((p.o,), ctx, (a,)),
                    bind((ffn.gate, ffn.up), x, (g, u)),
                    bind((ffn.down,), act, (a,)),
                    (glu, (gelu, self.g, self.u, self.act)),
                )
            )
        self.attend: list[tuple] = []  # per layer, bound to the caches (bind_caches)
        self.key: tuple = ()  # weak references to those caches
        self._finalizers: list = []

    def bind_caches(self, step: DecodeStep, caches: list[KVCache]) -> None:
        """Bind the attention calls to these caches. Kept while the same caches come back
        (a session's next token); dropped when one of them is collected, so a dropped
        session's KV memory is not held here."""
        if len(caches) == len(self.key) and all(r() is c for r, c in zip(self.key, caches)):
            return
        self.unbind()
        s, model = step.spec, step.model
        n_ctx = max(c.n_ctx for c in caches)
        scores = np.zeros((self.n * s.n_heads, n_ctx), np.float32)
        neox = s.rope_style == "neox"
        eps, scale = step.eps, np.float32(1.0 / np.sqrt(s.head_dim))
        self.attend = []
        if self.n == 1:
            q, k, v, ctx = self.q[0], self.k[0], self.v[0], self.ctx[0]
        else:
            q, k, v, ctx = self.q, self.k, self.v, self.ctx
            # BatchAttention checks the caches and holds their addresses
            self.batch = BatchAttention([c.k for c in caches], [c.v for c in caches], [0] * self.n)
            shape = (self.n, s.n_kv_heads, s.head_dim)
            kv_new = (np.zeros(shape, caches[0].k.dtype), np.zeros(shape, caches[0].k.dtype))
        for li, (vectors, window, base) in enumerate(step.layer_args):
            cos, sin = model._rope(n_ctx, base)
            head = (q, k, v, *vectors, eps, self.positions, cos, sin, neox)
            if self.n == 1:
                c = caches[0]
                tail = (c.k[li], c.v[li], window, scale, scores, ctx)
            else:
                b = self.batch
                tail = (*kv_new, b._kaddr, b._vaddr, b._nctx, np.int64(li), window, scale,
                        scores, ctx)  # fmt: skip
            self.attend.append((*head, *tail))
        self.key = tuple(weakref.ref(c) for c in caches)
        self._finalizers = [weakref.finalize(c, self.unbind) for c in caches]

    def unbind(self) -> None:
        for f in self._finalizers:
            f.detach()
        self._finalizers, self.key, self.attend, self.batch = [], (), [], None


class DecodeStep:
    """Computes `model.forward([token], cache)` and `model.forward_batch(tokens, caches)`
    for a resident model, faster, with the same results bit for bit."""

    def __init__(self, model) -> None:
        s = model.spec
        self.model = model
        self.spec = s
        self.path = qmatvec.kernel_path()  # the kernel path its calls are bound to
        self.eps = np.float64(s.norm_eps)
        self.layer_args = []  # per layer: (q/k bias and norm vectors, window, RoPE base)
        self.norms = []  # per layer: (post-attention, FFN, post-FFN, the next norm)
        for i, layer in enumerate(model.layers):
            vectors = tuple(
                _NONE if t is None else t
                for t in (layer.q_bias, layer.k_bias, layer.v_bias, layer.q_norm, layer.k_norm)
            )
            self.layer_args.append((vectors, np.int64(s.window(i)), s.rope_base_of(i)))
            nxt = model.layers[i + 1].attn_norm if i + 1 < len(model.layers) else None
            self.norms.append(
                (
                    _NONE if layer.post_attn_norm is None else layer.post_attn_norm,
                    layer.ffn_norm,
                    _NONE if layer.post_ffn_norm is None else layer.post_ffn_norm,
                    model.output_norm if nxt is None else nxt,
                )
            )
        self._rows: dict[int, _Rows] = {}

    @staticmethod
    def supports(model) -> bool:
        """Whether every layer is resident and no hook wraps the kernel entry points."""
        if model.head is not None or qmatvec.matvec_many is not _MATVEC_MANY:
            return False
        return all(
            type(layer.attn_proj) is ResidentProjections and type(layer.ffn) is DenseFFN
            for layer in model.layers
        )

    def takes(self, caches: list[KVCache]) -> bool:
        """Whether a step of these caches takes the serial norms the general path takes
        (a few rows) and, for several, one batched attention kernel (one element type,
        writeable C-contiguous arrays), as ops/attention.BatchAttention does."""
        s = self.spec
        if len(caches) * max(s.d_model, s.q_dim) >= norm.PARALLEL_MIN:
            return False
        if len(caches) == 1:
            return True
        return BatchAttention.one_kernel([c.k for c in caches], [c.v for c in caches])

    def close(self) -> None:
        """Let go of the caches bound to (a replaced step must not keep them alive)."""
        for rows in self._rows.values():
            rows.unbind()

    def _bound(self, n: int, caches: list[KVCache]) -> _Rows:
        rows = self._rows.get(n)
        if rows is None:
            rows = self._rows[n] = _Rows(self, n)
        rows.bind_caches(self, caches)
        return rows

    def __call__(self, token: int, cache: KVCache) -> np.ndarray:
        """Logits float32 [vocab] of `token` after what `cache` holds; appends it."""
        return self.rows([token], [cache])[0]

    def rows(self, tokens: list[int], caches: list[KVCache]) -> np.ndarray:
        """Logits [n, vocab] of tokens[b] after what caches[b] holds; appends them."""
        model, s = self.model, self.spec
        n = len(tokens)
        ids, starts = model.begin_decode_step(tokens, caches)
        r = self._bound(n, caches)
        r.positions[:] = starts
        if n > 1 and ((r.positions < 0) | (r.positions >= r.batch._nctx)).any():
            raise ValueError(f"decode step: positions {starts} outside the caches")
        h, x, a, eps = r.h, r.x, r.a, self.eps
        h[:] = qmatvec.embedding_rows(model.token_embd, ids)
        if s.embed_scale != 1.0:
            h *= np.float32(s.embed_scale)
        norm._rmsnorm_serial(h, model.layers[0].attn_norm, eps, x)
        attend = attend_token if n == 1 else attend_rows
        for (qkv, o, gate_up, down, glu), att, (post_attn, ffn_norm, post_ffn, nxt) in zip(
            r.calls, r.attend, self.norms
        ):
            for k, args in qkv:
                k(*args)
            attend(*att)
            for k, args in o:
                k(*args)
            add_normed(h, a, post_attn, eps, ffn_norm, x)
            for k, args in gate_up:
                k(*args)
            glu[0](*glu[1])
            for k, args in down:
                k(*args)
            add_normed(h, a, post_ffn, eps, nxt, x)
        for c, t, p in zip(caches, tokens, starts):
            c.tokens.append(int(t))
            c.mark_written(p + 1)
        if n == 1:
            logits = qmatvec.matvec(model.output, x[0]).reshape(1, -1)
        else:
            logits = qmatvec.matvec_batch(model.output, x)
        if s.final_logit_softcap > 0:
            cap = np.float32(s.final_logit_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits
