"""How many threads decoding should use while other processes share the CPUs.

OpenMP threads spin between the ~200 parallel regions of a decode step unless
the wait policy is "passive" (see numba_env.wait_policy). That is fast on idle
cores and ruinous on busy ones: a spinning thread holds a core while the thread
that has the work waits for a scheduler slice. On 2 cores, SmolLM2 decode, one
other busy process: 2 threads with libgomp's default spin 62 tok/s (spinning
forever: 2), 1 thread 113, 2 threads sleeping ("passive") 101; idle machine: 2
threads spinning 177 (`python benchmarks/shared_cpu.py` re-measures). So with
automatic threads and a spinning wait
policy, the governor re-reads the CPU time other processes took (every quarter
second) and uses only the cores they leave free.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

# (wall seconds, busy CPU-seconds on our CPUs summed over all processes, our CPU-seconds)
CpuSample = tuple[float, float, float]


def set_threads(n: int) -> None:
    """Threads Numba's parallel kernels use from now on (capped at its pool size)."""
    import numba

    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def _our_cpus() -> list[int] | None:
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: every CPU
        return None


def read_cpu_sample() -> CpuSample:
    """CPU time spent on the CPUs this process may use, by everyone and by us."""
    import psutil

    cpus = _our_cpus()
    per_cpu = psutil.cpu_times(percpu=True)
    if cpus is not None:
        per_cpu = [per_cpu[i] for i in cpus if i < len(per_cpu)]
    busy = 0.0
    for t in per_cpu:
        idle = t.idle + getattr(t, "iowait", 0.0)
        busy += sum(t) - idle
    ours = psutil.Process().cpu_times()
    return time.monotonic(), busy, ours.user + ours.system


def wait_policy_spins() -> bool:
    """Whether OpenMP threads spin between parallel regions (this process's setting)."""
    return os.environ.get("OMP_WAIT_POLICY", "").strip().lower() != "passive"


class ThreadGovernor:
    """Chooses the thread count for the next tokens: the cores other processes leave idle.

    With adaptive False it always answers max_threads (threads the user asked for,
    or a sleeping wait policy, where extra threads do no harm).

    `decode_reserve` cores are left to this process's own weight readers during decode
    steps (step_threads): a model that reads FFN weights from flash every token has
    threads reading them, and compute threads on every core starve them. On 2 vCPUs,
    Qwen2.5-Coder-1.5B at 560 MiB (520 MB read a token): decode with 1 compute thread
    3.1-3.8 tok/s, I/O wait 12-40 ms a token; with 2, 2.3-2.6 tok/s, I/O wait 180-200
    ms (`python benchmarks/offload.py -m qwen2.5-coder-1.5b --budgets 560M`). A prompt
    chunk is compute-bound (its rows are read once for the whole chunk), so it keeps
    every core.
    """

    def __init__(
        self,
        max_threads: int,
        n_cpus: int,
        adaptive: bool = True,
        interval: float = 0.25,
        reader: Callable[[], CpuSample] = read_cpu_sample,
        first_interval: float = 0.05,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_threads = max(1, max_threads)
        self.n_cpus = max(1, n_cpus)
        self.adaptive = adaptive
        self.interval = interval
        # The first decision comes sooner: until it, a busy machine pays the full
        # price of spinning threads. 50 ms of CPU accounting (10 ms ticks) tells a
        # busy core from an idle one.
        self._window = min(first_interval, interval)
        self._reader = reader
        self._clock = clock
        self._due = 0.0  # clock time of the next decision; reading /proc costs ~0.1 ms
        self._last: CpuSample | None = None
        self.threads = self.max_threads
        self.decode_reserve = 0
        if adaptive:
            self.update()  # the first sample: decoding can decide on its first token

    def update(self) -> int:
        """Threads to use now; re-decided at most once per interval."""
        if not self.adaptive or self._clock() < self._due:
            return self.threads
        try:
            now = self._reader()
        except Exception:  # noqa: BLE001 - no CPU accounting here: keep the count
            self.adaptive = False
            return self.threads
        if self._last is None:
            self._last = now
            self._due = self._clock() + self._window
            return self.threads
        wall = now[0] - self._last[0]
        if wall <= 0.0 or wall < self._window:
            return self.threads
        self._window = self.interval
        self._due = self._clock() + self.interval
        others = max(0.0, (now[1] - self._last[1]) - (now[2] - self._last[2])) / wall
        self._last = now
        free = self.n_cpus - others
        # A core counts as free when at least ~70% of it is; never below one thread.
        self.threads = max(1, min(self.max_threads, int(free + 0.3)))
        return self.threads

    def step_threads(self, decode: bool) -> int:
        """Threads for the next forward pass: a decode step leaves decode_reserve cores
        to the weight reader; a prompt chunk takes all the governor allows."""
        if decode:
            return max(1, self.threads - self.decode_reserve)
        return self.threads
