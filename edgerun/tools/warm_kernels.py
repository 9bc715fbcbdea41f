"""The child process of offload/warm_kernels.py: load a model, run the kernels of the
warm-up (compiling each into Numba's cache), and exit.

Two modes:
- whole warm-up (budgeted loads, `ensure_kernels_compiled`): load the model resident
  with its row kernels and run every warm-up part; with a memory ceiling, stop before
  the next compile once anonymous memory passed it (exit status PARTIAL);
- `--serve` (KernelPool, the first run of `edgerun generate` and `edgerun warm`): load the
  model as the parent will, then read warm-up part names (engine.WARM_PARTS) on stdin,
  one a line, and run each; until stdin closes. It writes one line per event to stdout:
  `loaded N S`, `fn NAME` after each function it compiled, `done PART N S`, and
  `compiled N S` at the end (N: Numba compilations so far, nested ones included, as
  engine.WarmUp counts them; S: seconds since its start).
  Its compiles hold runtime/numba_cache_lock's per-function lock: its siblings write
  the same cache.
  With EDGERUN_COMPILE_LOG=FILE in the environment each child appends one line per
  compile to FILE (`pid end depth seconds part name`: the wall clock at its end, its
  nesting depth, its own CPU seconds with the nested ones' left out, the part that ran
  it), which benchmarks/ttft.py --cold reads to tell what compiled before the first token.

Both load stand-in weights (offload/stand_in.py, unless --real-weights): the file's
tensor table with zero pages for rows and interleaved copies, so a child holds Numba's
and LLVM's memory and the tokenizer, not its own copy of the model, and compiles the
kernel signatures the real weights take.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from edgerun.offload.warm_kernels import PARTIAL
from edgerun.runtime.sysinfo import proc_status_bytes


def _anonymous_bytes() -> int:
    """This process's resident anonymous memory (Linux; 0 where /proc does not say)."""
    return proc_status_bytes("RssAnon") or 0


def _watch_compiles(
    ceiling: int | None,
    started: float,
    counts: list[int],
    announce: bool = False,
    part: list[str] | None = None,
) -> None:
    """Count Numba's top-level compiles into counts[0] and all of them, the nested ones
    included (what engine.WarmUp counts), into counts[1] (announce: print `fn NAME` after
    each top-level one). With a ceiling: before each one after the first, exit with PARTIAL once
    anonymous memory passed it (what was compiled is cached by then: Numba saves a
    function as its compile ends, before the next starts). part[0]: the part running now,
    for EDGERUN_COMPILE_LOG's lines."""
    from numba.core import event

    log_path = os.environ.get("EDGERUN_COMPILE_LOG")
    log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115 - till exit
    where = part if part is not None else ["-"]

    class Ceiling(event.Listener):
        depth = 0
        cpu: list[list[float]] = []  # per open compile: its start, its nested ones' CPU

        def on_start(self, ev: event.Event) -> None:
            over = ceiling is not None and counts[0] > 0 and _anonymous_bytes() > ceiling
            if self.depth == 0 and over:
                print(f"compiled {counts[0]} {time.perf_counter() - started:.1f}", flush=True)
                os._exit(PARTIAL)
            self.depth += 1
            counts[1] += 1
            self.cpu.append([time.process_time(), 0.0])

        def on_end(self, ev: event.Event) -> None:
            self.depth -= 1
            t0, nested = self.cpu.pop()
            spent = time.process_time() - t0
            if self.cpu:
                self.cpu[-1][1] += spent
            func = getattr(ev.data.get("dispatcher"), "py_func", None)
            name = f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', '?')}"
            if log is not None:
                own = spent - nested
                log.write(
                    f"{os.getpid()} {time.time():.3f} {self.depth} {own:.3f} {where[0]} {name}\n"
                )
            if self.depth == 0:
                counts[0] += 1
                if announce:
                    print(f"fn {getattr(func, '__qualname__', '?')}", flush=True)

    event.register("numba:compile", Ceiling())


@contextmanager
def stand_in_weights(on: bool = True) -> Iterator[None]:
    """While open, edgerun.load reads a GGUF's matrices as zero pages and gives them
    zero-page interleaved copies (offload/stand_in.py): the two places a load reads or
    makes weight bytes, swapped in this process only (a compile child)."""
    if not on:
        yield
        return
    from edgerun import api
    from edgerun.offload.stand_in import StandInFile, stand_in_interleave
    from edgerun.ops import qmatvec

    read, interleave = api.read_gguf, qmatvec.interleave
    api.read_gguf = lambda path: StandInFile(read(path))
    qmatvec.interleave = stand_in_interleave
    try:
        yield
    finally:
        api.read_gguf, qmatvec.interleave = read, interleave


def _serve(a: argparse.Namespace, started: float, counts: list[int], now: list[str]) -> int:
    import edgerun
    from edgerun.runtime.numba_cache_lock import install

    install()  # before the first compile: the load's own kernels are shared too
    interleave = {"on": True, "off": False}.get(a.interleave)
    with stand_in_weights(not a.real_weights):
        m = edgerun.load(a.path, n_ctx=16, threads=1, kv_type=a.kv_type, interleave=interleave)
    print(f"loaded {counts[1]} {time.perf_counter() - started:.1f}", flush=True)
    for line in sys.stdin:
        part = line.strip()
        if part:
            now[0] = part
            m.engine.warm_part(part)
            print(f"done {part} {counts[1]} {time.perf_counter() - started:.1f}", flush=True)
    print(f"compiled {counts[1]} {time.perf_counter() - started:.1f}", flush=True)
    return 0


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
    ap.add_argument(
        "--serve",
        action="store_true",
        help="run the warm-up parts named on stdin, one a line (see the module doc)",
    )
    ap.add_argument(
        "--interleave",
        choices=("auto", "on", "off"),
        default="auto",
        help="--serve: the interleaved decode copies, as the parent loads them",
    )
    ap.add_argument(
        "--real-weights",
        action="store_true",
        help="load the model's weights and copies instead of stand-ins (a comparison)",
    )
    a = ap.parse_args(argv)
    started = time.perf_counter()
    counts = [0, 0]
    now = ["load"]  # the part running
    _watch_compiles(a.stop_above, started, counts, announce=a.serve, part=now)
    if a.serve:
        return _serve(a, started, counts, now)
    from edgerun.api import load

    # the budgeted parent runs the row kernels (interleaved copies are resident-only)
    with stand_in_weights(not a.real_weights):
        m = load(a.path, n_ctx=16, threads=1, kv_type=a.kv_type, interleave=False)
    m.warm_up()
    print(f"compiled {counts[0]} {time.perf_counter() - started:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
