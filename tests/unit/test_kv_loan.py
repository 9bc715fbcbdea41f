"""Rows lent on the memory a budget leaves unused (offload/kv_loan.py)."""

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


class Process:
    """A budget the process measures against: lent rows and written KV pages use it."""

    def __init__(self, store: FakeStore, budget: int) -> None:
        self.store, self.budget, self.loan = store, budget, None
        self.measured = 0

    def free(self) -> int:
        self.measured += 1
        return self.budget - self.store.held - self.loan.kv_bytes()


KIB = 1 << 10


def _loan(budget=64 * KIB, rows=1 << 40, tier=16 * KIB, tiers=4, step=0, step_tokens=1):
    store = FakeStore(rows)
    proc = Process(store, budget)
    # 1 KiB a position, 16 positions a page
    loan = KVLoan(store, proc.free, KIB, 16, tier, tiers, step, step_tokens, relend_after=3)
    proc.loan = loan
    return store, proc, loan


def test_tiers_are_lent_on_what_is_free_and_given_back_as_the_caches_fill():
    store, _, loan = _loan()
    assert loan.lend() == 64 * KIB and loan.lent_tiers == 4
    a, b = Cache(), Cache()
    loan.before_forward([a], [1])  # one page of a: 16 KiB
    assert loan.lent_tiers == 3 and store.held == 48 * KIB
    loan.before_forward([a], [16])  # still the same page
    assert loan.lent_tiers == 3
    loan.before_forward([a, b], [17, 1], tokens=2)  # a second page of a, a first of b
    assert loan.lent_tiers == 1 and loan.kv_bytes() == 48 * KIB
    loan.before_forward([a], [10])  # a shorter end: the mark stays (pages stay resident)
    assert loan.kv_bytes() == 48 * KIB
    loan.before_forward([b], [40])
    assert loan.lent_tiers == 0 and store.held == 0
    assert loan.repaid_bytes == 64 * KIB


def test_a_store_with_nothing_left_to_hold_stops_the_loan():
    store, proc, loan = _loan(rows=10 * KIB)
    assert loan.lend() == 10 * KIB and loan.lent_tiers == 1
    assert loan.lent_bytes == 10 * KIB
    c = Cache()
    measured = proc.measured
    for end in range(1, 10):  # one-token passes: nothing more to hold, so no re-measuring
        loan.before_forward([c], [end])
    assert proc.measured == measured and loan.lent_tiers == 1


def test_a_prompt_chunk_gives_back_room_for_its_temporaries_and_decoding_lends_again():
    """A 128-token chunk needs step bytes (in proportion for fewer tokens); the tiers
    come back after `relend_after` one-token passes, measured again."""
    store, proc, loan = _loan(
        budget=100 * KIB, tier=20 * KIB, tiers=5, step=40 * KIB, step_tokens=128
    )
    assert loan.lend() == 100 * KIB
    c = Cache()
    loan.before_forward([c], [64], tokens=64)  # 64 KiB of pages + 20 KiB of temporaries
    assert store.held == 0 or loan.free_estimate() >= 20 * KIB
    assert loan.kv_bytes() + store.held + 20 * KIB <= 100 * KIB
    held = store.held
    loan.before_forward([c], [65])  # a new page: 16 KiB more
    loan.before_forward([c], [66])
    assert store.held <= held
    measured = proc.measured
    loan.before_forward([c], [67])  # the third one-token pass: measure, lend what fits
    assert proc.measured == measured + 1
    assert store.held == 100 * KIB - loan.kv_bytes() - loan.free_estimate()
    assert loan.free_estimate() < loan.tier_bytes  # all that fits a tier is lent
    assert loan.kv_bytes() + store.held <= 100 * KIB


def test_the_measured_figure_caps_what_is_lent():
    """The process lends only what it measures free under its budget."""
    store, proc, loan = _loan(budget=40 * KIB)
    assert loan.lend() == 32 * KIB and loan.lent_tiers == 2
    a = Cache()
    loan.before_forward([a], [8])  # 16 KiB of pages: 16 + 32 > 40, one tier goes back
    assert loan.lent_tiers == 1 and loan.kv_bytes() + store.held <= 40 * KIB


def test_bad_sizes_are_refused():
    with pytest.raises(InvalidArgumentError, match="tiers 0"):
        KVLoan(FakeStore(), lambda: 0, 1024, 16, 1 << 20, tiers=0)
    with pytest.raises(InvalidArgumentError, match="position 0"):
        KVLoan(FakeStore(), lambda: 0, 0, 16, 1 << 20)
    with pytest.raises(InvalidArgumentError, match="step -1"):
        KVLoan(FakeStore(), lambda: 0, 1024, 16, 1 << 20, step_bytes=-1)


@settings(max_examples=80, deadline=None)
@given(
    tiers=st.integers(1, 12),
    steps=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 90)), max_size=30),
)
def test_kv_pages_temporaries_and_loans_never_exceed_the_budget(tiers, steps):
    budget, step = 200 * KIB, 24 * KIB
    store, proc, loan = _loan(
        budget=budget, tier=budget // tiers, tiers=tiers, step=step, step_tokens=32
    )
    loan.lend()
    caches = [Cache() for _ in range(4)]
    ends = [0] * 4
    for i, n in steps:
        ends[i] += n
        loan.before_forward([caches[i]], [ends[i]], tokens=n)
        need = step * min(n, 32) // 32 if n > 1 else 0
        if store.held:  # with rows still lent, their memory, the pages and the pass fit
            assert loan.kv_bytes() + store.held + need <= budget
        # the estimate never claims more free than the process measures
        assert loan.free_estimate() <= proc.free()


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


def test_batched_decode_steps_lend_again_and_kv_writes_without_a_pass_do_not():
    """A step of 2 sequences (a token each) counts as a decode step; KV written without a
    pass (a shared prefix, a loaded session: tokens=0) gives back but never lends."""
    store, proc, loan = _loan(
        budget=200 * KIB, tier=20 * KIB, tiers=10, step=256 * KIB, step_tokens=128
    )
    caches = [Cache() for _ in range(2)]
    loan.before_forward(caches[1:], [1], tokens=0)  # a page of the second cache: 16 KiB
    assert loan.lend() == 180 * KIB and proc.measured == 1
    loan.before_forward(caches[:1], [10], tokens=10)  # a page, and 20 KiB of temporaries
    assert store.held == 140 * KIB and loan.free_estimate() >= 20 * KIB
    for _ in range(5):
        loan.before_forward(caches[:1], [10], tokens=0)  # KV written without a pass
    assert store.held == 140 * KIB and proc.measured == 1
    for step in range(3):  # decode steps of 2 sequences, 4 KiB of temporaries each
        loan.before_forward(caches, [11 + step, 2 + step], tokens=2)
    assert proc.measured == 2  # measured again, and lent what fits beside the step
    assert store.held == 160 * KIB
    assert loan.free_estimate() - 4 * KIB < loan.tier_bytes
