"""One decode token through a resident model with ~8 kernel calls a layer and no glue.

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
process whose qmatvec entry points a hook has wrapped (tools/calibrate.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import numpy as np

from edgerun.ffn import DenseFFN
from edgerun.kvcache import KVCache
from edgerun.ops import activations, norm, qmatvec
from edgerun.ops.token_step import add_normed, attend_token
from edgerun.weights import ResidentProjections

__all__ = ["DecodeStep"]

_NONE = np.empty(0, np.float32)  # an absent bias or norm
# The wrapped-or-not test: a hook replaces these module attributes
_MATVEC_MANY = qmatvec.matvec_many


class _LayerCalls:
    """One layer's bound calls; `attend` and `window` are per cache (see _for_cache)."""

    __slots__ = ("qkv", "o", "gate_up", "glu", "down", "attn_vectors", "post_attn", "ffn_norm",
                 "post_ffn", "next_norm", "rope_base", "window")  # fmt: skip


class DecodeStep:
    """Computes `model.forward([token], cache)` for a resident model, faster."""

    def __init__(self, model) -> None:
        s = model.spec
        self.model = model
        self.spec = s
        self.path = qmatvec.kernel_path()
        self.layers = [(layer.attn_proj, layer.ffn) for layer in model.layers]
        f32 = np.float32
        d, qd, kvd, dff = s.d_model, s.q_dim, s.kv_dim, s.d_ff
        self.h = np.zeros((1, d), f32)
        self.x = np.zeros((1, d), f32)
        self.a = np.zeros((1, d), f32)  # attention output / FFN output
        self.q, self.k, self.v = np.zeros(qd, f32), np.zeros(kvd, f32), np.zeros(kvd, f32)
        self.ctx = np.zeros(qd, f32)
        self.g, self.u, self.act = (np.zeros((1, dff), f32) for _ in range(3))
        self.positions = np.zeros(1, np.int64)
        self.eps = np.float64(s.norm_eps)
        self.scale = np.float32(1.0 / np.sqrt(s.head_dim))
        glu = activations._glu_rows_serial
        if dff >= activations.PARALLEL_MIN:
            glu = activations._glu_rows
        gelu = activations._GELU[model.layers[0].ffn.activation]
        x0, a0 = self.x[0], self.a[0]
        self.calls: list[_LayerCalls] = []
        for i, layer in enumerate(model.layers):
            c = _LayerCalls()
            p, ffn = layer.attn_proj, layer.ffn
            c.qkv = qmatvec.bound_matvecs((p.q, p.k, p.v), x0, (self.q, self.k, self.v))
            c.o = qmatvec.bound_matvecs((p.o,), self.ctx, (a0,))
            c.gate_up = qmatvec.bound_matvecs((ffn.gate, ffn.up), x0, (self.g[0], self.u[0]))
            c.glu = (glu, (gelu, self.g, self.u, self.act))
            c.down = qmatvec.bound_matvecs((ffn.down,), self.act[0], (a0,))
            c.attn_vectors = tuple(
                _NONE if t is None else t
                for t in (layer.q_bias, layer.k_bias, layer.v_bias, layer.q_norm, layer.k_norm)
            )
            c.post_attn = _NONE if layer.post_attn_norm is None else layer.post_attn_norm
            c.ffn_norm = layer.ffn_norm
            c.post_ffn = _NONE if layer.post_ffn_norm is None else layer.post_ffn_norm
            nxt = model.layers[i + 1].attn_norm if i + 1 < len(model.layers) else None
            c.next_norm = model.output_norm if nxt is None else nxt
            c.rope_base = s.rope_base_of(i)
            c.window = np.int64(s.window(i))
            self.calls.append(c)
        self.first_norm = model.layers[0].attn_norm
        self._per_cache: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def supports(model) -> bool:
        """Whether every layer is resident, the sizes take the serial small ops and no hook
        wraps the kernel entry points."""
        s = model.spec
        if max(s.d_model, s.q_dim) >= norm.PARALLEL_MIN or model.head is not None:
            return False
        if qmatvec.matvec_many is not _MATVEC_MANY:
            return False
        return all(
            type(layer.attn_proj) is ResidentProjections and type(layer.ffn) is DenseFFN
            for layer in model.layers
        )

    def current(self, model) -> bool:
        """Still bound to what the model computes with (kernel path, executors, hooks)?"""
        return (
            self.path == qmatvec.kernel_path()
            and qmatvec.matvec_many is _MATVEC_MANY
            and all(
                layer.attn_proj is p and layer.ffn is f
                for layer, (p, f) in zip(model.layers, self.layers)
            )
        )

    def _for_cache(self, cache: KVCache) -> list[tuple[Callable, tuple]]:
        """The attention calls bound to one cache's arrays (kept while the cache lives)."""
        got = self._per_cache.get(cache)
        if got is not None and got[0] is cache.k and got[1] is cache.v:
            return got[2]
        s = self.spec
        scores = np.zeros((s.n_heads, cache.n_ctx), np.float32)
        neox = s.rope_style == "neox"
        out = []
        for li, c in enumerate(self.calls):
            cos, sin = self.model._rope(cache.n_ctx, c.rope_base)
            qkv = (self.q, self.k, self.v, *c.attn_vectors, self.eps, self.positions)
            kv = (cache.k[li], cache.v[li], c.window, self.scale, scores, self.ctx)
            out.append((*qkv, cos, sin, neox, *kv))
        self._per_cache[cache] = (cache.k, cache.v, out)
        return out

    def __call__(self, token: int, cache: KVCache) -> np.ndarray:
        """Logits float32 [vocab] of `token` after what `cache` holds; appends it."""
        model, s = self.model, self.spec
        cache.check_fits(1)
        if not 0 <= token < s.vocab_size:
            raise ValueError(f"token id out of range [0, {s.vocab_size})")
        start = cache.length
        if model.kv_growth is not None:
            model.kv_growth([cache], [start + 1])
        attend = self._for_cache(cache)
        self.positions[0] = start
        h, x, a, eps = self.h, self.x, self.a, self.eps
        h[:] = qmatvec.embedding_rows(model.token_embd, np.array([token], np.int64))
        if s.embed_scale != 1.0:
            h *= np.float32(s.embed_scale)
        norm._rmsnorm_serial(h, self.first_norm, eps, x)
        for c, att in zip(self.calls, attend):
            for k, args in c.qkv:
                k(*args)
            attend_token(*att)
            for k, args in c.o:
                k(*args)
            add_normed(h, a, c.post_attn, eps, c.ffn_norm, x)
            for k, args in c.gate_up:
                k(*args)
            c.glu[0](*c.glu[1])
            for k, args in c.down:
                k(*args)
            add_normed(h, a, c.post_ffn, eps, c.next_norm, x)
        cache.tokens.append(int(token))
        cache.mark_written(start + 1)
        logits = qmatvec.matvec(model.output, x[0])
        if s.final_logit_softcap > 0:
            cap = np.float32(s.final_logit_softcap)
            logits = np.tanh(logits / cap) * cap
        return logits
