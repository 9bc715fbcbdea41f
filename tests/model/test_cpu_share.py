"""ThreadGovernor: decoding uses the cores other processes leave free."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import numba
import pytest

from edgerun.generate.sampling import SamplingParams
from edgerun.runtime.cpu_share import ThreadGovernor, read_cpu_sample


class FakeCpu:
    """A scripted clock: each tick adds wall time, our CPU time and other processes' CPU time."""

    def __init__(self) -> None:
        self.wall = self.busy = self.ours = 0.0

    def tick(self, wall: float, ours: float, others: float) -> None:
        self.wall += wall
        self.ours += ours
        self.busy += ours + others

    def clock(self) -> float:
        return self.wall

    def __call__(self) -> tuple[float, float, float]:
        return self.wall, self.busy, self.ours


def test_idle_machine_keeps_all_threads() -> None:
    cpu = FakeCpu()
    g = ThreadGovernor(4, 4, reader=cpu, clock=cpu.clock)
    assert g.update() == 4  # first call only records a sample
    cpu.tick(0.5, ours=2.0, others=0.05)
    assert g.update() == 4


def test_busy_cores_are_given_up_and_taken_back() -> None:
    cpu = FakeCpu()
    g = ThreadGovernor(2, 2, reader=cpu, clock=cpu.clock)
    g.update()
    cpu.tick(0.5, ours=0.6, others=0.4)  # another process took 0.8 of a core
    assert g.update() == 1
    cpu.tick(0.5, ours=0.5, others=0.5)  # still busy
    assert g.update() == 1
    cpu.tick(0.5, ours=0.5, others=0.0)  # it went away
    assert g.update() == 2


def test_light_background_load_does_not_cost_a_thread() -> None:
    cpu = FakeCpu()
    g = ThreadGovernor(2, 2, reader=cpu, clock=cpu.clock)
    g.update()
    cpu.tick(1.0, ours=1.8, others=0.2)
    assert g.update() == 2


def test_decisions_wait_for_the_interval() -> None:
    cpu = FakeCpu()
    g = ThreadGovernor(2, 2, interval=0.25, first_interval=0.05, reader=cpu, clock=cpu.clock)
    cpu.tick(0.02, ours=0.02, others=0.02)  # 1 core busy, but only 20 ms seen
    assert g.update() == 2
    cpu.tick(0.04, ours=0.04, others=0.04)  # the first decision needs only 50 ms
    assert g.update() == 1
    cpu.tick(0.1, ours=0.2, others=0.0)  # later ones wait for the full interval
    assert g.update() == 1
    cpu.tick(0.2, ours=0.4, others=0.0)
    assert g.update() == 2


def test_first_sample_is_taken_at_construction() -> None:
    cpu = FakeCpu()
    g = ThreadGovernor(2, 2, reader=cpu, clock=cpu.clock)
    cpu.tick(0.5, ours=0.0, others=1.0)  # e.g. while the user typed a prompt
    assert g.update() == 1


def test_fixed_threads_never_change() -> None:
    cpu = FakeCpu()
    g = ThreadGovernor(2, 2, adaptive=False, reader=cpu, clock=cpu.clock)
    g.update()
    cpu.tick(1.0, ours=0.5, others=2.0)
    assert g.update() == 2


def test_a_failing_reader_turns_adaptation_off() -> None:
    def broken():
        raise OSError("no /proc")

    g = ThreadGovernor(2, 2, reader=broken)
    assert g.update() == 2 and not g.adaptive


def test_real_cpu_sample_is_monotonic() -> None:
    a = read_cpu_sample()
    c0 = time.process_time()
    # 120 ms of our own CPU time (not wall time: on a loaded machine a wall-clock spin
    # gets less than the 50 ms asserted below)
    while time.process_time() - c0 < 0.12:
        pass
    b = read_cpu_sample()
    assert b[0] - a[0] >= 0.1
    assert b[2] - a[2] >= 0.05  # our CPU seconds, 10 ms ticks
    # everyone's busy time includes ours; both count 10 ms ticks, the per-CPU counters
    # one tick behind at each end on each CPU at worst (seen: 0.11 s busy, 0.13 s ours)
    ncpu = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert b[1] - a[1] >= b[2] - a[2] - 0.01 * (2 * (ncpu or 1) + 1)


@pytest.mark.skipif(
    len(os.sched_getaffinity(0)) < 2 if hasattr(os, "sched_getaffinity") else True,
    reason="needs at least 2 CPUs to give one up",
)
def test_live_busy_process_takes_a_core_away() -> None:
    n = len(os.sched_getaffinity(0))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n - 1)]
    try:
        time.sleep(0.3)
        g = ThreadGovernor(n, n, interval=0.2)
        g.update()
        time.sleep(0.6)
        assert g.update() < n
    finally:
        for p in spinners:
            p.kill()


def test_generator_follows_the_governor(smollm2) -> None:
    """A governor that reports busy cores makes decoding switch Numba to fewer threads."""
    cpu = FakeCpu()
    gen = smollm2.generator
    saved = gen.governor
    gen.governor = ThreadGovernor(2, 2, interval=0.0, reader=cpu, clock=cpu.clock)
    try:
        numba.set_num_threads(2)
        ids = smollm2.tokenize("Once upon a time")
        it = gen.stream(ids, SamplingParams(temperature=0.0), max_tokens=3)
        next(it)
        cpu.tick(0.5, ours=0.5, others=1.0)
        list(it)
        assert gen.stats.threads == 1
        assert numba.get_num_threads() == 1
    finally:
        gen.governor = saved
        numba.set_num_threads(2)


def test_decode_steps_leave_the_weight_reader_its_cores() -> None:
    """A streamed model's decode steps run on decode_reserve fewer threads; prompt
    chunks keep all; never fewer than one, also when other processes took cores."""
    cpu = FakeCpu()
    g = ThreadGovernor(4, 4, interval=0.0, reader=cpu, clock=cpu.clock)
    assert (g.step_threads(decode=True), g.step_threads(decode=False)) == (4, 4)
    g.decode_reserve = 1
    assert (g.step_threads(decode=True), g.step_threads(decode=False)) == (3, 4)
    g.update()
    cpu.tick(0.5, ours=0.5, others=0.75)  # other processes took one and a half cores
    assert g.update() == 2
    assert (g.step_threads(decode=True), g.step_threads(decode=False)) == (1, 2)
    cpu.tick(0.5, ours=0.5, others=1.5)  # three cores busy: one thread left
    assert g.update() == 1
    assert g.step_threads(decode=True) == 1


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs a pool of 2 threads")
def test_generator_decodes_on_the_threads_the_reader_leaves(smollm2) -> None:
    """With a decode reserve the prompt chunk runs on every thread and each decode step
    (the prompt's last token included) on one fewer; the text is the same."""
    gen = smollm2.generator
    saved, forward = gen.governor, gen.model.forward
    seen: list[tuple[int, int]] = []

    def recording_forward(ids, cache, *args, **kwargs):
        seen.append((len(ids), numba.get_num_threads()))
        return forward(ids, cache, *args, **kwargs)

    ids = smollm2.tokenize("Once upon a time, in a small village by the sea,")
    params = SamplingParams(temperature=0.0)
    try:
        gen.governor = ThreadGovernor(2, 2, adaptive=False)
        want = "".join(gen.stream(ids, params, max_tokens=4))
        gen.governor.decode_reserve = 1
        gen.model.forward = recording_forward
        gen.cache.truncate(0)  # the prompt is computed again, not reused
        got = "".join(gen.stream(ids, params, max_tokens=4))
    finally:
        gen.governor, gen.model.forward = saved, forward
        numba.set_num_threads(2)
    assert got == want
    prompt = [t for n, t in seen if n > 1]
    steps = [t for n, t in seen if n == 1]
    assert prompt == [2] and len(steps) == 4 and set(steps) == {1}
    assert gen.stats.threads == 1


def test_offloaded_plans_that_read_leave_the_readers_a_core() -> None:
    """offload/loader.reader_cores: one core for plans that read weights from flash every
    token (dense streaming, sparse mode), none for what is held in RAM, none on one core."""
    from types import SimpleNamespace

    from edgerun.offload.loader import reader_cores

    def cores(mode: str, read: float, threads: int = 2) -> int:
        plan = SimpleNamespace(mode=mode, read_bytes_per_token=read)
        return reader_cores(plan, threads)

    assert cores("dense", 276e6) == 1 and cores("sparse", 600e6) == 1
    assert cores("dense", 0.0) == 0 and cores("resident", 0.0) == 0
    assert cores("dense", 276e6, threads=1) == 0
    assert reader_cores(None, 4) == 0
