"""Continuous batching: concurrent requests on one model, decoded together.

One scheduler thread owns the model's compute. Each step it
- admits new requests (they join at step boundaries);
- spends a prefill budget on the requests still reading their prompts, oldest first:
  `prefill_chunk` tokens while others are generating (so a long prompt delays their
  next token by one chunk, not by the whole prompt), a full PREFILL_CHUNK when none is.
  Several short prompts fit one step's budget, so requests that arrive together start
  generating in the same step and run every step together (one at a time, the fourth
  of four joined three steps late and the first finished three steps early:
  SmolLM2-135M, 4 sessions, 32 tokens each: 3.84 sequences a step on average);
- runs one decode step for every request that is generating, all through
  `Transformer.forward_batch`: each weight is read once per step for all of them, and
  each sequence attends over its own KV cache.

Row b of a batched step equals a one-token step of sequence b bit for bit (see
`qmatvec.matvec_batch`), so a request gets the same tokens alone or among others.
Cancelling a request drops it at the next step boundary; the others never notice.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgerun.errors import EdgerunError, InvalidArgumentError
from edgerun.generate.constraint import Constraint
from edgerun.generate.engine import PREFILL_CHUNK, Engine, check_prompt
from edgerun.generate.prefix_cache import PrefixCache, SharedPrefix
from edgerun.generate.sampling import SamplingParams
from edgerun.generate.sequence import GenerationStats, ResponseStats
from edgerun.generate.sequence import Sequence as GenSequence
from edgerun.generate.speculative import Speculation
from edgerun.model.kvcache import KVCache
from edgerun.runtime.cpu_share import set_threads
from edgerun.runtime.sysinfo import peak_rss_bytes
from edgerun.serving import kv_spill

# ResponseStats (= GenerationStats), PrefixCache and SharedPrefix: public names kept here
__all__ = [
    "BatchScheduler",
    "GenerationStats",
    "PrefixCache",
    "Request",
    "ResponseStats",
    "SchedulerCounters",
    "Serving",
    "SharedPrefix",
]

_DONE = object()


class Request:
    """One generation: iterate it for text pieces (or `async for`), `cancel()` from any
    thread, read `stats` and `text` when done."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int,
        stop: Sequence[str],
        eos_ids: Sequence[int],
        cache: KVCache,
        prefix_len: int = 0,
        on_token: Callable[[str], None] | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        self.prompt_ids = [int(i) for i in prompt_ids]
        self.constraint = constraint  # a grammar the output follows (generate/constraint.py)
        self.params = params
        self.max_tokens = max_tokens
        self.stop = list(stop)
        self.eos = set(eos_ids)
        self.cache = cache
        self.prefix_len = prefix_len
        self.on_token = on_token
        self.on_finish: Callable[[Request], None] | None = None  # called on the scheduler thread
        self.stats = GenerationStats(prompt_tokens=len(self.prompt_ids))
        self.pieces: list[str] = []
        self.error: BaseException | None = None
        self.finished = threading.Event()
        self._cancel = threading.Event()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Queue] | None = None
        self._lock = threading.Lock()
        self.submitted = time.perf_counter()
        # scheduler-side state
        self.seq: GenSequence | None = None  # made at its first compute (_start)
        self.next_input = -1
        self.decoding = False
        self.t_decode = 0.0  # perf_counter when its first decode step began
        self.t_finished = 0.0

    # -- consumer side --------------------------------------------------------------
    def cancel(self) -> None:
        """Stop this request at the next step boundary (safe from any thread)."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def history(self) -> list[int]:
        """The prompt's token ids and those generated so far."""
        return self.seq.history if self.seq is not None else list(self.prompt_ids)

    def __iter__(self) -> Iterator[str]:
        try:
            while True:
                item = self._queue.get()
                if item is _DONE:
                    break
                if self.on_token is not None:
                    self.on_token(item)
                yield item
        except GeneratorExit:
            self.cancel()
            raise
        if self.error is not None:
            raise self.error

    def wait(self) -> str:
        """Block until done; the whole text."""
        for _ in self:
            pass
        return self.text

    async def __aiter__(self) -> AsyncIterator[str]:
        """Pieces without blocking the event loop (the scheduler hands them over with
        call_soon_threadsafe)."""
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self._async = (loop, aq)
            while True:  # what arrived before the async consumer attached
                try:
                    aq.put_nowait(self._queue.get_nowait())
                except queue.Empty:
                    break
        try:
            while True:
                item = await aq.get()
                if item is _DONE:
                    break
                if self.on_token is not None:
                    self.on_token(item)
                yield item
        except (asyncio.CancelledError, GeneratorExit):
            self.cancel()
            raise
        if self.error is not None:
            raise self.error

    # -- scheduler side ---------------------------------------------------------------
    def _put(self, item: object) -> None:
        with self._lock:
            if self._async is not None:
                loop, aq = self._async
                try:
                    loop.call_soon_threadsafe(aq.put_nowait, item)
                except RuntimeError:  # the consumer's loop is closed: nobody listens
                    self._cancel.set()
            else:
                self._queue.put(item)

    def _emit(self, text: str) -> None:
        if text:
            self.pieces.append(text)
            self._put(text)

    def _finish(self, reason: str, error: BaseException | None = None) -> None:
        st = self.stats
        st.finish_reason = reason
        if self.t_decode:
            st.generate_seconds = time.perf_counter() - self.t_decode
        st.peak_rss_bytes = peak_rss_bytes()
        self.t_finished = time.perf_counter()
        self.error = error
        hook, self.on_finish = self.on_finish, None  # a session's hook: no reference cycle
        if hook is not None:  # (a dropped session frees its KV cache at once, not at GC)
            try:
                hook(self)
            except Exception:  # noqa: BLE001 - a broken hook must not stop the scheduler
                pass
        self.finished.set()
        self._put(_DONE)


def _kv_positions(r: Request) -> int:
    """The KV positions r's cache can come to hold, in whole pages."""
    reach = min(r.cache.n_ctx, len(r.prompt_ids) + r.max_tokens)
    return r.cache.pages_for(reach)


class BatchScheduler:
    """Schedules the requests of one Engine: continuous batching with chunked prefill."""

    def __init__(
        self,
        engine: Engine,
        max_batch: int = 8,
        prefill_chunk: int = 64,
        speculation: Speculation | None = None,
    ) -> None:
        """speculation: draft tokens for a request while it is the only one decoding
        (generate/speculative.py); several decode batched, one token each, without."""
        if max_batch < 1:
            raise InvalidArgumentError(f"max_batch must be >= 1, got {max_batch}")
        if not 1 <= prefill_chunk <= PREFILL_CHUNK:
            raise InvalidArgumentError(
                f"prefill_chunk must be in [1, {PREFILL_CHUNK}], got {prefill_chunk}"
            )
        self.engine = engine
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.speculation = speculation
        # Under a RAM budget, idle caches count in the KV window too, and the least
        # recently used are moved to disk when a request needs their room (kv_spill.py).
        # spill_dir None keeps them in memory (counted, never moved).
        from edgerun.registry import cache_dir

        self.spill_dir: Path | None = cache_dir() / "kv-spill"
        self._seen: weakref.WeakKeyDictionary[KVCache, float] = weakref.WeakKeyDictionary()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._active: list[Request] = []
        self._waiting: list[Request] = []
        self._closed = False
        self._wake = threading.Event()
        self.counters = SchedulerCounters()
        self._thread = threading.Thread(target=self._run, name="edgerun-scheduler", daemon=True)
        self._thread.start()

    # -- API --------------------------------------------------------------------------
    def submit(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        cache: KVCache | None = None,
        eos_ids: Sequence[int] | None = None,
        prefix_len: int = 0,
        on_token: Callable[[str], None] | None = None,
        on_finish: Callable[[Request], None] | None = None,
        constraint: Constraint | None = None,
    ) -> Request:
        """Queue a generation of `prompt_ids` on `cache` (a fresh one if None).
        constraint: a grammar its output follows (one matcher per request).

        prefix_len > 0 marks the prompt's first tokens as a shared prefix (a system prompt):
        computed once, kept in the model's prefix cache, and copied into later requests
        that start with it."""
        if self._closed:
            raise EdgerunError("the scheduler is closed")
        e = self.engine
        if max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens must be >= 0, got {max_tokens}")
        check_prompt(prompt_ids, e.n_ctx if cache is None else cache.n_ctx, e.spec.vocab_size)
        if cache is None:
            cache = e.new_cache()
        eos = e.tokenizer.eos_ids if eos_ids is None else eos_ids
        r = Request(
            prompt_ids, params, max_tokens, stop, eos, cache, prefix_len, on_token, constraint
        )
        r.on_finish = on_finish
        self._inbox.put(r)
        self._wake.set()
        return r

    def close(self) -> None:
        """Cancel everything and stop the thread."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def active(self) -> int:
        return len(self._active) + len(self._waiting)

    # -- the loop ---------------------------------------------------------------------
    def _admit(self) -> None:
        while True:
            try:
                self._waiting.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        while self._waiting and len(self._active) < self.max_batch:
            r = self._waiting[0]
            if not self._kv_fits(r):
                self._spill_idle(r)
                if self._active and not self._kv_fits(r):
                    break  # first come, first served: later requests wait behind it too
            self._active.append(self._waiting.pop(0))
            self._seen[r.cache] = time.monotonic()  # idle again once r is done

    def _idle_caches(self, but: KVCache | None = None) -> list[KVCache]:
        """Caches of earlier requests that hold pages and no running request uses (nor
        `but`), least recently used first."""
        busy = {id(a.cache) for a in self._active} | {id(but)}
        idle = [(t, c) for c, t in list(self._seen.items()) if id(c) not in busy]
        return [c for _, c in sorted(idle, key=lambda e: e[0]) if c.resident_bytes]

    def _spill_idle(self, r: Request) -> None:
        """Move idle caches to disk, least recently used first, until r fits the KV
        window (or none is left)."""
        if self.spill_dir is None:
            return
        for c in self._idle_caches(but=r.cache):
            try:
                kv_spill.spill(c, self.spill_dir)
            except EdgerunError:
                return  # a full or read-only disk: r waits for room as before
            self.counters.kv_spills += 1
            if self._kv_fits(r):
                return

    def _kv_fits(self, r: Request) -> bool:
        """Whether r's KV cache fits beside the active requests' in what the RAM budget
        reserved (engine.kv_budget_tokens: one context window; None = no budget).

        Why: a cache's pages become resident as its positions are written, and the plan
        counted one window. Eight concurrent requests of a 2048-token window on the 1.5B
        at 800M could write 8 x 57 MiB, past the budget; llama-server's slots share one
        context the same way. A request counts the positions it can reach (prompt and
        max_tokens, at most its window), rounded up to whole pages of the cache."""
        room = self._kv_room(r.cache)
        return room is None or _kv_positions(r) * r.cache.position_bytes <= room

    def _kv_room(self, like: KVCache) -> int | None:
        """Bytes of the budget's KV window that neither the active requests' caches can
        come to hold, nor idle caches hold in memory (other than `like`), nor the shared
        prefixes hold; None without a RAM budget."""
        capacity = self.engine.kv_budget_tokens
        if capacity is None:
            return None
        window = like.pages_for(capacity) * like.position_bytes
        used = sum(_kv_positions(a) * a.cache.position_bytes for a in self._active)
        used += sum(c.resident_bytes for c in self._idle_caches(but=like))
        return window - used - self.engine.prefix_cache.nbytes

    def _run(self) -> None:
        e = self.engine
        while True:
            self._admit()
            if self._closed:
                for r in self._active + self._waiting:
                    r._finish("cancelled")
                return
            for r in [r for r in self._active if r.cancelled]:
                self._active.remove(r)
                r._finish("cancelled")
            if not self._active:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            try:
                with e.lock:
                    set_threads(e.governor.threads)
                    e.warm_up()
                    self._step()
            except Exception as x:  # noqa: BLE001 - a failed step fails its requests, not the thread
                for r in self._active:
                    r._finish("error", x if isinstance(x, EdgerunError) else EdgerunError(str(x)))
                self._active.clear()

    def _step(self) -> None:
        governor = self.engine.governor
        prefilling = [r for r in self._active if not r.decoding]
        if prefilling:
            set_threads(governor.step_threads(decode=False))
            others = any(r.decoding for r in self._active)
            budget = self.prefill_chunk if others else PREFILL_CHUNK
            for r in prefilling:
                budget -= self._prefill_chunk(r, budget)
                if budget <= 0:
                    break
        decoding = [r for r in self._active if r.decoding]
        if not decoding:
            return
        set_threads(governor.step_threads(decode=True))
        now = time.perf_counter()
        for r in decoding:
            if not r.t_decode:
                r.t_decode = now
        if self.speculation is not None and len(self._active) == 1:
            self._speculate(decoding[0], now)
            return
        logits = self.engine.transformer.forward_batch(
            [r.next_input for r in decoding], [r.cache for r in decoding]
        )
        for r, row in zip(decoding, logits):
            r.stats.batch_sizes.append(len(decoding))
            self._after_logits(r, row)
        c = self.counters
        c.decode_steps += 1
        c.decode_tokens += len(decoding)
        c.decode_seconds += time.perf_counter() - now

    def _start(self, r: Request) -> None:
        """First compute for r: reuse its cache's prefix, or a shared prefix's rows."""
        e = self.engine
        r.stats.queued_seconds = time.perf_counter() - r.submitted
        ids = r.prompt_ids
        own = r.cache.reusable(min(r.cache.common_prefix(ids), len(ids) - 1))
        if r.cache.spilled is not None:  # an idle session's rows, moved to disk
            e.before_kv_write(r.cache, own)
            own = kv_spill.restore(r.cache, own)
            self.counters.kv_restores += 1
        shared = e.prefix_cache.lookup(ids, limit=len(ids) - 1)
        if shared is not None and len(shared.tokens) > own:
            e.before_kv_write(r.cache, len(shared.tokens))
            shared.copy_into(r.cache)
            own = len(shared.tokens)
        r.cache.truncate(own)
        r.stats.cached_tokens = own
        r.seq = GenSequence(
            e.tokenizer,
            r.params,
            ids,
            r.max_tokens,
            r.stop,
            r.eos,
            r.stats,
            r.submitted,
            constraint=r.constraint,
        )

    def _prefill_chunk(self, r: Request, budget: int) -> int:
        """Run up to `budget` prompt tokens of r (all but the last prompt token, which
        takes the decode path so its logits do not depend on the chunking); returns how
        many it ran."""
        e = self.engine
        if r.seq is None:
            self._start(r)
        t0 = time.perf_counter()
        ids = r.prompt_ids
        done = r.cache.length
        end = len(ids) - 1
        if 0 < r.prefix_len < end and done < r.prefix_len:
            end = r.prefix_len  # stop at the shared prefix's edge to snapshot it
        most = e.prefill_chunk  # what the model's RAM budget allows a call
        ran = max(0, min(end, done + min(most, budget)) - done)
        if ran:
            e.transformer.forward(ids[done : done + ran], r.cache)
            e.after_prompt_chunk()
            self.counters.prefill_tokens += ran
        if r.prefix_len and r.cache.length == r.prefix_len:
            e.prefix_cache.store(r.cache, r.prefix_len, room=self._kv_room(r.cache))
        dt = time.perf_counter() - t0
        r.stats.prompt_seconds += dt
        self.counters.prefill_seconds += dt
        if r.cache.length >= len(ids) - 1:
            r.decoding = True
            r.next_input = ids[-1]
            if r.max_tokens == 0:
                self._active.remove(r)
                r._finish("length")
        return ran

    def _speculate(self, r: Request, now: float) -> None:
        """One verification pass of the only running request: its next input and the
        drafts, then the samples from the rows that stand."""
        spec, seq = self.speculation, r.seq
        if not r.stats.decode_passes:
            spec.length.reset()
        rows, drafts, base = spec.verify(self.engine.transformer, seq, r.cache, r.next_input)
        for text in spec.accept(seq, r.cache, rows, drafts, base):
            r._emit(text)
        r.stats.batch_sizes.append(1)
        c = self.counters
        c.decode_steps += 1
        c.decode_tokens += r.cache.length - base
        c.decode_seconds += time.perf_counter() - now
        self._after_step(r)

    def _after_logits(self, r: Request, logits: np.ndarray) -> None:
        r._emit(r.seq.step(logits))
        self._after_step(r)

    def _after_step(self, r: Request) -> None:
        """After a request's sampled tokens: end it at a full context, finish it when it
        ended, else take its last token as the next input."""
        seq = r.seq
        if not seq.done and r.cache.room() == 0:
            seq.end("length")  # context full
        if seq.done:
            r._emit(seq.tail())
            self._active.remove(r)
            err = EdgerunError(seq.error) if seq.finish_reason == "error" and seq.error else None
            r._finish(seq.finish_reason, err)
            return
        r.next_input = seq.token


@dataclass
class SchedulerCounters:
    """Totals since the scheduler started: how its time splits between decode steps
    (tokens sampled for all sequences) and prefill chunks."""

    decode_steps: int = 0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    kv_spills: int = 0  # idle caches moved to disk under a RAM budget (kv_spill.py)
    kv_restores: int = 0  # and read back when their session was admitted again

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Serving:
    """An engine and the batching scheduler its sessions (and a server) share: started on
    first use, replaced when the batch size changes, stopped by close()."""

    def __init__(self, engine: Engine, max_batch: int = 8) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self._scheduler: BatchScheduler | None = None
        self.speculation: Speculation | None = None  # drafts for a lone request

    @property
    def scheduler(self) -> BatchScheduler:
        if self._scheduler is None:
            with self.engine.lock:
                if self._scheduler is None:
                    self._scheduler = BatchScheduler(
                        self.engine, self.max_batch, speculation=self.speculation
                    )
        return self._scheduler

    @property
    def running(self) -> bool:
        return self._scheduler is not None

    def set_max_batch(self, n: int) -> None:
        """How many sequences the scheduler decodes together (default 8)."""
        if self._scheduler is not None:
            self._scheduler.close()
        self._scheduler = BatchScheduler(self.engine, max_batch=n, speculation=self.speculation)
        self.max_batch = n

    def close(self) -> None:
        """Stop the scheduler thread (cancels what is running); it starts again on use."""
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None
