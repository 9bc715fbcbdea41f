"""Shared prompt prefixes (system prompts, documents): KV rows computed once and copied
into the caches of later requests that start with the same tokens."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgerun.errors import ContextOverflowError, InvalidArgumentError
from edgerun.model.kvcache import KVCache
from edgerun.model.state_cache import LayerState


@dataclass
class SharedPrefix:
    """KV rows of a token prefix, computed once and copied into new caches, and a hybrid
    model's recurrent states after it (None for a model that only attends)."""

    tokens: tuple[int, ...]
    k: np.ndarray
    v: np.ndarray
    last_used: float = 0.0
    states: dict[int, LayerState] | None = None
    key_centre: np.ndarray | None = None  # what its key rows were stored less of
    key_scale: np.ndarray | None = None  # and divided by (model/kvcache.key_scale)

    @property
    def nbytes(self) -> int:
        states = self.states or {}
        return (
            self.k.nbytes
            + self.v.nbytes
            + sum(a.nbytes for named in states.values() for a in named.values())
        )

    def copy_into(self, cache: KVCache) -> None:
        n = len(self.tokens)
        cache.check_fits(0)
        if n > cache.n_ctx:
            raise ContextOverflowError(f"a shared prefix of {n} tokens exceeds the context")
        if (self.k.dtype, self.v.dtype) != (cache.k.dtype, cache.v.dtype):
            raise InvalidArgumentError(
                f"a shared prefix of KV types {self.k.dtype}/{self.v.dtype} cannot seed a "
                f"cache of {cache.kv_type}; one PrefixCache serves caches of one KV type"
            )
        if not (
            _same_centre(self.key_centre, cache.key_centre)
            and _same_centre(self.key_scale, cache.key_scale)
        ):
            raise InvalidArgumentError(
                "a shared prefix's keys were stored less another key centre or over another "
                "key scale than this cache's (model/kvcache.key_centre, key_scale); one "
                "PrefixCache serves one model"
            )
        cache.k[:, :, :n] = self.k
        cache.v[:, :, :n] = self.v
        cache.mark_written(n)
        cache.tokens[:] = list(self.tokens)
        if self.states is not None:
            cache.state.set_layers(self.states)
        self.last_used = time.monotonic()


def _same_centre(a: np.ndarray | None, b: np.ndarray | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a is b or np.array_equal(a, b)


class PrefixCache:
    """Shared prompt prefixes (system prompts, documents) by token sequence, LRU-bounded
    by bytes. Thread-safe: sessions look up, the scheduler stores."""

    def __init__(self, max_bytes: int = 256 << 20) -> None:
        self.max_bytes = max_bytes
        self._entries: dict[tuple[int, ...], SharedPrefix] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: Sequence[int], limit: int | None = None) -> SharedPrefix | None:
        """The longest stored prefix of `ids` no longer than `limit` tokens."""
        limit = len(ids) if limit is None else limit
        best = None
        with self._lock:
            for key, e in self._entries.items():
                n = len(key)
                if n <= limit and (best is None or n > len(best.tokens)):
                    if tuple(ids[:n]) == key:
                        best = e
        return best

    def contains(self, ids: Sequence[int]) -> bool:
        with self._lock:
            return tuple(ids) in self._entries

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(x.nbytes for x in self._entries.values())

    def store(self, cache: KVCache, n: int, room: int | None = None) -> None:
        """Keep cache's first n positions (if not already kept and they fit the bound and
        `room`, the bytes a RAM budget has left for them; None: no budget)."""
        key = tuple(cache.tokens[:n])
        with self._lock:
            if key in self._entries or n == 0:
                return
            states = cache.states_at(n)  # a hybrid's states after the prefix, if kept
            if cache.state.recurrent and states is None:
                return
            if room is not None and n * cache.position_bytes > room:
                return
            k, v = cache.k[:, :, :n].copy(), cache.v[:, :, :n].copy()
            e = SharedPrefix(
                key, k, v, states=states, key_centre=cache.key_centre, key_scale=cache.key_scale
            )
            if e.nbytes > self.max_bytes:
                return
            e.last_used = time.monotonic()
            self._entries[key] = e
            while sum(x.nbytes for x in self._entries.values()) > self.max_bytes:
                old = min(self._entries.values(), key=lambda x: x.last_used)
                del self._entries[old.tokens]

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
