"""Process plumbing that knows no model: the Numba environment, the compute thread,
the thread governor, memory and cgroup readings, atomic writes, progress."""
