"""FFN rows held on the KV cache's unwritten memory, given back as the caches fill.

A budgeted plan reserves the KV cache of the whole context window (Qwen2.5-1.5B at
2048 tokens, f16: 56 MiB), but a cache's pages only become resident as positions are
written (kvcache.lazy_zeros), so a short chat leaves most of that reserve unused while
every token reads the FFN rows the budget did not hold. Measured on the 1.5B at 800 MiB:
the cgroup's peak was 748 MiB over a 24-token run, 795 MiB after a 1990-token prompt.

KVLoan lends that reserve to dense streaming: after the warm-up it holds `tiers` more
shares of FFN (and head) rows, each one `DenseStreamStore.lend` call of kv_bytes / tiers,
and before any forward pass that writes KV positions it gives back, newest first, the
tiers that the resident KV pages would no longer leave room for. The sum of what the
caches hold and what is lent never exceeds the plan's KV reserve. Tiers are not lent
again once given back: a cleared cache keeps its pages (shared anonymous memory).

Every cache the model computes with counts (weakly referenced: a cache that is dropped
gives its pages back), each at its high-water mark rounded to its pages: a page of the
[layer, kv_head, position, head_dim] layout holds PAGE // (head_dim * item) positions.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

from edgerun.errors import InvalidArgumentError

__all__ = ["KVLoan", "PAGE_BYTES"]

PAGE_BYTES = 4096


class KVLoan:
    """Lend the KV reserve to `store` in tiers; `before_forward` gives them back."""

    def __init__(
        self,
        store,
        reserve_bytes: int,
        position_bytes: int,
        positions_per_page: int,
        tiers: int = 8,
    ) -> None:
        """reserve_bytes: the plan's KV allowance; position_bytes: what one position of
        one cache makes resident (all layers, K and V); positions_per_page: positions a
        page of one (layer, head) row holds."""
        if tiers < 1 or reserve_bytes < 0 or position_bytes <= 0 or positions_per_page < 1:
            raise InvalidArgumentError(
                f"KV loan: bad sizes (tiers {tiers}, reserve {reserve_bytes}, "
                f"position {position_bytes}, positions a page {positions_per_page})"
            )
        self.store = store
        self.reserve = int(reserve_bytes)
        self.position_bytes = int(position_bytes)
        self.page_positions = int(positions_per_page)
        self.tier_bytes = self.reserve // tiers
        self.tiers = tiers
        self._marks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lent: list[object] = []  # store.lend tokens, oldest first

    @property
    def lent_tiers(self) -> int:
        return len(self._lent)

    @property
    def lent_bytes(self) -> int:
        """Bytes of rows held on loan now (what the store read for them)."""
        return sum(self.store.loan_bytes(t) for t in self._lent)

    def kv_bytes(self) -> int:
        """What the caches seen so far make resident, at their high-water marks."""
        return sum(self._resident(p) for p in self._marks.values())

    def _resident(self, positions: int) -> int:
        pages = math.ceil(positions / self.page_positions)
        return pages * self.page_positions * self.position_bytes

    def _room_tiers(self, kv: int) -> int:
        if self.tier_bytes <= 0:
            return 0
        return max(0, (self.reserve - kv) // self.tier_bytes)

    def lend(self) -> int:
        """Hold as many tiers as the caches' current pages leave room for (called once
        the kernels are loaded, when more rows may be held). Returns the bytes read."""
        read = 0
        room = self._room_tiers(self.kv_bytes())
        while len(self._lent) < min(room, self.tiers):
            token = self.store.lend(self.tier_bytes)
            if token is None:  # nothing more to hold (all rows resident)
                break
            self._lent.append(token)
            read += self.store.loan_bytes(token)
        return read

    def before_forward(self, caches: Sequence[object], ends: Sequence[int]) -> None:
        """Before a pass that extends caches[i] to ends[i] positions: give back the tiers
        the caches' new pages need."""
        for c, end in zip(caches, ends, strict=True):
            if end > self._marks.get(c, 0):
                self._marks[c] = int(end)
        if not self._lent:
            return
        room = self._room_tiers(self.kv_bytes())
        while len(self._lent) > room:
            self.store.repay(self._lent.pop())
