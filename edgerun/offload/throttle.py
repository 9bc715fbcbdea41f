"""Storage emulation: make reads take as long as they would on a slower device.

A `StorageThrottle` models one device that serves one read at a time: a read of L bytes
at offset O takes L / rate, with the rate interpolated (on log2 of the size) from the
device's sequential figures when O continues the previous read, else its random ones.
`DirectReader` asks it for a deadline before each read and sleeps until the deadline
after the real read, so a read takes max(real time, device time) and concurrent reads
queue behind each other, as on the emulated device. A faster real disk is slowed down;
a slower one cannot be sped up (the reported figure then is the real one).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from edgerun.errors import InvalidArgumentError
from edgerun.offload.io import interpolate_rate

__all__ = ["StorageThrottle", "interpolate_rate"]

SLACK_S = 0.005


class StorageThrottle:
    """One emulated device's timing for a reader's reads (thread-safe)."""

    def __init__(self, sequential: Mapping[int, float], random: Mapping[int, float]) -> None:
        for what, pts in (("sequential", sequential), ("random", random)):
            if not pts or any(float(v) <= 0 for v in pts.values()):
                raise InvalidArgumentError(f"storage profile: {what} rates must be positive")
        self.sequential = {int(k): float(v) for k, v in sequential.items()}
        self.random = {int(k): float(v) for k, v in random.items()}
        self._lock = threading.Lock()
        self._busy_until = 0.0
        self._next_offset: int | None = None
        self.device_seconds = 0.0  # total emulated service time

    def admit(self, offset: int, length: int) -> float:
        """Queue a read on the emulated device; returns the time (perf_counter) it ends."""
        with self._lock:
            seq = offset == self._next_offset
            rate = interpolate_rate(self.sequential if seq else self.random, max(1, length))
            service = length / rate
            now = time.perf_counter()
            # A device idle for less than SLACK_S is treated as busy since its last read,
            # so a sleep that overshot (sleep granularity is ~0.1 ms, a 4 KiB read on a
            # microSD ~0.3 ms) is made up by the next reads instead of adding up.
            start = self._busy_until if now - self._busy_until < SLACK_S else now
            end = start + service
            self._busy_until = end
            self._next_offset = offset + length
            self.device_seconds += service
            return end

    @staticmethod
    def wait_until(deadline: float) -> None:
        delay = deadline - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
