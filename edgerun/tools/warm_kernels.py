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
- `--serve --jobs N` (Linux): the same lines, but each part runs in a child forked from
  this process, at most N at once, which exits when its part is done (a failed one
  writes `failed PART`). Numba keeps what every compile allocated until its process
  exits (measured on SmolLM2: 114 MiB anonymous after the load, 265 after the decode
  step's kernels, 316 after the prompt's), so a child a part gives LLVM's memory back
  after each part, and the children share this process's interpreter, Numba and
  stand-in model copy-on-write instead of importing and loading their own (SmolLM2: 83
  MiB anonymous, 4 s of CPU each). With --load-apart this process compiles nothing
  itself: the load's own kernels compile in a first child before it loads the model from
  the cache. It runs
  Numba's parallel kernels on the "workqueue" threading layer, which re-starts its
  threads in a forked child; the default GNU OpenMP layer aborts a child forked from a
  process that ran a parallel region.

Both load stand-in weights (offload/stand_in.py, unless --real-weights): the file's
tensor table with zero pages for rows and interleaved copies, so a child holds Numba's
and LLVM's memory and the tokenizer, not its own copy of the model, and compiles the
kernel signatures the real weights take.
"""

from __future__ import annotations

import argparse
import os
import selectors
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from edgerun.offload.warm_kernels import PARTIAL
from edgerun.runtime.sysinfo import proc_status_bytes


def _anonymous_bytes() -> int:
    """This process's resident anonymous memory (Linux; 0 where /proc does not say)."""
    return proc_status_bytes("RssAnon") or 0


def _watch_compiles(
    ceiling: int | None, started: float, counts: list[int], announce: bool = False
) -> None:
    """Count Numba's top-level compiles into counts[0] and all of them, the nested ones
    included (what engine.WarmUp counts), into counts[1] (announce: print `fn NAME` after
    each top-level one). With a ceiling: before each one after the first, exit with PARTIAL once
    anonymous memory passed it (what was compiled is cached by then: Numba saves a
    function as its compile ends, before the next starts)."""
    from numba.core import event

    class Ceiling(event.Listener):
        depth = 0

        def on_start(self, ev: event.Event) -> None:
            over = ceiling is not None and counts[0] > 0 and _anonymous_bytes() > ceiling
            if self.depth == 0 and over:
                print(f"compiled {counts[0]} {time.perf_counter() - started:.1f}", flush=True)
                os._exit(PARTIAL)
            self.depth += 1
            counts[1] += 1

        def on_end(self, ev: event.Event) -> None:
            self.depth -= 1
            if self.depth == 0:
                counts[0] += 1
                if announce:
                    func = getattr(ev.data.get("dispatcher"), "py_func", None)
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


def _serve(a: argparse.Namespace, started: float, counts: list[int]) -> int:
    from edgerun.runtime.numba_cache_lock import install

    install()  # before the first compile: the load's own kernels are shared too
    m = _load_model(a)
    print(f"loaded {counts[1]} {time.perf_counter() - started:.1f}", flush=True)
    for line in sys.stdin:
        part = line.strip()
        if part:
            m.engine.warm_part(part)
            print(f"done {part} {counts[1]} {time.perf_counter() - started:.1f}", flush=True)
    print(f"compiled {counts[1]} {time.perf_counter() - started:.1f}", flush=True)
    return 0


def _load_model(a: argparse.Namespace):
    import edgerun

    interleave = {"on": True, "off": False}.get(a.interleave)
    with stand_in_weights(not a.real_weights):
        return edgerun.load(a.path, n_ctx=16, threads=1, kv_type=a.kv_type, interleave=interleave)


def _fork(run: Callable[[], object], counts: list[int]) -> tuple[int, int]:
    """Run `run` in a forked child that writes the Numba compilations it made to a pipe
    and exits; (its pid, the pipe's read end). The child dies with this process."""
    sys.stdout.flush()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        status = 1
        try:
            os.close(r)
            _die_with_parent()
            before = counts[1]
            run()
            os.write(w, f"{counts[1] - before}\n".encode())
            status = 0
        except BaseException:  # noqa: BLE001 - a failed part: the status says so
            import traceback

            traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
            finally:
                os._exit(status)
    os.close(w)
    return pid, r


def _die_with_parent() -> None:
    """Have the kernel end this process when its parent dies (Linux's PR_SET_PDEATHSIG):
    a killed fork server leaves no compile running."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _reap(pid: int, r: int) -> int | None:
    """The compilations a forked child reported, once it exited (None: it failed)."""
    chunks = []
    while chunk := os.read(r, 64):
        chunks.append(chunk)
    os.close(r)
    _, status = os.waitpid(pid, 0)
    text = b"".join(chunks).decode().strip()
    if status != 0 or not text.isdigit():
        return None
    return int(text)


def _serve_forking(a: argparse.Namespace, started: float, counts: list[int]) -> int:
    """--serve --jobs N: each part in a forked child, at most N at once (module doc)."""
    import numba

    from edgerun.runtime.numba_cache_lock import install

    numba.config.THREADING_LAYER = "workqueue"  # before this process's first parallel kernel
    install()
    compiled = 0
    if a.load_apart:
        # the load's own kernels (the interleaved copies', the tokenizer's tables) compile
        # in a child first: what LLVM keeps of them (SmolLM2: 31 MiB) would otherwise sit
        # in this process and every fork of it; the parts start that much later (the
        # 1.5B: ~2 s of CPU), so only where memory is short
        pid, r = _fork(lambda: _load_model(a), counts)
        compiled = _reap(pid, r) or 0
    m = _load_model(a)
    own = counts[1]  # what this process compiled itself (nothing where the child loaded)
    print(f"loaded {compiled + own} {time.perf_counter() - started:.1f}", flush=True)

    sel = selectors.DefaultSelector()
    sel.register(0, selectors.EVENT_READ)
    waiting: list[str] = []
    running: dict[int, tuple[int, str]] = {}  # read end -> (pid, part)
    pending, open_ = b"", True
    while open_ or waiting or running:
        while waiting and len(running) < a.jobs:
            part = waiting.pop(0)
            pid, r = _fork(lambda part=part: m.engine.warm_part(part), counts)
            running[r] = (pid, part)
            sel.register(r, selectors.EVENT_READ)
        for key, _ in sel.select():
            if key.fd == 0:
                data = os.read(0, 4096)
                if not data:
                    open_ = False
                    sel.unregister(0)
                    continue
                *lines, pending = (pending + data).split(b"\n")
                waiting += [x.decode().strip() for x in lines if x.strip()]
                continue
            pid, part = running.pop(key.fd)
            sel.unregister(key.fd)
            n = _reap(pid, key.fd)
            if n is None:
                print(f"failed {part}", flush=True)
                continue
            compiled += n
            done = f"{compiled + own} {time.perf_counter() - started:.1f}"
            print(f"done {part} {done}", flush=True)
    print(f"compiled {compiled + own} {time.perf_counter() - started:.1f}", flush=True)
    return 0


class ForkedChild:
    """A child forked from this process, with what KernelPool uses of a subprocess.Popen:
    text pipes to its stdin and from its stdout, poll, wait, kill and returncode."""

    def __init__(self, pid: int, stdin: Any, stdout: Any) -> None:
        self.pid, self.stdin, self.stdout = pid, stdin, stdout
        self.returncode: int | None = None
        self._lock = threading.Lock()  # one waitpid at a time (a second gets ECHILD)

    def wait(self) -> int:
        with self._lock:
            if self.returncode is None:
                _, status = os.waitpid(self.pid, 0)
                self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode

    def poll(self) -> int | None:
        if not self._lock.acquire(blocking=False):
            return None  # another thread waits for it: still running
        try:
            if self.returncode is None:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
            return self.returncode
        finally:
            self._lock.release()

    def kill(self) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, 9)
            except ProcessLookupError:
                pass


def fork_here(argv: list[str]) -> ForkedChild | None:
    """Run main(argv) (the fork server, --serve --jobs) in a fork of this process, which
    then shares this process's interpreter, Numba and edgerun modules copy-on-write
    instead of importing its own (about 50 MiB of anonymous memory, 110 MiB of RSS).
    None where forking is not safe here: off Linux, where another thread runs (it may
    hold a lock the child would wait on forever), or once Numba's parallel threads are up
    (GNU OpenMP aborts a forked child that starts a parallel region)."""
    if not sys.platform.startswith("linux") or threading.active_count() > 1:
        return None
    if "numba" in sys.modules:
        from numba.np.ufunc import parallel

        if getattr(parallel, "_is_initialized", True):
            return None
    parts_r, parts_w = os.pipe()
    events_r, events_w = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the fork server: never returns
        status = 1
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(parts_r, 0)
            os.dup2(events_w, 1)
            os.dup2(devnull, 2)  # as a KernelPool child's stderr
            for fd in (parts_r, parts_w, events_r, events_w, devnull):
                os.close(fd)
            sys.stdin = open(0, closefd=False)  # noqa: SIM115 - this process's own
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            _die_with_parent()
            status = main(argv)
        except BaseException:  # noqa: BLE001 - the status says it failed
            pass
        finally:
            os._exit(status)
    os.close(parts_r)
    os.close(events_w)
    return ForkedChild(pid, open(parts_w, "w", buffering=1), open(events_r))  # noqa: SIM115


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
        "--jobs",
        type=int,
        default=0,
        help="--serve: run each part in a child forked from this process, this many at "
        "once (Linux; 0: each part in this process)",
    )
    ap.add_argument(
        "--load-apart",
        action="store_true",
        help="--jobs: compile the load's own kernels in a child before this process loads "
        "the model (it then holds no compiler memory)",
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
    _watch_compiles(a.stop_above, started, counts, announce=a.serve)
    if a.serve and a.jobs > 0:
        return _serve_forking(a, started, counts)
    if a.serve:
        return _serve(a, started, counts)
    from edgerun.api import load

    # the budgeted parent runs the row kernels (interleaved copies are resident-only)
    with stand_in_weights(not a.real_weights):
        m = load(a.path, n_ctx=16, threads=1, kv_type=a.kv_type, interleave=False)
    m.warm_up()
    print(f"compiled {counts[0]} {time.perf_counter() - started:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
