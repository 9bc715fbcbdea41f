"""The first run's kernel compile, as a user meets it: in child processes, with progress.

On a fresh install Numba compiles every kernel a model runs before its first answer
(SmolLM2 on 2 cores: 76 s, 83 functions, in the serving process, which printed nothing
meanwhile and peaked at 640 MiB for a 98 MB model). Here `edgerun generate` and
`edgerun warm` hand the warm-up's parts to a KernelPool (offload/warm_kernels.py): one
child a core compiles into Numba's disk cache while this process shows what happens and
then only loads the kernels. `generate` asks only for what one answer runs
(Engine.answer_parts). The first token needs only the decode step's kernels: they are
compiled first, one kernel a part (engine.DECODE_KERNEL_PARTS) so that every child takes
some, and the prompt goes through the one-token step until its own kernels are cached
(Generator._forward_chunks); the prompt's kernels compile after the decode step's.

On a terminal the progress is a bar (steps done of all, the functions compiled, the time);
elsewhere (a log, a pipe) one whole line per step.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from typing import TextIO

from edgerun.generate.engine import DECODE_KERNEL_PARTS
from edgerun.generate.sequence import WarmUp
from edgerun.offload.warm_kernels import KernelPool, PoolState
from edgerun.runtime.progress import Advance, is_terminal, progress_bar

__all__ = ["FirstRun"]


class FirstRun:
    """A KernelPool and its progress display, for one command."""

    def __init__(self, pool: KernelPool, kernels: str, stream: TextIO) -> None:
        self.pool, self.kernels, self.stream = pool, kernels, stream
        self.started = time.perf_counter()
        self.loaded_at: float | None = None
        self.bar: Advance | None = None
        self._bar_cm = None
        self.here: list[str] = []  # functions this process compiled itself (none, normally)
        self.first_step: list[str] = []  # the parts the first one-token step waits for
        self._listener = _compile_listener(self.here)
        from numba.core import event

        event.register("numba:compile", self._listener)

    @classmethod
    def start(
        cls,
        path: str | os.PathLike,
        kv_type: str,
        parts: Sequence[str],
        interleave: bool | None = None,
        stream: TextIO | None = None,
        workers: int | None = None,
        command: list[str] | None = None,
    ) -> FirstRun | None:
        """Start compiling `parts` of `path`'s warm-up in children (None: all are cached;
        workers, command: as KernelPool.start)."""
        from edgerun.ops import qmatvec

        kernels = qmatvec.kernel_path()
        pool = KernelPool.start(path, kv_type, kernels, parts, interleave, workers, command)
        if pool is None:
            return None
        run = cls(pool, kernels, sys.stderr if stream is None else stream)
        run._announce()
        return run

    # -- the display ------------------------------------------------------------------
    def _announce(self) -> None:
        cache = os.environ.get("NUMBA_CACHE_DIR", "Numba's cache")
        print(
            f"edgerun: compiling this model's kernels for this CPU ({self.kernels} path) in "
            f"{self.pool.processes} processes. This happens once: they are cached in "
            f"{cache} and later runs load them in about a second.",
            file=self.stream,
            flush=True,
        )

    def _open(self) -> Advance:
        if self.bar is None:
            self._bar_cm = progress_bar(
                "compiling kernels", total=self._total(), unit="steps", stream=self.stream
            )
            self.bar = self._bar_cm.__enter__()
        return self.bar

    def _total(self) -> int:
        return 1 + len(self.pool.state.parts)

    def _tick(self, st: PoolState) -> None:
        bar = self._open()
        done = (1 if self.loaded_at is not None or self._any_loaded() else 0) + len(st.done)
        # "decode:i" parts: one kernel each of the decode step
        shown = dict.fromkeys("decode step" if p.startswith("decode:") else p for p in st.running)
        running = ", ".join(shown) or ("loading the model" if not done else "-")
        # no square brackets: rich reads them as markup
        what = f"compiling kernels ({running}; {st.functions} functions done)"
        if not is_terminal(self.stream):  # whole lines carry the time themselves
            what += f", {st.elapsed:.0f} s"
        if (done, self._total(), what) != (bar.completed, bar.total, bar.description):
            bar.update(done, total=self._total(), description=what)

    def _any_loaded(self) -> bool:
        return any(c.loaded for c in self.pool.children)

    def _close_bar(self) -> None:
        if self._bar_cm is not None:
            self._bar_cm.__exit__(None, None, None)
            self._bar_cm, self.bar = None, None

    # -- the steps --------------------------------------------------------------------
    def wait_loaded(self) -> None:
        """Wait until a child loaded the model and compiled the tokenizer's kernel, so this
        process's load and prompt encoding find theirs (the interleaved copies', the
        merge kernel) in the cache. Where the tokenizer's part was cached by an earlier
        run, the load's kernels were too (its child loaded the model first)."""
        if not self.pool.marked("tokenizer"):
            self.pool.submit(["tokenizer"], first=True)
            self.pool.wait_loaded(self._tick)
            self.pool.wait(["tokenizer"], self._tick)
        self.loaded_at = time.perf_counter()

    def warm(self, model, parts: Sequence[str]) -> None:
        """Have `parts` compiled, the decode step's kernels first; load the tokenizer's
        into `model` (wait_loaded waited for it) and return. The model's first one-token
        step waits for the decode step's kernels, and its prompt takes one-token steps
        while the prompt's kernels ("prompt", "gemm") still compile. The display stays up
        until the first step may run."""
        decode = [*DECODE_KERNEL_PARTS, "decode"] if "decode" in parts else []
        later = [p for p in parts if p not in decode and p != "tokenizer"]
        self.pool.submit(decode, first=True)
        self.pool.submit(later)  # behind the decode step's: the first token waits for none
        engine = model.engine
        if decode:
            self.first_step = list(DECODE_KERNEL_PARTS)
            cache = engine.new_cache(1)
            n = len(engine.transformer.decode_kernels(cache))
            if n == 0 or n > len(DECODE_KERNEL_PARTS):  # kernels the parts do not cover
                self.first_step.append("decode")
            engine.kernels_pending = self._wait_decode
        else:
            self._close_bar()
        prompt = [p for p in later if p in ("prompt", "gemm")]
        if prompt:
            engine.prompt_kernels_pending = lambda: not self.pool.finished(prompt)
        model.warm_up([p for p in parts if p not in decode and p not in later])

    def _wait_decode(self) -> None:
        self.pool.wait(self.first_step, self._tick)
        self._close_bar()

    def wait_all(self) -> None:
        """Wait for every part asked for (edgerun warm), showing the progress."""
        self.pool.wait(self.pool.state.parts, self._tick)
        self._close_bar()

    def finish(self) -> WarmUp:
        """Let the children exit; what the warm-up cost, all processes together."""
        self.pool.close()
        self._unlisten()
        st = self.pool.state
        seconds = max(st.done.values()) if st.done else st.elapsed  # until the last part
        return WarmUp(seconds, self.pool.compiled(), self.pool.processes, len(self.here))

    def abort(self) -> None:
        self._close_bar()
        self._unlisten()
        self.pool.kill()

    def _unlisten(self) -> None:
        from numba.core import event

        try:
            event.unregister("numba:compile", self._listener)
        except ValueError:  # already
            pass


def _compile_listener(names: list[str]):
    """A Numba event listener that notes in `names` each function this process compiles."""
    from numba.core import event

    class Listener(event.Listener):
        def on_start(self, ev: event.Event) -> None:
            func = getattr(ev.data.get("dispatcher"), "py_func", None)
            names.append(getattr(func, "__qualname__", "?"))

        def on_end(self, ev: event.Event) -> None:
            pass

    return Listener()
