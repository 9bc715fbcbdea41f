"""NeuronCache: the DRAM window over one layer's flash-resident neurons.

"LLM in a flash" §3.3 (windowing): neurons used by the last k tokens stay in DRAM, so
each token reads only the neurons that became active. Consecutive tokens share most
of their active neurons, which is what makes the reads small.

Layout: one preallocated uint8 matrix per part (e.g. "record" = [up | down] bundle
records, or separate "up", "down", "gate"), `capacity` rows each, filled in slots
[0, size). Slots [0, n_pinned) hold pinned (hot) neurons that are never evicted.
`id_to_slot` (int32 [d_ff], -1 = absent) and `slot_to_id` (int32 [capacity], -1 = free)
are inverse maps. Nothing is allocated per token:

- admitting into a full cache reuses the slots of the least recently used neurons
  (outside the window first, since those are the oldest; never a neuron this token
  uses), so a replacement moves no data;
- deleting (`remove`, `expire`) moves the last rows into the holes (swap-remove), so the
  filled slots stay a prefix and the kernels may scan [0, size) if they want.

Per token per layer: `slots, missing, fill = cache.request(ids)`; the reader writes the
missing neurons' bytes into `cache.parts[name][fill]`; the kernels use `slots` (aligned
with `ids`); then `cache.step()`. All bookkeeping is vectorized numpy, O(len(ids))
plus one O(size) partition when something must be evicted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edgerun.errors import InvalidArgumentError

__all__ = ["CacheStats", "NeuronCache"]


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


class NeuronCache:
    """Keeps the neurons of the last `window` tokens of one layer in fixed matrices."""

    def __init__(self, d_ff: int, capacity: int, parts: Mapping[str, int], window: int = 5) -> None:
        if not 0 < capacity <= d_ff:
            raise InvalidArgumentError(f"cache capacity must be in [1, {d_ff}], got {capacity}")
        if window < 1:
            raise InvalidArgumentError(f"window must be at least 1 token, got {window}")
        if not parts or any(int(b) <= 0 for b in parts.values()):
            raise InvalidArgumentError("parts must map each part name to its bytes per row")
        self.d_ff = int(d_ff)
        self.capacity = int(capacity)
        self.window = int(window)
        self.parts: dict[str, np.ndarray] = {
            name: np.zeros((capacity, int(nb)), np.uint8) for name, nb in parts.items()
        }
        self.id_to_slot = np.full(d_ff, -1, np.int32)
        self.slot_to_id = np.full(capacity, -1, np.int32)
        self.last_used = np.full(capacity, -1, np.int64)
        self.size = 0
        self.n_pinned = 0
        self.token = 0
        self.stats = CacheStats()

    # ---------------------------------------------------------------- queries
    def __len__(self) -> int:
        return self.size

    def __contains__(self, neuron: int) -> bool:
        return bool(self.id_to_slot[neuron] >= 0)

    @property
    def nbytes(self) -> int:
        """Bytes the preallocated matrices and maps take."""
        return sum(p.nbytes for p in self.parts.values()) + (
            self.id_to_slot.nbytes + self.slot_to_id.nbytes + self.last_used.nbytes
        )

    def ids(self) -> np.ndarray:
        """Neuron ids held, in slot order."""
        return self.slot_to_id[: self.size].copy()

    def active_slots(self, ids: np.ndarray) -> np.ndarray:
        """Slots of neurons that must all be present (for the compute kernels)."""
        slots = self.id_to_slot[np.asarray(ids, np.int64)]
        if slots.size and int(slots.min()) < 0:
            raise InvalidArgumentError("active_slots: some neurons are not in the cache")
        return slots

    # --------------------------------------------------------------- per token
    def lookup(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(slots of the ids present, ids missing); marks the present ones used now."""
        ids = self._ids(ids)
        slots = self.id_to_slot[ids]
        hit = slots >= 0
        present = slots[hit]
        self.last_used[present] = self.token
        nh = int(present.shape[0])
        self.stats.hits += nh
        self.stats.misses += ids.shape[0] - nh
        return present, ids[~hit]

    def admit(self, ids: np.ndarray) -> np.ndarray:
        """Make room for absent neurons `ids`; returns their slots, which the caller fills.

        Free slots first, then the least recently used unpinned slots not used by this
        token. Raises when even that is not enough (capacity below one token's need).
        """
        return self._admit(self._ids(ids), self.token)

    def _admit(self, ids: np.ndarray, cutoff: int) -> np.ndarray:
        """admit, evicting unpinned slots last used before token `cutoff`."""
        n = ids.shape[0]
        if n == 0:
            return np.empty(0, np.int32)
        if int(self.id_to_slot[ids].max()) >= 0:
            raise InvalidArgumentError("admit: some neurons are already in the cache")
        if np.unique(ids).shape[0] != n:
            raise InvalidArgumentError("admit: duplicate neuron ids")
        take = min(self.capacity - self.size, n)
        need = n - take
        if need:  # choose victims before anything changes, so a refusal leaves no trace
            lo = self.n_pinned
            cand = np.flatnonzero(self.last_used[lo : self.size] < cutoff) + lo
            if cand.shape[0] < need:
                raise InvalidArgumentError(
                    f"neuron cache of {self.capacity} slots ({self.n_pinned} pinned) cannot "
                    f"hold {n} more neurons for one token; raise its capacity"
                )
            if cand.shape[0] > need:
                cand = cand[np.argpartition(self.last_used[cand], need - 1)[:need]]
        slots = np.empty(n, np.int32)
        slots[:take] = np.arange(self.size, self.size + take, dtype=np.int32)
        self.size += take
        if need:
            victims = cand.astype(np.int32)
            self.id_to_slot[self.slot_to_id[victims]] = -1
            slots[take:] = victims
            self.stats.evictions += need
        self.slot_to_id[slots] = ids
        self.id_to_slot[ids] = slots
        self.last_used[slots] = self.token
        return slots

    def request(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """One token's lookup + admit: (slots aligned with ids, missing ids, their slots).

        The caller reads the missing neurons into `parts[...][fill_slots]` before
        computing with `slots`.
        """
        ids = self._ids(ids)
        _, missing = self.lookup(ids)
        fill = self.admit(missing)
        return self.id_to_slot[ids], missing, fill

    def step(self) -> None:
        """Advance to the next token (the window is counted in steps)."""
        self.token += 1

    # ------------------------------------------------------------------ deletes
    def expire(self) -> int:
        """Delete the unpinned neurons not used in the last `window` tokens; returns how many.

        Optional: `admit` already evicts these first. Use it to shrink the working set.
        """
        lo = self.n_pinned
        old = np.flatnonzero(self.last_used[lo : self.size] <= self.token - self.window) + lo
        self._delete_slots(old.astype(np.int32))
        return int(old.shape[0])

    def remove(self, ids: np.ndarray) -> None:
        """Delete unpinned neurons (absent ones are ignored)."""
        slots = self.id_to_slot[self._ids(ids)]
        slots = np.unique(slots[slots >= 0])
        if slots.size and int(slots.min()) < self.n_pinned:
            raise InvalidArgumentError("remove: pinned neurons are never evicted")
        self._delete_slots(slots.astype(np.int32))

    def _delete_slots(self, holes: np.ndarray) -> None:
        """Swap-remove: the rows at the end move into the holes below the new size."""
        k = holes.shape[0]
        if k == 0:
            return
        self.id_to_slot[self.slot_to_id[holes]] = -1
        new_size = self.size - k
        dead = np.zeros(self.size - new_size, bool)
        tail_holes = holes[holes >= new_size]
        dead[tail_holes - new_size] = True
        movers = np.flatnonzero(~dead).astype(np.int32) + new_size
        targets = np.sort(holes[holes < new_size])
        if targets.shape[0]:
            for mat in self.parts.values():
                mat[targets] = mat[movers]
            mids = self.slot_to_id[movers]
            self.slot_to_id[targets] = mids
            self.id_to_slot[mids] = targets
            self.last_used[targets] = self.last_used[movers]
        self.slot_to_id[new_size : self.size] = -1
        self.last_used[new_size : self.size] = -1
        self.size = new_size
        self.stats.evictions += k

    # ------------------------------------------------------------------- pinning
    def pin(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Pin neurons (hot set) into the front slots; never evicted afterwards.

        Returns (missing ids, their slots) for the caller to fill, as `request` does.
        """
        ids = self._ids(ids)
        ids = ids[np.sort(np.unique(ids, return_index=True)[1])]
        slots = self.id_to_slot[ids]
        ids = ids[(slots < 0) | (slots >= self.n_pinned)]  # already pinned: nothing to do
        if self.n_pinned + ids.shape[0] > self.capacity:
            raise InvalidArgumentError(
                f"cannot pin {ids.shape[0]} more neurons: {self.n_pinned} of "
                f"{self.capacity} slots are pinned already"
            )
        present = ids[self.id_to_slot[ids] >= 0]
        for i in present:  # first, so the admit below cannot evict them
            self._swap(int(self.id_to_slot[i]), self.n_pinned)
            self.n_pinned += 1
        missing = ids[self.id_to_slot[ids] < 0]
        self._admit(missing, np.iinfo(np.int64).max)  # between tokens: any unpinned slot
        for i in missing:
            self._swap(int(self.id_to_slot[i]), self.n_pinned)
            self.n_pinned += 1
        return missing, self.id_to_slot[missing]

    def _swap(self, a: int, b: int) -> None:
        if a == b:
            return
        for mat in self.parts.values():
            row = mat[a].copy()
            mat[a] = mat[b]
            mat[b] = row
        ia, ib = int(self.slot_to_id[a]), int(self.slot_to_id[b])
        self.slot_to_id[a], self.slot_to_id[b] = ib, ia
        self.id_to_slot[ia] = b
        if ib >= 0:
            self.id_to_slot[ib] = a
        self.last_used[[a, b]] = self.last_used[[b, a]]

    # ------------------------------------------------------------------ helpers
    def _ids(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= self.d_ff):
            raise InvalidArgumentError(f"neuron ids must be in [0, {self.d_ff})")
        return ids
