"""FFN rows held on the KV cache's unwritten memory, given back as the caches fill.

A budgeted plan reserves the KV cache of the whole context window (Qwen2.5-1.5B at
2048 tokens, f16: 56 MiB), but a cache's pages only become resident as positions are
written (kvcache.lazy_zeros), so a short chat leaves most of that reserve unused while
every token reads the FFN rows the budget did not hold. Measured on the 1.5B at 800 MiB
in a cgroup of the budget + 5%: the peak was 748 MiB over a 24-token run.

KVLoan lends that reserve to dense streaming: after the warm-up it holds up to `tiers`
more shares of FFN (and head) rows, each one `DenseStreamStore.lend` call of about
reserve / tiers bytes, and before any forward pass that writes KV positions it gives
back, newest first, the tiers that the resident KV pages would no longer leave room for.
The sum of what the caches hold and what is lent never exceeds the plan's KV reserve.
Tiers are not lent again once given back: a cleared cache keeps its pages (shared
anonymous memory).

It lends at most what the process measures free (api.Model._lend_kv_reserve: the budget
less the RSS, the unwritten reserve and a margin), since the plan's other parts are
estimates and the unwritten reserve was the slack that absorbed their error. Opt-in
(OffloadOptions.kv_loan_tiers): measured in cgroups of the budget + 5%, it read 8-12%
fewer bytes a token but ran no faster on this project's VMs, nearer the budget.

Every cache the model computes with counts (weakly referenced: a cache that is dropped
gives its pages back), each at its high-water mark rounded to its pages: a page of the
[layer, kv_head, position, head_dim] layout holds PAGE // (head_dim * item) positions.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence

from edgerun.errors import InvalidArgumentError
from edgerun.kvcache import PAGE_BYTES

__all__ = ["KVLoan", "PAGE_BYTES"]


class KVLoan:
    """Lend the KV reserve to `store` in tiers; `before_forward` gives them back."""

    def __init__(
        self,
        store,
        reserve_bytes: int,
        position_bytes: int,
        positions_per_page: int,
        tiers: int = 8,
        limit_bytes: int | None = None,
    ) -> None:
        """reserve_bytes: the plan's KV allowance; position_bytes: what one position of
        one cache makes resident (all layers, K and V); positions_per_page: positions a
        page of one (layer, head) row holds; limit_bytes: the most to lend in all (what
        the process measured free under its budget; default: the reserve)."""
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
        self.limit = self.reserve if limit_bytes is None else max(0, int(limit_bytes))
        self.tiers = tiers
        self._marks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lent: list[tuple[object, int]] = []  # (store.lend token, bytes), oldest first
        self._lent_sum = 0

    @property
    def lent_tiers(self) -> int:
        return len(self._lent)

    @property
    def lent_bytes(self) -> int:
        """Bytes of rows held on loan now (what the store read for them)."""
        return self._lent_sum

    def kv_bytes(self) -> int:
        """What the caches seen so far make resident, at their high-water marks."""
        return sum(self._resident(p) for p in self._marks.values())

    def _resident(self, positions: int) -> int:
        pages = math.ceil(positions / self.page_positions)
        return pages * self.page_positions * self.position_bytes

    def lend(self) -> int:
        """Hold tiers of rows while the caches' current pages leave room (called once
        the kernels are loaded). A tier is reserve / tiers bytes, or a multiple of that
        where the store holds rows only in larger steps (its row multiples). Returns
        the bytes read."""
        read = 0
        while len(self._lent) < self.tiers and self.tier_bytes > 0:
            room = min(self.reserve - self.kv_bytes(), self.limit) - self._lent_sum
            ask, token = self.tier_bytes, None
            while ask <= room:
                token = self.store.lend(ask)
                if token is not None:
                    break
                ask += self.tier_bytes
            if token is None:  # no room, or nothing more to hold
                break
            n = self.store.loan_bytes(token)
            self._lent.append((token, n))
            self._lent_sum += n
            read += n
        return read

    def before_forward(self, caches: Sequence[object], ends: Sequence[int]) -> None:
        """Before a pass that extends caches[i] to ends[i] positions: give back, newest
        first, the tiers the caches' new pages need."""
        for c, end in zip(caches, ends, strict=True):
            if end > self._marks.get(c, 0):
                self._marks[c] = int(end)
        if not self._lent:
            return
        kv = self.kv_bytes()
        while self._lent and kv + self._lent_sum > self.reserve:
            token, n = self._lent.pop()
            self.store.repay(token)
            self._lent_sum -= n
