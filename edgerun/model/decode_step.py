"""Decode steps through a resident model with a few kernel calls a layer and no glue.

The general forward pass runs the model's program of layer steps (layer.py) for any
number of tokens and any executor; for one token it spends more time in Python between
kernels than a small model spends in them. A decode step only ever has one token per
sequence, so each step of the program is bound once (`Step.bind`) into kernel calls on
buffers it reuses, and a token replays that flat list of calls: only the positions
change between tokens. The attention kernel is bound to the caches of the sequences
(`Attention.bind_attention`), kept while the same caches come back.

It runs the same compiled kernels in the same order as the general path, so its logits
equal it bit for bit (and so batched decode, which matches the general path). It covers
resident weights (every step `bindable`: DenseFFN, ResidentProjections, an in-memory
head); other executors (offloaded, GPU, recording wrappers) take the general path, and
so does a process whose qmatvec entry points a hook has wrapped (tools/calibrate.py).
The model rebuilds the step when any of these change (Transformer._step).
"""

from __future__ import annotations

import weakref

import numpy as np
from numba.core.dispatcher import Dispatcher

from edgerun.model.kvcache import KVCache
from edgerun.model.layer import ATTEND, Attention, BoundRows, Call, StateSlot
from edgerun.ops import norm, qmatvec
from edgerun.ops.attention import BatchAttention

__all__ = ["DecodeStep"]

# The wrapped-or-not test: a hook replaces these module attributes
_MATVEC_MANY = qmatvec.matvec_many


class _Rows(BoundRows):
    """Buffers and bound calls for steps of n sequences at once (n = 1: one token)."""

    def __init__(self, step: DecodeStep, n: int) -> None:
        super().__init__(step.spec, n)
        model = step.model
        # the program's calls, ATTEND where a layer's attention kernels go
        self.layout: list = list(model.input_norm.bind(self))
        self.attention: list[Attention] = []  # in the order of the ATTEND slots
        for steps in model.program:
            for s in steps:
                self.layout += s.bind(self)
                if isinstance(s, Attention):
                    self.attention.append(s)
        self.calls: list = []  # the layout bound to the caches (bind_caches)
        self.batch: BatchAttention | None = None
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
        if self.n > 1:  # BatchAttention checks the caches and holds their addresses
            self.batch = BatchAttention(
                [c.k for c in caches], [c.v for c in caches], [0] * self.n,
                [c.key_centre for c in caches], [c.key_scale for c in caches],
            )  # fmt: skip
        attend = iter(
            a.bind_attention(self, caches, *model._rope(n_ctx, a.base), scores, self.batch)
            for a in self.attention
        )
        self.calls = []
        for c in self.layout:  # a recurrent layer's slot: its calls on the caches' states
            if isinstance(c, StateSlot):
                self.calls += c.bind(caches)
            else:
                self.calls += next(attend) if c is ATTEND else [c]
        self.key = tuple(weakref.ref(c) for c in caches)
        self._finalizers = [weakref.finalize(c, self.unbind) for c in caches]

    def unbind(self) -> None:
        for f in self._finalizers:
            f.detach()
        self._finalizers, self.key, self.calls, self.batch = [], (), [], None


class DecodeStep:
    """Computes `model.forward([token], cache)` and `model.forward_batch(tokens, caches)`
    for a resident model, faster, with the same results bit for bit."""

    def __init__(self, model) -> None:
        self.model = model
        self.spec = model.spec
        self.path = qmatvec.kernel_path()  # the kernel path its calls are bound to
        self._rows: dict[int, _Rows] = {}

    @staticmethod
    def supports(model) -> bool:
        """Whether every layer is resident and no hook wraps the kernel entry points."""
        if model.head is not None or qmatvec.matvec_many is not _MATVEC_MANY:
            return False
        return all(step.bindable() for steps in model.program for step in steps)

    def takes(self, caches: list[KVCache]) -> bool:
        """Whether a step of these caches takes the serial norms the general path takes
        (a few rows) and, for several, one batched attention kernel (one element type,
        writeable C-contiguous arrays), as ops/attention.BatchAttention does."""
        s = self.spec
        if len(caches) * max(s.d_model, s.q_dim) >= norm.PARALLEL_MIN:
            return False
        if s.recurrent_layers and len({id(c) for c in caches}) < len(caches):
            return False  # one sequence's rows chain its states (the general path's)
        if len(caches) == 1:
            return True
        return BatchAttention.one_kernel(
            [c.k for c in caches],
            [c.v for c in caches],
            [c.key_centre for c in caches],
            [c.key_scale for c in caches],
        )

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

    def kernels(self, cache: KVCache) -> list[Call]:
        """One call of each compiled kernel a one-token step on `cache` runs, bound to this
        step's buffers, the embedding's and the output head's included: the attention's
        first, then the matvecs' and the embedding's, then the small ones (their compile
        times' order). A first run compiles them in parallel processes, one a part
        (Engine.warm_part "decode:i"); each runs once on scratch values, which none of
        them needs in any order."""
        model = self.model
        r = self._bound(1, [cache])
        head = (qmatvec.matvec, (model.output, r.x[0]))
        embed = (model.embed, (model.check_ids([0]),))  # its format's row dequantiser
        calls: dict = {"embed": embed, "head": head}
        for kernel, args in r.calls:
            if isinstance(kernel, Dispatcher):
                calls.setdefault(kernel, (kernel, args))

        def rank(call: Call) -> int:
            module = getattr(call[0], "__module__", "") or ""
            if module.startswith("edgerun.ops.attention"):
                return 0
            heavy = call is head or call is embed
            return 1 if heavy or ".int8." in module or ".portable." in module else 2

        return sorted(calls.values(), key=rank)

    def __call__(self, token: int, cache: KVCache) -> np.ndarray:
        """Logits float32 [vocab] of `token` after what `cache` holds; appends it."""
        return self.rows([token], [cache])[0]

    def rows(self, tokens: list[int], caches: list[KVCache]) -> np.ndarray:
        """Logits [n, vocab] of tokens[b] after what caches[b] holds; appends them."""
        ids, starts = self.model.begin_decode_step(tokens, caches)
        return self._run(tokens, caches, ids, starts)

    def verify(self, tokens: list[int], cache: KVCache) -> np.ndarray:
        """Logits [n, vocab] of each of `tokens` after what `cache` holds and the tokens
        before it; appends them (speculative decoding's verification pass). The n rows
        are the batched step's rows with one cache at consecutive positions: the kernel
        stores every row's key and value before any row attends, and each row attends up
        to its own position, so row i equals a one-token step's logits bit for bit."""
        ids, start = self.model.begin_verify(tokens, cache)
        starts = list(range(start, start + len(tokens)))
        return self._run(tokens, [cache] * len(tokens), ids, starts)

    def _run(
        self, tokens: list[int], caches: list[KVCache], ids: np.ndarray, starts: list[int]
    ) -> np.ndarray:
        model = self.model
        n = len(tokens)
        r = self._bound(n, caches)
        r.positions[:] = starts
        if n > 1 and ((r.positions < 0) | (r.positions >= r.batch._nctx)).any():
            raise ValueError(f"decode step: positions {starts} outside the caches")
        r.h[:] = model.embed(ids)
        for kernel, args in r.calls:
            kernel(*args)
        for c, t, p in zip(caches, tokens, starts):
            c.tokens.append(int(t))
            c.mark_written(p + 1)
        if n == 1:
            logits = qmatvec.matvec(model.output, r.x[0]).reshape(1, -1)
        else:
            logits = qmatvec.matvec_batch(model.output, r.x)
        return model.softcap(logits)
