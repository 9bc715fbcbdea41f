"""NeuronCache invariants under arbitrary request / step / pin / remove / expire sequences."""

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from edgerun.errors import InvalidArgumentError
from edgerun.offload.cache import NeuronCache

D_FF = 40
PARTS = {"rec": 6, "gate": 3}


def payload(neuron: int, nbytes: int, salt: int) -> np.ndarray:
    """Bytes derived from the id, so a row that moves without its id is caught."""
    return ((np.arange(nbytes) * 31 + neuron * 7 + salt * 101) % 251).astype(np.uint8)


def fill(cache: NeuronCache, ids, slots) -> None:
    for i, s in zip(np.asarray(ids).tolist(), np.asarray(slots).tolist()):
        for k, (name, nb) in enumerate(PARTS.items()):
            cache.parts[name][s] = payload(i, nb, k)


class CacheMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.history: list[set[int]] = []  # ids used per token (current one last)
        self.pinned: set[int] = set()

    @rule(capacity=st.integers(1, D_FF), window=st.integers(1, 4))
    @precondition(lambda self: self.cache is None)
    def create(self, capacity, window):
        self.cache = NeuronCache(D_FF, capacity, PARTS, window=window)
        self.history = [set()]

    @rule(ids=st.sets(st.integers(0, D_FF - 1), max_size=D_FF))
    @precondition(lambda self: self.cache is not None)
    def request(self, ids):
        c = self.cache
        ids = np.array(sorted(ids), np.int64)
        used_now = self.history[-1] | set(ids.tolist())
        room = c.capacity - c.n_pinned
        if len(used_now - self.pinned) > room:
            with pytest.raises(InvalidArgumentError):
                c.request(ids)
            self.history[-1] = self.history[-1] | {
                i for i in ids.tolist() if c.id_to_slot[i] >= 0
            }  # the lookup part touched the present ones before the admit refused
            return
        window_before = set().union(*self.history[-c.window :]) - self.pinned
        slots, missing, fill_slots = c.request(ids)
        fill(c, missing, fill_slots)
        assert np.array_equal(c.slot_to_id[slots], ids)
        self.history[-1] = used_now
        if len(window_before | (used_now - self.pinned)) <= room:
            assert all(i in c for i in window_before)  # nothing in the window was evicted
        else:  # the window needed more than the cache holds: evicted neurons are gone
            present = set(c.ids().tolist())
            for h in self.history:
                h &= present

    @rule()
    @precondition(lambda self: self.cache is not None)
    def step(self):
        self.cache.step()
        self.history.append(set())

    @rule(ids=st.sets(st.integers(0, D_FF - 1), max_size=6))
    @precondition(lambda self: self.cache is not None)
    def pin(self, ids):
        c = self.cache
        new = set(ids) - self.pinned
        if c.n_pinned + len(new) > c.capacity:
            with pytest.raises(InvalidArgumentError):
                c.pin(np.array(sorted(ids)))
            return
        missing, slots = c.pin(np.array(sorted(ids), np.int64))
        fill(c, missing, slots)
        self.pinned |= set(ids)
        for h in self.history:  # pinning may evict any unpinned neuron to make room
            h &= set(c.ids().tolist())
        assert c.n_pinned == len(self.pinned)

    @rule(ids=st.sets(st.integers(0, D_FF - 1), max_size=8))
    @precondition(lambda self: self.cache is not None)
    def remove(self, ids):
        c = self.cache
        ids = set(ids) - self.pinned
        c.remove(np.array(sorted(ids), np.int64))
        for i in ids:
            assert i not in c
        for h in self.history:
            h -= ids

    @rule()
    @precondition(lambda self: self.cache is not None)
    def expire(self):
        c = self.cache
        c.expire()
        recent = set().union(*self.history[-c.window :])
        for i in c.ids().tolist():
            assert i in recent or i in self.pinned

    @invariant()
    def maps_are_inverse_and_rows_follow_ids(self):
        c = self.cache
        if c is None:
            return
        assert 0 <= c.n_pinned <= c.size <= c.capacity
        held = c.slot_to_id[: c.size]
        assert (held >= 0).all() and len(set(held.tolist())) == c.size
        assert (c.slot_to_id[c.size :] == -1).all()
        assert np.array_equal(c.id_to_slot[held], np.arange(c.size))
        assert (c.id_to_slot >= 0).sum() == c.size
        assert set(held[: c.n_pinned].tolist()) == self.pinned
        for s, i in enumerate(held.tolist()):
            for k, (name, nb) in enumerate(PARTS.items()):
                assert np.array_equal(c.parts[name][s], payload(i, nb, k)), (s, i, name)

    @invariant()
    def window_is_kept_when_capacity_suffices(self):
        c = self.cache
        if c is None:
            return
        recent = set().union(*self.history[-c.window :]) - self.pinned
        if len(recent) <= c.capacity - c.n_pinned:
            for i in recent:
                assert i in c, (i, recent)


CacheMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestNeuronCache = CacheMachine.TestCase


def test_hit_rate_and_replacement_moves_no_rows():
    c = NeuronCache(100, 4, {"rec": 2}, window=1)
    _, missing, slots = c.request([1, 2, 3, 4])
    assert list(missing) == [1, 2, 3, 4] and c.stats.hit_rate == 0.0
    c.step()
    slots, missing, fill_slots = c.request([3, 4, 5])
    assert list(missing) == [5] and c.stats.hits == 2 and c.stats.evictions == 1
    assert fill_slots[0] in (0, 1)  # 5 reuses the slot of 1 or 2 in place
    assert c.stats.hit_rate == pytest.approx(2 / 7)


def test_eviction_prefers_least_recently_used():
    c = NeuronCache(100, 3, {"rec": 1}, window=1)
    c.request([1])
    c.step()
    c.request([2])
    c.step()
    c.request([3])
    c.step()
    c.request([1, 4])  # full; 1 is a hit, 2 is the oldest unused
    assert 2 not in c and {1, 3, 4} <= set(c.ids().tolist())
