"""Generator: prefill, decode loop, streaming text, stop rules and timing stats."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from edgerun.compute_thread import compute_thread
from edgerun.errors import ContextOverflowError, InvalidArgumentError
from edgerun.kvcache import KVCache
from edgerun.model import Transformer
from edgerun.ops import lowrank, qmatvec
from edgerun.ops.activations import PARALLEL_MIN as _GLU_PARALLEL_MIN
from edgerun.ops.activations import glu
from edgerun.ops.norm import PARALLEL_MIN as _NORM_PARALLEL_MIN
from edgerun.ops.norm import rmsnorm
from edgerun.quant.formats import QuantTensor
from edgerun.sampling import Sampler, SamplingParams
from edgerun.sched.cpu_share import ThreadGovernor, set_threads
from edgerun.tokenizer import StreamDecoder, Tokenizer

PREFILL_CHUNK = 256  # tokens per forward call: bounds the attention score buffer
# The fewest prompt tokens per forward call a RAM budget may choose.
MIN_PREFILL_CHUNK = 16


def prefill_bytes_per_token(spec) -> int:
    """Bytes of temporaries each prompt token adds to one forward call (activations, the
    gate/up outputs, q/k/v, quantized copies): what a prompt chunk costs beyond the
    weights. Fitted above tracemalloc's peaks of a 128-token chunk (Zen 3, avx2 path):
    SmolLM2 47.9 KB a token, Gemma 3 270M 58.7, Qwen2.5-0.5B 98.4, 1.5B 181.0; this
    gives 58.4, 73.7, 110.6 and 194.6 (7-25% above)."""
    return 8 * spec.d_ff + 64 * spec.d_model + 16 * spec.q_dim


def prefill_chunk_within(spec, nbytes: int) -> int:
    """The prompt tokens per forward call whose temporaries fit in `nbytes` (a budget's
    step margin), a multiple of MIN_PREFILL_CHUNK in [MIN_PREFILL_CHUNK, PREFILL_CHUNK].
    Why: a 256-token chunk of Qwen2.5-1.5B takes 43.5 MiB of temporaries, which took a
    long prompt past an 800 MiB budget; 128 tokens (22 MiB) prefill as fast there, as
    the streamed weights' reads, not the chunk, set the pace."""
    n = nbytes // prefill_bytes_per_token(spec) // MIN_PREFILL_CHUNK * MIN_PREFILL_CHUNK
    return max(MIN_PREFILL_CHUNK, min(PREFILL_CHUNK, n))


# What happens when a prompt or a generation outgrows the context window:
# - "error": a prompt that does not fit raises ContextOverflowError; a generation that fills
#   the window ends with finish_reason "length" (nothing is dropped silently);
# - "slide": attention sinks + sliding window (StreamingLLM, arXiv 2309.17453): the first
#   SINK_TOKENS tokens are kept, the oldest of the rest dropped, and the kept tokens are
#   recomputed at their new positions. A too-long prompt keeps its sinks and its end.
CONTEXT_POLICIES = ("error", "slide")
SINK_TOKENS = 4


def check_prompt(ids: Sequence[int], n_ctx: int, vocab_size: int | None = None) -> None:
    """A prompt the model can take: not empty, within the context window, and (given a
    vocabulary size) made of ids inside it. Each failure names the numbers."""
    if not ids:
        raise InvalidArgumentError("the prompt is empty: nothing to condition on")
    if len(ids) > n_ctx:
        raise ContextOverflowError(
            f"the prompt has {len(ids)} tokens but the context window is "
            f"{n_ctx}; use a larger context (-c / n_ctx) or a shorter prompt"
        )
    if vocab_size is not None:
        check_token_ids(ids, vocab_size)


def check_token_ids(ids: Sequence[int], vocab_size: int) -> None:
    bad = [i for i in ids if not 0 <= int(i) < vocab_size]
    if bad:
        raise InvalidArgumentError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")


def _weight_formats(model, rows_only: bool = False) -> set:
    """The formats of a Transformer's weight matrices, resident or streamed (a streamed
    matrix's rows keep its file's format); rows_only: of those whose decode reads their
    rows (no interleaved copy, qmatvec.interleave)."""
    parts: list = [getattr(model, "output", None), getattr(model, "head", None)]
    for layer in model.layers:
        parts += [getattr(layer, s, None) for s in type(layer).__slots__]
        ffn = getattr(layer, "ffn", None)
        parts += [getattr(ffn, s, None) for s in getattr(type(ffn), "__slots__", ())]
        parts += list(getattr(ffn, "__dict__", {}).values())
    formats = set()
    for p in parts:
        p = getattr(p, "matrix", p)  # a streamed head
        p = getattr(p, "template", p)  # a split matrix
        if isinstance(p, QuantTensor) and p.rows > 1:
            if not (rows_only and p.interleaved is not None):
                formats.add(p.qtype)
    return formats


@dataclass(frozen=True)
class WarmUp:
    """The first run's kernel compile (or load from Numba's disk cache), timed on its own.

    Counted as prefill it made a 37-token prompt read as 1.8 tok/s.
    """

    seconds: float
    compiled: int  # Numba compilations it triggered; 0 = every kernel came from the cache

    def __str__(self) -> str:
        if self.compiled:
            return f"warm-up: kernels compiled {self.seconds:.1f} s ({self.compiled} functions)"
        return f"warm-up: kernels loaded from cache {self.seconds:.1f} s"


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the KV cache
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    finish_reason: str = ""  # "stop" (EOS or stop string), "length", "cancelled"
    threads: int = 0  # threads the last tokens ran on (see cpu_share.ThreadGovernor)
    warmup: WarmUp | None = None  # set on the generation that paid for the warm-up
    slides: int = 0  # times a full window slid (context_policy "slide")

    @property
    def prompt_tps(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def generate_tps(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0


@dataclass
class StopMatcher:
    """Holds text back while it could still turn into a stop string."""

    stops: Sequence[str]
    pending: str = ""
    hit: bool = field(default=False)

    def feed(self, text: str) -> str:
        """Add text; return what is safe to emit now."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out
        cut = min((i for i in (self.pending.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            out, self.pending = self.pending[:cut], ""
            return out
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.pending)), hold, -1):
                if self.pending.endswith(s[:k]):
                    hold = k
                    break
        if hold:
            out, self.pending = self.pending[:-hold], self.pending[-hold:]
        else:
            out, self.pending = self.pending, ""
        return out

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


class Generator:
    """Runs a Transformer over one KV cache, reusing the cached prefix of each prompt."""

    def __init__(
        self,
        model: Transformer,
        tokenizer: Tokenizer,
        n_ctx: int,
        governor: ThreadGovernor | None = None,
        kv_type: str = "f32",
        lock: threading.RLock | None = None,
        context_policy: str = "error",
        after_warm_up: Callable[[], object] | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        after_prompt_chunk: Callable[[], object] | None = None,
    ) -> None:
        """after_warm_up: called once the kernels are loaded (a budgeted model drops the
        page cache their loading left). prefill_chunk: prompt tokens per forward call;
        after_prompt_chunk: called after each (a budgeted model trims its heap)."""
        if context_policy not in CONTEXT_POLICIES:
            raise InvalidArgumentError(
                f"context_policy must be one of {', '.join(CONTEXT_POLICIES)}, "
                f"got {context_policy!r}"
            )
        self.context_policy = context_policy
        self.model = model
        self.lock = lock if lock is not None else threading.RLock()
        self.tokenizer = tokenizer
        self.cache = KVCache(model.spec, n_ctx, kv_type)
        self.stats = GenerationStats()
        self.governor = governor
        self.warmed: WarmUp | None = None
        self.after_warm_up = after_warm_up
        if not 1 <= prefill_chunk <= PREFILL_CHUNK:
            raise InvalidArgumentError(
                f"prefill_chunk must be in [1, {PREFILL_CHUNK}], got {prefill_chunk}"
            )
        self.prefill_chunk = prefill_chunk
        self.after_prompt_chunk = after_prompt_chunk

    def _pace(self, decode: bool) -> None:
        """Follow the governor's thread count for the next pass (it changes when other
        load does, and between prompt chunks and decode steps of a streamed model)."""
        g = self.governor
        if g is not None:
            g.update()
            n = g.step_threads(decode)
            set_threads(n)  # a few microseconds; other callers may have set another count
            self.stats.threads = n

    def warm_up(self) -> WarmUp:
        """Run every kernel a prompt and a decode step use once, on a scratch cache.

        Numba compiles (or loads from its cache) each kernel on first call; doing that
        here keeps it out of the prompt's and the decode's timings. A 2-token prompt
        takes the prefill kernels; the parallel norm and GLU kernels, which start at a
        size, run on scratch rows (a prompt that long costs a second on a 1.5B model).
        Runs once per Generator; later calls return the first result.
        """
        if self.warmed is not None:
            return self.warmed
        from numba.core import event

        spec = self.model.spec
        ids = [1 % spec.vocab_size, 2 % spec.vocab_size]
        scratch = KVCache(spec, 3, self.cache.kv_type)
        t0 = time.perf_counter()
        with self.lock, event.install_recorder("numba:compile") as rec:
            self.model.forward(ids, scratch)
            self.model.forward(ids[-1:], scratch)
            pair = [KVCache(spec, 1, scratch.kv_type) for _ in range(2)]
            self.model.forward_batch(ids, pair)  # batched decode (sched/batching.py)
            compute_thread().call(self._warm_parallel_kernels)
            compute_thread().call(self._warm_every_format)
            self.tokenizer.warm()  # byte-level BPE's merge kernel (tokenizer/bpe_merges.py)
        compiled = sum(1 for e in rec.buffer if e[1].is_start)
        self.warmed = WarmUp(time.perf_counter() - t0, compiled)
        if self.after_warm_up is not None:
            self.after_warm_up()
        return self.warmed

    def _warm_every_format(self) -> None:
        """The prefill GEMMs (AMX tiles where the CPU has them) and the decode kernels of
        every weight format in the model: the warm-up's 2-token prompt takes the batched
        decode kernels, and parts held or moved after the warm-up (offloading) would
        otherwise load theirs on the first token or prompt."""
        qmatvec.warm_prefill(_weight_formats(self.model))  # long prompts take the rows
        # the row kernels' decode, for the matrices without copies (the copies' kernels
        # ran in the warm-up's forward passes): Numba keeps what each compile allocated
        qmatvec.warm_decode(_weight_formats(self.model, rows_only=True))
        lowrank.warm()  # an offloaded head's sketch scores (offload/head.py)

    def _warm_parallel_kernels(self) -> None:
        """Run the parallel RMSNorm and GLU kernels once on zero rows of the model's width."""
        spec = self.model.spec
        layer = self.model.layers[0]
        rows = -(-max(_NORM_PARALLEL_MIN, _GLU_PARALLEL_MIN) // spec.d_model)
        x = np.zeros((rows, spec.d_model), np.float32)
        rmsnorm(x, layer.attn_norm, spec.norm_eps)
        activation = getattr(layer.ffn, "activation", None)
        if activation is not None:
            glu(x, x, activation)

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Make the cache hold exactly `ids`; return the last position's logits."""
        ids = list(ids)
        if len(ids) > self.cache.n_ctx and self.context_policy == "slide":
            ids = self._slid(ids, self.cache.n_ctx - max(1, self.cache.n_ctx // 4))
        check_prompt(ids, self.cache.n_ctx)
        reuse = min(self.cache.common_prefix(ids), len(ids) - 1)
        self.cache.truncate(reuse)
        # The last prompt token always goes through the one-token decode path, so
        # its logits do not depend on how much of the prompt was cached: batched and
        # single-token kernels round differently, and a seed must give the same text.
        self._forward_chunks(ids[reuse:-1])
        self._pace(decode=True)
        with self.lock:
            return self.model.forward(ids[-1:], self.cache)

    def _forward_chunks(self, ids: list[int]) -> None:
        """Append `ids` to the cache, prefill_chunk tokens per forward call."""
        step = self.prefill_chunk
        for i in range(0, len(ids), step):
            self._pace(decode=False)
            with self.lock:
                self.model.forward(ids[i : i + step], self.cache)
                if self.after_prompt_chunk is not None:
                    self.after_prompt_chunk()

    @staticmethod
    def _slid(ids: list[int], keep: int) -> list[int]:
        """The sinks and the last tokens of `ids`, `keep` in all."""
        sinks = min(SINK_TOKENS, keep // 2)
        return ids[:sinks] + ids[len(ids) - (keep - sinks) :]

    def _slide(self) -> None:
        """Make room in a full window: keep the sinks and the newest half, recompute them."""
        kept = self._slid(list(self.cache.tokens), self.cache.n_ctx // 2)
        self.cache.clear()
        self._forward_chunks(kept)
        self.stats.slides += 1

    def stream(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        max_tokens: int = 256,
        stop: Sequence[str] = (),
        stop_ids: Sequence[int] | None = None,
    ) -> Iterator[str]:
        """Yield text pieces as they are decoded. Stats land in self.stats."""
        if max_tokens < 0:
            raise InvalidArgumentError(f"max_tokens must be >= 0, got {max_tokens}")
        fresh = self.warmed is None
        warmup = self.warm_up()
        stats = self.stats = GenerationStats(
            prompt_tokens=len(prompt_ids), warmup=warmup if fresh else None
        )
        if self.governor is not None:
            stats.threads = self.governor.threads
        stats.cached_tokens = min(self.cache.common_prefix(list(prompt_ids)), len(prompt_ids) - 1)
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids)
        stats.prompt_seconds = time.perf_counter() - t0
        eos = set(self.tokenizer.eos_ids if stop_ids is None else stop_ids)
        sampler = Sampler(params)
        decoder = StreamDecoder(self.tokenizer)
        matcher = StopMatcher(list(stop))
        history = list(prompt_ids)
        t1 = time.perf_counter()
        stats.finish_reason = "length"
        try:
            for _ in range(max_tokens):
                tok = sampler(logits, history)
                if tok in eos:
                    stats.finish_reason = "stop"
                    break
                stats.generated_tokens += 1
                history.append(tok)
                text = matcher.feed(decoder.push(tok))
                if text:
                    yield text
                if matcher.hit:
                    stats.finish_reason = "stop"
                    break
                if stats.generated_tokens == max_tokens:
                    break
                if self.cache.room() == 0:
                    if self.context_policy != "slide":
                        break  # context full: finish_reason stays "length"
                    self._slide()
                self._pace(decode=True)
                with self.lock:
                    logits = self.model.forward([tok], self.cache)
                stats.generate_seconds = time.perf_counter() - t1
            if not matcher.hit:
                tail = matcher.feed(decoder.flush()) + matcher.flush()
                if tail:
                    yield tail
        except (GeneratorExit, KeyboardInterrupt):
            stats.finish_reason = "cancelled"
            raise
        finally:
            stats.generate_seconds = time.perf_counter() - t1
