"""The child process of offload/warm_kernels.py: load a model resident, run every kernel
it uses once (compiling each into Numba's cache), and exit; with a memory ceiling, stop
before the next compile once anonymous memory passed it (exit status PARTIAL)."""

from __future__ import annotations

import argparse
import os
import sys
import time

from edgerun.offload.warm_kernels import PARTIAL
from edgerun.runtime.sysinfo import proc_status_bytes


def _anonymous_bytes() -> int:
    """This process's resident anonymous memory (Linux; 0 where /proc does not say)."""
    return proc_status_bytes("RssAnon") or 0


def _watch_compiles(ceiling: int | None, started: float, counts: list[int]) -> None:
    """Count Numba's top-level compiles into counts[0]. With a ceiling: before each one
    after the first, exit with PARTIAL once anonymous memory passed it (what was compiled
    is cached by then: Numba saves a function as its compile ends, before the next
    starts)."""
    from numba.core import event

    class Ceiling(event.Listener):
        depth = 0

        def on_start(self, ev: event.Event) -> None:
            over = ceiling is not None and counts[0] > 0 and _anonymous_bytes() > ceiling
            if self.depth == 0 and over:
                print(f"compiled {counts[0]} {time.perf_counter() - started:.1f}", flush=True)
                os._exit(PARTIAL)
            self.depth += 1

        def on_end(self, ev: event.Event) -> None:
            self.depth -= 1
            if self.depth == 0:
                counts[0] += 1

    event.register("numba:compile", Ceiling())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="compile a model's kernels into Numba's cache")
    ap.add_argument("path")
    ap.add_argument("--kv-type", default="f16")
    ap.add_argument(
        "--stop-above",
        type=int,
        default=None,
        help="anonymous bytes past which the child stops before its next compile "
        f"(exit status {PARTIAL}: run it again to go on)",
    )
    a = ap.parse_args(argv)
    started = time.perf_counter()
    counts = [0]
    _watch_compiles(a.stop_above, started, counts)
    from edgerun.api import load

    # the budgeted parent runs the row kernels (interleaved copies are resident-only)
    m = load(a.path, n_ctx=16, threads=1, kv_type=a.kv_type, interleave=False)
    m.warm_up()
    print(f"compiled {counts[0]} {time.perf_counter() - started:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
