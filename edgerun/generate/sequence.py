"""One generated sequence: sampler -> stream detokenizer -> stop matcher -> stats.

Every driver (the single-stream generator in engine.py, the batching scheduler in
serving/batching.py) feeds a Sequence the logits of its next position and shows the text
it returns; the Sequence decides the token, the text that is safe to show and whether
the sequence ended ("stop": an end-of-sequence id or a stop string; "length":
max_tokens). What only a driver knows (a full context window, a cancel) it tells the
Sequence through `end`.
"""

from __future__ import annotations

import collections.abc as cabc
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from edgerun.generate.sampling import Sampler, SamplingParams
from edgerun.tokenizer import StreamDecoder, Tokenizer

if TYPE_CHECKING:
    from edgerun.generate.constraint import Constraint


@dataclass(frozen=True)
class WarmUp:
    """The first run's kernel compile (or load from Numba's disk cache), timed on its own.

    Kept apart from prefill: a compile takes seconds, and a short prompt's tok/s would
    measure the compile instead of the prompt.
    """

    seconds: float
    compiled: int  # Numba compilations it triggered; 0 = every kernel came from the cache
    processes: int = 0  # child processes that compiled them (0: this process did)
    here: int = 0  # with processes: compilations this process made beside them

    def __str__(self) -> str:
        if not (self.compiled or self.here):
            return f"warm-up: kernels loaded from cache {self.seconds:.1f} s"
        where = f", {self.processes} processes" if self.processes else ""
        if self.here:
            where += f", {self.here} more in this one"
        return f"warm-up: kernels compiled {self.seconds:.1f} s ({self.compiled} functions{where})"


@dataclass
class GenerationStats:
    """What one generation cost and how it ended (Model.stats, Request.stats, the
    server's usage; mlx-lm's stream_generate reports the same per response)."""

    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens reused from the KV cache
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    generate_seconds: float = 0.0
    finish_reason: str = ""  # "stop" (EOS or stop string), "length", "cancelled", "error"
    threads: int = 0  # threads the last tokens ran on (see cpu_share.ThreadGovernor)
    warmup: WarmUp | None = None  # set on the generation that paid for the warm-up
    slides: int = 0  # times a full window slid (context_policy "slide")
    ttft_seconds: float = 0.0  # start (a request: submit) -> first token sampled
    queued_seconds: float = 0.0  # submit -> first compute for this request (scheduler)
    peak_rss_bytes: int = 0
    batch_sizes: list[int] = field(default_factory=list)  # sequences per decode step
    # speculative decoding (generate/speculative.py): tokens drafted, drafts the target's
    # own sampling agreed with, and the target's passes that gave the sampled tokens
    # (the prompt's last position's included); 0 passes: not counted (no drafter)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_passes: int = 0
    # A constrained generation's token masks (generate/constraint.py): their computation
    # on the worker thread, and what decoding waited for them (the part not overlapped
    # with the forward pass).
    mask_seconds: float = 0.0
    mask_wait_seconds: float = 0.0

    @property
    def prompt_tps(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    @property
    def generate_tps(self) -> float:
        return self.generated_tokens / self.generate_seconds if self.generate_seconds > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens sampled per pass of the target over its weights (1 without drafts)."""
        if not self.decode_passes:
            return 1.0 if self.generated_tokens else 0.0
        return self.generated_tokens / self.decode_passes

    def draft_summary(self) -> str:
        """The drafts' line of a stats display ("" without a drafter)."""
        if not self.decode_passes:
            return ""
        return (
            f"drafted {self.draft_tokens}, accepted {self.accepted_tokens} "
            f"({100 * self.acceptance_rate:.0f}%), {self.tokens_per_pass:.2f} tokens/pass"
        )

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.generated_tokens


# The scheduler's name for the same record (public: edgerun.ResponseStats).
ResponseStats = GenerationStats


@dataclass
class StopMatcher:
    """Holds text back while it could still turn into a stop string."""

    stops: cabc.Sequence[str]
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


class Sequence:
    """The per-sequence state of a generation: its sampler (and the token history it
    penalises repeats from), stream detokenizer, stop matcher, stats and finish reason.

    A driver calls `step(logits)` for each position's logits and shows what it returns;
    after a step `finish_reason` is set when the sequence ended. The driver ends it
    itself for what only it knows (`end("length")` at a full context window,
    `end("cancelled")`); `tail()` is the text held back until the end."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        prompt_ids: cabc.Sequence[int],
        max_tokens: int,
        stop: cabc.Sequence[str] = (),
        eos_ids: cabc.Iterable[int] = (),
        stats: GenerationStats | None = None,
        started: float | None = None,
        constraint: Constraint | None = None,
    ) -> None:
        """started: perf_counter time TTFT counts from (a request's submit), None: now.
        constraint: a grammar the output must follow (generate/constraint.py): each step
        samples among the tokens it allows, and the sequence stops where it is complete."""
        self.history = [int(i) for i in prompt_ids]
        self.max_tokens = max_tokens
        self.eos = set(eos_ids)
        self.sampler = Sampler(params)
        self.decoder = StreamDecoder(tokenizer)
        self.matcher = StopMatcher(list(stop))
        self.stats = stats if stats is not None else GenerationStats(len(self.history))
        self.started = time.perf_counter() if started is None else started
        self.finish_reason: str | None = None
        self.token = -1  # the last token sampled (the next input while the sequence runs)
        self.grammar = constraint.matcher() if constraint is not None else None
        self.error = ""  # why a constrained sequence ended with "error"

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def step(self, logits: np.ndarray) -> str:
        """Sample the next token from `logits`; the text it makes safe to show."""
        st = self.stats
        grammar = self.grammar
        if grammar is not None:
            logits = grammar.mask_logits(logits, self.eos)
            if logits is None:  # the grammar allows nothing: a limit hit, an error state
                self.error = grammar.error
                self.end("error")
                return ""
        tok = self.sampler(logits, self.history)
        self.token = tok
        if not st.generated_tokens and not st.ttft_seconds:
            st.ttft_seconds = time.perf_counter() - self.started
        if tok in self.eos:
            self.end("stop")
            return ""
        st.generated_tokens += 1
        self.history.append(tok)
        text = self.matcher.feed(self.decoder.push(tok))
        if grammar is not None:
            if not grammar.advance(tok):
                self.error = grammar.error
                self.end("error")
            elif grammar.finished:
                self.end("stop")  # the grammar is complete: nothing more may follow
        if self.done:
            return text
        if self.matcher.hit:
            self.end("stop")
        elif st.generated_tokens >= self.max_tokens:
            self.end("length")
        return text

    def allowed_draft(self, tokens: cabc.Sequence[int]) -> int:
        """How many of `tokens`, drafted to follow the last sampled one, this sequence's
        grammar accepts (all of them without a grammar): a speculative loop proposes only
        that prefix, so no position is verified that the mask would refuse."""
        if self.grammar is None:
            return len(tokens)
        return self.grammar.allows(list(tokens))

    def end(self, reason: str) -> None:
        """End the sequence (the first reason given stays)."""
        if self.finish_reason is None:
            self.finish_reason = reason
        self.stats.finish_reason = self.finish_reason
        if self.grammar is not None:
            self.grammar.close()
            self.stats.mask_seconds = self.grammar.compute_seconds
            self.stats.mask_wait_seconds = self.grammar.wait_seconds

    def tail(self) -> str:
        """The text held back (a partial character, a possible stop string's start),
        once the sequence ended other than by a stop string."""
        if self.matcher.hit:
            return ""
        return self.matcher.feed(self.decoder.flush()) + self.matcher.flush()
