"""Compile a model's kernels in a child process before a budgeted load.

Numba's first compile of the kernels holds a few hundred MB of LLVM memory for about
a minute, and no RAM plan counts it. Measured on a fresh machine: the first
`--ram-budget 800M` run of Qwen2.5-Coder-1.5B in an 840 MiB cgroup compiled beside
its held rows (823 MiB anonymous) and thrashed at the limit for over 20 minutes
(memory.failcnt 236 million) without a token. So before a budgeted load whose kernels
were never compiled, a child loads the model resident on stand-in weights (the file's
tensor table over zero pages, offload/stand_in.py: no weight is read or resident),
compiles and caches every kernel the model's formats use, and exits. The parent then
loads them from Numba's disk cache.

The child itself must fit the budget too: Numba keeps what every compile allocated
until the process exits (Qwen2.5-Coder-0.5B: 664 MiB anonymous after all 173 kernels,
one of them 156 MiB), more than a 400 MiB budget holds, and such a child thrashed at
its cgroup's limit for over 5 minutes. So a child given a memory ceiling stops before
its next compile once its anonymous memory passes it (everything compiled so far is in
the cache by then) and exits with PARTIAL; the parent starts another, which loads those
kernels from the cache (little memory) and compiles on, until one finishes.

A marker in Numba's cache directory records that this model was warmed with these
kernel sources, kernel path and KV type, so later loads skip the children.

KernelPool is the same idea for a resident first run (`edgerun generate`, `edgerun
warm`): the warm-up's parts (engine.WARM_PARTS) go to one child per free core, each of
which loads the model on stand-in weights and compiles the parts it is handed
(runtime/numba_cache_lock.py keeps their shared cache whole). The stand-ins keep each
child to Numba's and LLVM's memory: with the model's own weights and interleaved copies
in every child, the first run's processes together would hold 2.8x a warm run's RSS
(Qwen2.5-Coder-1.5B: 3724 vs 1321 MiB). The serving process only loads from the cache:
measured on SmolLM2, compiling in-process took its peak RSS from 230 to 640 MiB. It
starts its prompt once the prompt's parts are cached and waits for the decode step's before its
first decode step. A marker per part records what is cached.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from edgerun.offload.io import drop_page_cache
from edgerun.runtime.numba_env import sources_stamp

__all__ = ["KernelPool", "ensure_kernels_compiled", "part_marker", "warm_marker"]


def warm_marker(path: str | os.PathLike, kv_type: str, kernels: str) -> Path | None:
    """The marker file for this model, KV type and kernel path (None without a cache)."""
    cache = os.environ.get("NUMBA_CACHE_DIR")
    if not cache:
        return None
    p = Path(path).resolve()
    st = p.stat()
    text = f"{p}|{st.st_size}|{st.st_mtime_ns}|{kv_type}|{kernels}|{sources_stamp()}"
    return Path(cache) / "warm" / hashlib.sha256(text.encode()).hexdigest()[:20]


PARTIAL = 75  # a child's exit status: it stopped at its memory ceiling, run another
# What one compile may add to a child's anonymous memory, the first one's Numba and
# LLVM start-up included (measured: 156 MiB for qmatvec_vnni.mvb_q5_0 alone, 210 MiB
# as a process's first compile): a child stops while it has this much left.
COMPILE_HEADROOM_BYTES = 224 << 20
MAX_CHILDREN = 200  # each child compiles at least one function, so this bounds a bug


def ensure_kernels_compiled(
    path: str | os.PathLike, kv_type: str, kernels: str, memory_bytes: int | None = None
) -> bool:
    """Compile `path`'s kernels in children unless the marker says they are cached.

    memory_bytes: what the children may use (the RAM budget less what the caller holds);
    each child stops COMPILE_HEADROOM_BYTES short of it and another goes on. None: one
    child compiles everything. Returns True when the children ran and succeeded. A child
    that fails (no memory even for it, a broken install) is not fatal: the caller's own
    warm-up compiles then."""
    marker = warm_marker(path, kv_type, kernels)
    if marker is None or marker.exists():
        return False
    env = dict(os.environ, EDGERUN_KERNELS=kernels)
    cmd = [sys.executable, "-m", "edgerun.tools.warm_kernels", str(path), "--kv-type", kv_type]
    if memory_bytes is not None:
        ceiling = max(0, memory_bytes - COMPILE_HEADROOM_BYTES)
        cmd += ["--stop-above", str(ceiling)]
    compiled, seconds, children, rc = 0, 0.0, 0, PARTIAL
    while rc == PARTIAL and children < MAX_CHILDREN:
        r = subprocess.run(cmd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True)
        drop_page_cache([path])  # the child's mapped pages would count against the budget
        children, rc = children + 1, r.returncode
        for line in r.stdout.splitlines():
            if line.startswith("compiled "):
                n, s = line.split()[1:3]
                compiled, seconds = compiled + int(n), seconds + float(s)
    if rc != 0:
        return False
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.write_text(f"{compiled} functions compiled in {seconds:.1f} s by {children} processes\n")
    return True


def part_marker(
    path: str | os.PathLike, kv_type: str, kernels: str, interleave: str, part: str
) -> Path | None:
    """The marker of one warm-up part of this model compiled by a KernelPool (None
    without a cache directory)."""
    base = warm_marker(path, kv_type, f"{kernels}|{interleave}")
    return None if base is None else base.with_name(f"{base.name}.{part}")


@dataclass
class _Child:
    proc: subprocess.Popen
    loaded: bool = False
    part: str | None = None  # the part it compiles now
    compiled: int = 0  # Numba compilations so far (nested ones included)
    alive: bool = True


@dataclass
class PoolState:
    """What a KernelPool's children have done, for a progress display."""

    started: float = field(default_factory=time.monotonic)
    parts: list[str] = field(default_factory=list)  # every part asked for, in order
    done: dict[str, float] = field(default_factory=dict)  # part -> seconds from the start
    failed: set[str] = field(default_factory=set)
    running: list[str] = field(default_factory=list)
    functions: int = 0  # top-level functions compiled (the children's `fn` lines)
    last_function: str = ""

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started


class KernelPool:
    """Child processes (tools/warm_kernels.py --serve) that compile a model's warm-up
    parts into Numba's disk cache while this process waits for the parts it needs.

        pool = KernelPool.start(path, kv_type, kernels, ["prompt", "decode"])
        pool.wait_loaded()            # the load's own kernels (tokenizer, copies) cached
        model = edgerun.load(path)    # loads them from the cache
        pool.wait(["prompt"])         # then the prompt runs ...
        pool.wait(["decode"])         # ... and the first decode step
        pool.close()

    Parts whose marker exists are skipped (start returns None when all are). A child
    that dies leaves its part failed: the caller's own first call of those kernels
    compiles them then, in-process, as without a pool.
    """

    def __init__(
        self,
        path: Path,
        kv_type: str,
        kernels: str,
        interleave: str,
        workers: int,
        command: list[str] | None = None,
    ) -> None:
        """command: the child's command line (default tools/warm_kernels.py --serve for
        this model; a test gives a stand-in that speaks the same lines)."""
        self.path, self.kv_type, self.kernels, self.interleave = path, kv_type, kernels, interleave
        self.state = PoolState()
        self.queue: list[str] = []
        self.cond = threading.Condition()
        self.children: list[_Child] = []
        self.closing = False
        env = dict(os.environ, EDGERUN_KERNELS=kernels)
        cmd = command or [
            *(sys.executable, "-m", "edgerun.tools.warm_kernels", str(path), "--serve"),
            *("--kv-type", kv_type, "--interleave", interleave),
        ]
        for _ in range(workers):
            proc = subprocess.Popen(
                cmd,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
                bufsize=1,
            )
            child = _Child(proc)
            self.children.append(child)
            threading.Thread(target=self._read, args=(child,), daemon=True).start()

    @classmethod
    def start(
        cls,
        path: str | os.PathLike,
        kv_type: str,
        kernels: str,
        parts: Iterable[str],
        interleave: bool | None = None,
        workers: int | None = None,
        command: list[str] | None = None,
    ) -> KernelPool | None:
        """Start children for those of `parts` not cached yet (None: all are). workers
        None: one per core this process may run on, at most one per part."""
        mode = {True: "on", False: "off"}.get(interleave, "auto")  # type: ignore[arg-type]
        todo = [p for p in parts if not _marked(path, kv_type, kernels, mode, p)]
        if not todo or warm_marker(path, kv_type, kernels) is None:
            return None
        if workers is None:
            workers = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
            workers = min(workers, children_that_fit())
        from edgerun.runtime.numba_cache_lock import install

        install()  # this process may compile beside the children (a part that failed)
        n = max(1, min(workers, len(todo)))
        pool = cls(Path(path), kv_type, kernels, mode, n, command)
        pool.submit(todo)
        return pool

    # -- the children's lines ---------------------------------------------------------
    def _read(self, child: _Child) -> None:
        assert child.proc.stdout is not None
        for line in child.proc.stdout:
            words = line.split()
            if not words:
                continue
            with self.cond:
                if words[0] == "fn":
                    self.state.functions += 1
                    self.state.last_function = " ".join(words[1:])
                elif words[0] == "loaded":
                    child.loaded, child.compiled = True, int(words[1])
                    self._dispatch(child)
                elif words[0] == "done":
                    part, child.compiled = words[1], int(words[2])
                    self.state.done[part] = self.state.elapsed
                    self.state.running.remove(part)
                    child.part = None
                    marker = part_marker(
                        self.path, self.kv_type, self.kernels, self.interleave, part
                    )
                    if marker is not None:
                        marker.parent.mkdir(parents=True, exist_ok=True)
                        marker.write_text(f"compiled by a KernelPool child in {words[3]} s\n")
                    self._dispatch(child)
                elif words[0] == "compiled":
                    child.compiled = int(words[1])
                self.cond.notify_all()
        child.proc.wait()
        with self.cond:
            child.alive = False
            if child.part is not None:  # died in a part: the caller compiles it itself
                self.state.failed.add(child.part)
                self.state.running.remove(child.part)
                child.part = None
            if not any(c.alive for c in self.children):  # nobody left for the queue
                self.state.failed.update(self.queue)
                self.queue.clear()
            self.cond.notify_all()

    def _dispatch(self, child: _Child) -> None:
        """Hand an idle, loaded child the next part (or end it when none is left and the
        pool is closing). Called with the lock held."""
        if not (child.alive and child.loaded and child.part is None):
            return
        stdin = child.proc.stdin
        if self.queue:
            part = self.queue.pop(0)
            child.part = part
            self.state.running.append(part)
            try:
                assert stdin is not None
                stdin.write(part + "\n")
                stdin.flush()
            except (BrokenPipeError, OSError):
                pass  # it died: _read marks the part failed
        elif self.closing and stdin is not None and not stdin.closed:
            try:
                stdin.close()
            except OSError:
                pass

    # -- the caller's side ------------------------------------------------------------
    def submit(self, parts: Iterable[str], first: bool = False) -> None:
        """Queue parts not asked for yet (first: ahead of those waiting)."""
        with self.cond:
            new = [p for p in dict.fromkeys(parts) if p not in self.state.parts]
            new = [
                p
                for p in new
                if not _marked(self.path, self.kv_type, self.kernels, self.interleave, p)
            ]
            self.state.parts += new
            self.queue = new + self.queue if first else self.queue + new
            for child in self.children:
                self._dispatch(child)
            if not any(c.alive for c in self.children):
                self.state.failed.update(self.queue)
                self.queue.clear()

    def wait_loaded(self, tick: Callable[[PoolState], object] | None = None) -> bool:
        """Wait until a child has loaded the model (the load's own kernels are cached).
        False: every child died first."""
        return self._wait(lambda: any(c.loaded for c in self.children), tick) and any(
            c.loaded for c in self.children
        )

    def wait(self, parts: Iterable[str], tick: Callable[[PoolState], object] | None = None) -> bool:
        """Wait until each of `parts` is compiled (or failed, or was never asked for).
        tick(state) runs every half second and on each event. True: all were compiled."""
        parts = [p for p in parts if p in self.state.parts]
        st = self.state
        self._wait(lambda: all(p in st.done or p in st.failed for p in parts), tick)
        return all(p in st.done for p in parts)

    def marked(self, part: str) -> bool:
        """Whether an earlier pool compiled `part` (its marker exists)."""
        return _marked(self.path, self.kv_type, self.kernels, self.interleave, part)

    def finished(self, parts: Iterable[str]) -> bool:
        """Whether each of `parts` is compiled, failed or was never asked for (no wait)."""
        st = self.state
        with self.cond:
            return all(p in st.done or p in st.failed or p not in st.parts for p in parts)

    def _wait(self, ready: Callable[[], bool], tick: Callable[[PoolState], object] | None) -> bool:
        with self.cond:
            while True:
                if tick is not None:
                    tick(self.state)
                if ready():
                    return True
                if not any(c.alive for c in self.children):
                    return ready()
                self.cond.wait(0.5)

    @property
    def processes(self) -> int:
        return len(self.children)

    def compiled(self) -> int:
        """Numba compilations the children made (nested ones included)."""
        with self.cond:
            return sum(c.compiled for c in self.children)

    def close(self, wait: bool = True) -> None:
        """Let the children finish what they were handed and exit (wait: for them)."""
        with self.cond:
            self.closing = True
            self.state.failed.update(self.queue)  # never started: not compiled
            self.queue.clear()
            for child in self.children:
                self._dispatch(child)
        if wait:
            for child in self.children:
                child.proc.wait()

    def kill(self) -> None:
        """Stop the children now (an interrupted caller)."""
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.kill()
        for child in self.children:
            child.proc.wait()


# What one KernelPool child holds: the interpreter, the tokenizer, Numba and LLVM while
# compiling (its weights are stand-ins, offload/stand_in.py). Measured peaks of the two
# children of a first answer: SmolLM2 328 and 297 MiB, Qwen2.5-Coder-1.5B 391 and 328.
CHILD_COMPILE_BYTES = 384 << 20


def children_that_fit() -> int:
    """How many KernelPool children the memory left holds at once (at least one: a lone
    child needs no more than the serving process's own compile would)."""
    from edgerun.runtime.sysinfo import memory_headroom_bytes

    return max(1, memory_headroom_bytes() // CHILD_COMPILE_BYTES)


def _marked(path: str | os.PathLike, kv_type: str, kernels: str, mode: str, part: str) -> bool:
    marker = part_marker(path, kv_type, kernels, mode, part)
    return marker is not None and marker.exists()
