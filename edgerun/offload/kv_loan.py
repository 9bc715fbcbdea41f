"""FFN rows held on the memory a budget reserves but the process is not using yet,
given back before that memory is needed.

A budgeted plan reserves the KV cache of the whole context window (Qwen2.5-1.5B at 2048
tokens, f16: 56 MiB), a prompt chunk's temporaries (placement.STEP_MARGIN_BYTES) and
margins for estimates, but a cache's pages only become resident as positions are written
(kvcache.lazy_zeros) and a decode step's temporaries are small. So while a chat is
short and decoding, much of the budget is unused while every token reads the FFN rows
the plan did not hold. Measured on the 1.5B at 800 MiB (context 512, Xeon, a cgroup of
the budget + 5%): the plan peaked at 822 MB during the first prompt, then decoded at
760-777 MB against an 839 MB budget.

KVLoan lends that memory to dense streaming: after the warm-up it measures what the
process has free under its budget (`free_bytes`: the budget less the RSS and a margin),
holds up to `tiers` more shares of FFN (and head) rows, each one `DenseStreamStore.lend`
call of `tier_bytes`, and before every forward pass it gives back, newest first, the
tiers that pass would not leave room for: the KV pages it writes, and a multi-token
pass's temporaries (`step_bytes` for a `step_tokens` chunk, in proportion). After
`relend_after` decode steps in a row (one token a sequence) it measures again and lends
what fits, so a new prompt costs one re-read of the tiers it gave back (~25 MB), not
the loan.

Every cache the model computes with counts (weakly referenced: a cache that is dropped
gives its pages back), each at its high-water mark rounded to its pages: a page of the
[layer, kv_head, position, row] layout holds PAGE // (row bytes) positions.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence

from edgerun.errors import InvalidArgumentError
from edgerun.model.kvcache import PAGE_BYTES

__all__ = ["KVLoan", "PAGE_BYTES"]


class KVLoan:
    """Lend the budget's unused memory to `store` in tiers; `before_forward` gives them back."""

    def __init__(
        self,
        store,
        free_bytes: Callable[[], int],
        position_bytes: int,
        positions_per_page: int,
        tier_bytes: int,
        tiers: int = 4,
        step_bytes: int = 0,
        step_tokens: int = 1,
        relend_after: int = 8,
    ) -> None:
        """free_bytes: what the process may still use under its budget, measured now
        (lent rows and written KV pages count as used); position_bytes: what one
        position of one cache makes resident (all layers, K and V); positions_per_page:
        positions a page of one (layer, head) row holds; step_bytes: the temporaries of
        a step_tokens-token pass."""
        if (
            tiers < 1
            or tier_bytes <= 0
            or position_bytes <= 0
            or positions_per_page < 1
            or step_bytes < 0
            or step_tokens < 1
        ):
            raise InvalidArgumentError(
                f"KV loan: bad sizes (tiers {tiers} of {tier_bytes} bytes, position "
                f"{position_bytes}, positions a page {positions_per_page}, step {step_bytes} "
                f"bytes / {step_tokens} tokens)"
            )
        self.store = store
        self.free_bytes = free_bytes
        self.position_bytes = int(position_bytes)
        self.page_positions = int(positions_per_page)
        self.tier_bytes = int(tier_bytes)
        self.tiers = tiers
        self.step_bytes = int(step_bytes)
        self.step_tokens = int(step_tokens)
        self.relend_after = relend_after
        self._marks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lent: list[tuple[object, int]] = []  # (store.lend token, bytes), oldest first
        self._lent_sum = 0
        self._free_at = self._kv_at = self._lent_at = 0  # the last measurement
        self._quiet = 0  # decode steps since the last give-back
        self._store_full = False  # the store had nothing more to hold at the last try
        self.repaid_bytes = 0  # given back in all (each re-read if lent again)

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

    def free_estimate(self) -> int:
        """The last measurement, less the KV pages and loans added since."""
        return self._free_at - (self.kv_bytes() - self._kv_at) - (self._lent_sum - self._lent_at)

    def lend(self, keep: int = 0) -> int:
        """Measure the free memory and hold tiers while it leaves room, and `keep` bytes
        more (called once the kernels are loaded). A tier is tier_bytes, or a multiple of
        that where the store holds rows only in larger steps (its row multiples). Returns
        the bytes read."""
        self._free_at = int(self.free_bytes())
        self._kv_at, self._lent_at = self.kv_bytes(), self._lent_sum
        read = 0
        while len(self._lent) < self.tiers:
            room = self.free_estimate() - keep
            ask, token = self.tier_bytes, None
            while ask <= room:
                token = self.store.lend(ask)
                if token is not None:
                    break
                ask += self.tier_bytes
            if token is None:  # no room, or nothing more to hold
                self._store_full = room >= self.tier_bytes
                break
            n = self.store.loan_bytes(token)
            self._lent.append((token, n))
            self._lent_sum += n
            read += n
        return read

    def before_forward(
        self, caches: Sequence[object], ends: Sequence[int], tokens: int = 1
    ) -> None:
        """Before a pass of `tokens` positions that extends caches[i] to ends[i]: give
        back, newest first, the tiers its KV pages and temporaries need; after enough
        decode steps, lend again what fits."""
        for c, end in zip(caches, ends, strict=True):
            if end > self._marks.get(c, 0):
                self._marks[c] = int(end)
        need = 0
        if tokens > 1:
            need = self.step_bytes * min(tokens, self.step_tokens) // self.step_tokens
        repaid = False
        while self._lent and self.free_estimate() < need:
            self._repay_newest()
            repaid = True
        # a decode step: up to 1/8 of a chunk's rows (0 tokens: KV written without a pass,
        # a shared prefix or a loaded session)
        if not repaid and tokens > 0 and need <= self.step_bytes // 8:
            self._quiet += 1
            if (
                self._quiet >= self.relend_after
                and not self._store_full
                and len(self._lent) < self.tiers
                and self.free_estimate() - need >= self.tier_bytes
            ):
                self.lend(keep=need)

    def repay_all(self) -> None:
        """Give every tier back (the rows stream again); a later lend() measures anew."""
        while self._lent:
            self._repay_newest()

    def _repay_newest(self) -> None:
        """Give the newest tier back; lending again waits for relend_after decode steps,
        and the store has room for its rows again."""
        token, n = self._lent.pop()
        self.store.repay(token)
        self._lent_sum -= n
        self.repaid_bytes += n
        self._quiet, self._store_full = 0, False
