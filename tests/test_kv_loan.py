"""Rows lent on the KV cache's unwritten reserve (offload/kv_loan.py)."""

import gc
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerun.errors import InvalidArgumentError
from edgerun.offload.kv_loan import KVLoan


class FakeStore:
    """Lends exactly what it is asked for, up to `rows` bytes in all."""

    def __init__(self, rows: int = 1 << 40) -> None:
        self.rows = rows
        self.held = 0
        self.loans: list[int] = []

    def lend(self, nbytes):
        n = min(nbytes, self.rows - self.held)
        if n <= 0:
            return None
        self.held += n
        self.loans.append(n)
        return len(self.loans) - 1

    def repay(self, token):
        assert token == len(self.loans) - 1, "repaid out of order"
        self.held -= self.loans.pop()

    def loan_bytes(self, token):
        return self.loans[token]


class Cache:
    pass


def test_tiers_are_lent_and_given_back_as_the_caches_fill():
    store = FakeStore()
    # 1 KiB a position, 16 positions a page, a 64-position reserve in 4 tiers
    loan = KVLoan(store, 64 << 10, 1 << 10, 16, tiers=4)
    assert loan.lend() == 64 << 10 and loan.lent_tiers == 4
    a, b = Cache(), Cache()
    loan.before_forward([a], [1])  # one page of a: 16 KiB of the reserve
    assert loan.lent_tiers == 3 and store.held == 48 << 10
    loan.before_forward([a], [16])  # still the same page
    assert loan.lent_tiers == 3
    loan.before_forward([a, b], [17, 1])  # a second page of a, a first of b
    assert loan.lent_tiers == 1 and loan.kv_bytes() == 48 << 10
    loan.before_forward([a], [10])  # a shorter end: the mark stays (pages stay resident)
    assert loan.kv_bytes() == 48 << 10
    loan.before_forward([b], [40])
    assert loan.lent_tiers == 0 and store.held == 0
    del a
    gc.collect()  # a dropped cache frees its pages, but tiers are not lent again
    assert loan.kv_bytes() == 48 << 10 and loan.lent_tiers == 0


def test_a_store_with_nothing_left_to_hold_stops_the_loan():
    store = FakeStore(rows=10 << 10)
    loan = KVLoan(store, 64 << 10, 1 << 10, 16, tiers=4)
    assert loan.lend() == 10 << 10 and loan.lent_tiers == 1
    assert loan.lent_bytes == 10 << 10


def test_a_limit_caps_what_is_lent():
    """The process lends only what it measured free under its budget."""
    store = FakeStore()
    loan = KVLoan(store, 64 << 10, 1 << 10, 16, tiers=4, limit_bytes=40 << 10)
    assert loan.lend() == 32 << 10 and loan.lent_tiers == 2
    a, b = Cache(), Cache()
    loan.before_forward([a], [20])  # 32 KiB of pages: 32 + 32 lent fits the 64 reserved
    assert loan.lent_tiers == 2
    loan.before_forward([b], [1])  # another cache's first page: one tier goes back
    assert loan.lent_tiers == 1 and loan.kv_bytes() + store.held == 64 << 10


def test_bad_sizes_are_refused():
    with pytest.raises(InvalidArgumentError, match="tiers 0"):
        KVLoan(FakeStore(), 1 << 20, 1024, 16, tiers=0)
    with pytest.raises(InvalidArgumentError, match="position 0"):
        KVLoan(FakeStore(), 1 << 20, 0, 16)


@settings(max_examples=60, deadline=None)
@given(
    tiers=st.integers(1, 12),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 90)), max_size=30),
)
def test_kv_pages_and_loans_never_exceed_the_reserve(tiers, steps):
    store = FakeStore()
    reserve = 100 << 10
    loan = KVLoan(store, reserve, 1 << 10, 8, tiers=tiers)
    loan.lend()
    caches = [Cache() for _ in range(4)]
    ends = [0] * 4
    for i, n in steps:
        ends[i] += n
        loan.before_forward([caches[i]], [ends[i]])
        assert loan.kv_bytes() + store.held <= max(reserve, loan.kv_bytes())
        if loan.kv_bytes() + loan.tier_bytes <= reserve:  # what fits is not given back early
            assert reserve - loan.kv_bytes() - store.held < 2 * loan.tier_bytes


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise")
def test_lent_rows_compute_the_same_logits_and_stream_again_once_repaid(tmp_path):
    """A loan holds every row of a tiny untied model (FFN and head) that streamed; the
    logits stay the resident model's; repaid, the rows stream again, the same numbers."""
    from hostile import FF, untied_streamed

    u = untied_streamed(tmp_path)
    assert u.plan.cache_neurons == 0
    store, streamed = u.store, u.streamed
    logits = u.logits
    want = logits(u.resident)
    assert store.hold_more(1 << 30) == 0  # the plan holds nothing: no more to hold
    loan = store.lend(1 << 30)
    assert loan is not None and loan.nbytes > 0 and store.held_neurons == FF
    assert all(m.held_rows == m.rows and not m.pieces for m, _ in store._splits)
    assert store.offload_stats()["lent_bytes"] == loan.nbytes
    with pytest.raises(InvalidArgumentError, match="outstanding"):
        store.hold_more(1)
    store.reset_offload_stats()
    for g, w in zip(logits(streamed), want):
        assert np.array_equal(g, w)
    assert store.direct.bytes_read == 0  # all of it in RAM
    assert store.lend(1 << 30) is None  # nothing left to lend
    store.repay(loan)
    assert store.held_neurons == 0 and store.offload_stats()["lent_bytes"] == 0
    assert all(m.held_rows == 0 and m.pieces for m, _ in store._splits)
    for g, w in zip(logits(streamed), want):
        assert np.array_equal(g, w)
    assert store.direct.bytes_read > 0
    with pytest.raises(InvalidArgumentError, match="newest first"):
        store.repay(loan)
    store.close()
