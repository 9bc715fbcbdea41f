"""Speculative decoding, exact: a drafter proposes the next few tokens, the target model
checks them all in one pass over its weights (Transformer.verify), and the sequence
keeps the drafts its own sampling agrees with.

Why it is exact. After the target samples token t, the drafter proposes d1..dk; the
target runs [t, d1..dk] as one pass whose row i equals, bit for bit, the logits a
one-token step would give at that position. The Sequence then samples from row 0, and
from row i only while its sample equals d_i; at the first disagreement (or the
sequence's end) the KV cache is truncated back to the rows that stand. Every token is
sampled by the same Sampler from the same logits with the same history, and its
random numbers are drawn in the same order, so the output equals decoding without a
draft token for token, greedy or seeded. With a deterministic draft this is the
standard accept/reject rule (Leviathan et al., arXiv 2211.17192): a draft d is kept with
probability p(d), and on rejection the token is drawn from p without d, renormalised.

Drafters (the `Drafter` protocol):
- NgramDrafter: prompt lookup. The longest recent match of the last n tokens earlier in
  the text (prompt and output) proposes what followed it: code edits, rewrites, quotes.
  No match proposes nothing, so text where nothing repeats costs nothing.
- ModelDrafter: a small model of the same vocabulary with its own KV cache, decoding k
  tokens greedily after the common prefix of its cache and the text.

How many tokens to draft (DraftLength) follows the running acceptance and the measured
costs of a pass: each extra row of a verification pass costs a fraction of a one-token
pass (the batched kernels read each weight once), each drafted token the drafter's time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from edgerun.errors import InvalidArgumentError, UnsupportedError
from edgerun.generate.sequence import Sequence as GenSequence

# Engine and Generator (engine.py) import this module, so they are typed as Any here
Engine = Generator = Any

__all__ = [
    "DEFAULT_DRAFT_TOKENS",
    "DraftLength",
    "Drafter",
    "ModelDrafter",
    "NgramDrafter",
    "Speculation",
    "check_same_vocabulary",
]

# The longest draft by default: n-gram drafts are free to make, a model's cost a pass each.
DEFAULT_DRAFT_TOKENS = {"ngram": 8, "model": 5}


@runtime_checkable
class Drafter(Protocol):
    """What proposes tokens for the target to verify."""

    name: str
    resident_bytes: int  # memory it keeps (weights, cache); a RAM budget counts it

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `history` (the prompt and the output so far,
        the last sampled token included); fewer or none when it has no guess."""
        ...

    def close(self) -> None: ...


class NgramDrafter:
    """Prompt lookup decoding: the latest earlier occurrence of the text's last n tokens
    (n from max_ngram down to min_ngram, the longest first) proposes the tokens that
    followed it. Keeps one dict per n from n-gram to the end position of its latest
    occurrence, extended as the text grows (and rebuilt when a new text diverges), so a
    proposal costs a few dict lookups."""

    name = "ngram"
    resident_bytes = 0

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidArgumentError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, "
                f"{max_ngram}"
            )
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        # per n: n-gram -> end index (inclusive) of its latest occurrence that has a
        # token after it
        self._last: dict[int, dict[tuple[int, ...], int]] = {}
        self._indexed = 0  # end positions < this are in the dicts
        # the Generator and the scheduler's thread may share one drafter
        self._lock = threading.Lock()

    def _sync(self, history: Sequence[int]) -> None:
        h = self.tokens
        n = len(h)
        if len(history) < n or list(history[:n]) != h:
            self.tokens, self._last, self._indexed = [], {}, 0
        self.tokens.extend(int(t) for t in history[len(self.tokens) :])
        h = self.tokens
        for size in range(self.min_ngram, self.max_ngram + 1):
            table = self._last.setdefault(size, {})
            # n-grams ending at e, for e whose next token exists (e <= len - 2)
            for e in range(max(self._indexed, size - 1), len(h) - 1):
                table[tuple(h[e - size + 1 : e + 1])] = e
        self._indexed = max(self._indexed, len(h) - 1)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        if k <= 0 or not history:
            return []
        with self._lock:
            self._sync(history)
            h = self.tokens
            for size in range(min(self.max_ngram, len(h) - 1), self.min_ngram - 1, -1):
                end = self._last.get(size, {}).get(tuple(h[-size:]))
                if end is not None:
                    return h[end + 1 : end + 1 + k]
            return []

    def close(self) -> None:
        self.tokens, self._last, self._indexed = [], {}, 0


def check_same_vocabulary(target, draft, target_name: str, draft_name: str) -> None:
    """Refuse a draft whose tokenizer differs from the target's (its ids would mean other
    text): the vocabulary sizes, the special ids and the bytes of a spread of tokens must
    agree. target, draft: Tokenizers."""
    why = ""
    if target.vocab_size != draft.vocab_size:
        why = f"vocabulary sizes {target.vocab_size} vs {draft.vocab_size}"
    elif (target.bos_id, target.eos_id) != (draft.bos_id, draft.eos_id):
        why = (
            f"special ids bos/eos {target.bos_id}/{target.eos_id} vs {draft.bos_id}/{draft.eos_id}"
        )
    else:
        for i in np.linspace(0, target.vocab_size - 1, 97).astype(int):
            a, b = target.token_bytes(int(i)), draft.token_bytes(int(i))
            if a != b:
                why = f"token {int(i)} is {a!r} vs {b!r}"
                break
    if why:
        raise UnsupportedError(
            f"draft model {draft_name} does not share the vocabulary of {target_name} "
            f"({why}); a draft model must use the same tokenizer (e.g. a smaller model of "
            "the same family), or use --draft-model ngram"
        )


# Missing tokens up to this many go through the draft's one-token steps (the accepted
# tokens since the last proposal: the one-token step is the faster call for a few, and
# its KV rows round as the draft's own decode does); more go in prompt chunks.
ONE_BY_ONE = 8


class ModelDrafter:
    """A draft model with its own KV cache: each proposal truncates the cache to its
    common prefix with the text, runs what is missing, then decodes k tokens greedily.
    The drafted tokens stay in its cache; the next proposal's common-prefix truncation
    drops the rejected ones."""

    def __init__(self, engine: Engine, name: str | None = None, n_ctx: int | None = None) -> None:
        self.engine = engine
        self.name = name or engine.name
        self.cache = engine.new_cache(n_ctx)
        self.resident_bytes = 0  # set by whoever loaded the draft model (api: its bytes)
        self.seconds = 0.0  # time spent drafting (prefix included)
        self.steps = 0  # forward calls of the last proposal (the catch-up included)
        self.owner: object = None  # what keeps the draft engine alive (api: its Model)

    def check_vocabulary(self, target: Engine, target_name: str | None = None) -> None:
        check_same_vocabulary(
            target.tokenizer,
            self.engine.tokenizer,
            f"{target_name or target.name} (vocabulary {target.tokenizer.vocab_size})",
            f"{self.name} (vocabulary {self.engine.tokenizer.vocab_size})",
        )

    def prefill(self, prompt: Sequence[int]) -> None:
        """Run the prompt (all but its last token) through the draft model now, with the
        target's prompt, so the first proposal does not pay for it."""
        cache = self.cache
        prompt = list(prompt)[:-1]
        if not prompt or len(prompt) >= cache.n_ctx:
            return
        with self.engine.lock:
            cache.truncate(cache.reusable(cache.common_prefix(prompt)))
            todo, chunk = prompt[cache.length :], self.engine.prefill_chunk
            for i in range(0, len(todo), chunk):
                self.engine.transformer.forward(todo[i : i + chunk], cache)

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        cache, model = self.cache, self.engine.transformer
        if k <= 0 or not history or len(history) + k > cache.n_ctx:
            return []
        t0 = time.perf_counter()
        history = list(history)
        out: list[int] = []
        steps = 0
        with self.engine.lock:  # the cache too: one proposal at a time
            behind = len(history) - cache.reusable(cache.common_prefix(history))
            if behind > ONE_BY_ONE:
                self.prefill(history)  # a prompt: in chunks, all but the last token
                steps += behind - 1  # as many one-token steps as the chunks stand for
            reuse = cache.reusable(min(cache.common_prefix(history), len(history) - 1))
            cache.truncate(reuse)
            for t in history[reuse:]:  # the few tokens since the last proposal: one-token steps
                logits = model.forward([t], cache)
                steps += 1
            while True:
                tok = int(np.argmax(logits))
                out.append(tok)
                if len(out) == k:
                    break
                logits = model.forward([tok], cache)
                steps += 1
        self.steps = steps
        self.seconds += time.perf_counter() - t0
        return out

    def close(self) -> None:
        self.cache.clear()


class DraftLength:
    """How many tokens to draft next: the k in [0, max_tokens] that maximises the
    expected tokens per second, (1 - a^(k+1)) / (1 - a) tokens for a pass that costs
    1 + k * (row + draft) one-token passes, from the running acceptance a of drafted
    tokens and the measured costs of an extra verification row and of a drafted token
    (drafter seconds / one-token pass seconds). When no draft pays, it still drafts one
    token every `probe` passes, so a text that starts repeating is noticed."""

    def __init__(
        self,
        max_tokens: int,
        draft_cost: float = 0.0,
        row_cost: float = 0.25,
        prior: float = 0.6,
        probe: int = 8,
        adaptive: bool = True,
    ) -> None:
        """adaptive False: always draft max_tokens (a measurement's fixed length)."""
        if max_tokens < 0:
            raise InvalidArgumentError(f"num_draft_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.draft_cost, self.row_cost = draft_cost, row_cost
        self.prior = prior
        self.probe = probe
        self.adaptive = adaptive
        self.acceptance = prior
        self._idle = 0
        self.one_pass_s = 0.0  # EMA of a one-token pass's seconds (0: none measured yet)

    def reset(self) -> None:
        """A new generation: its acceptance starts from the prior again."""
        self.acceptance = self.prior
        self._idle = 0

    def best(self) -> int:
        a = min(self.acceptance, 0.999)
        cost = self.row_cost + self.draft_cost
        best_k, best_rate = 0, 1.0
        for k in range(1, self.max_tokens + 1):
            rate = (1 - a ** (k + 1)) / (1 - a) / (1 + k * cost)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def next(self) -> int:
        if not self.adaptive:
            return self.max_tokens
        k = self.best()
        if k == 0 and self.max_tokens:
            self._idle += 1
            if self._idle >= self.probe:
                self._idle = 0
                return 1
        return k

    def update(self, drafted: int, accepted: int) -> None:
        """Fold one verification's outcome in: the drafts accepted, then the one rejected
        (the drafts after a rejection tell nothing)."""
        if drafted <= 0:
            return
        seen = accepted + (1 if accepted < drafted else 0)
        w = 0.15
        for i in range(seen):
            self.acceptance += w * ((1.0 if i < accepted else 0.0) - self.acceptance)

    def timed(
        self, rows: int, seconds: float, draft_seconds: float, drafted: int, draft_steps: int = 0
    ) -> None:
        """Fold a pass's measured time in: one-token passes set the unit, longer ones
        the cost of an extra row, and the drafter's time per step its cost. draft_steps:
        the draft model's forward steps for this proposal, the catch-up on the tokens
        since its last one included (0: a drafter without steps, per drafted token). A
        drafting pass catches up about one token, so a step is what a drafted token
        costs; a probe after idle passes catches up several, which per drafted token
        would price the draft out for good."""
        w = 0.2
        if rows == 1:
            self.one_pass_s = seconds if not self.one_pass_s else self.one_pass_s
            self.one_pass_s += w * (seconds - self.one_pass_s)
            return
        if not self.one_pass_s:
            return
        extra = max(0.0, seconds / self.one_pass_s - 1.0) / (rows - 1)
        self.row_cost += w * (min(extra, 2.0) - self.row_cost)
        if drafted:
            d = draft_seconds / (draft_steps or drafted) / self.one_pass_s
            self.draft_cost += w * (min(d, 2.0) - self.draft_cost)


class Speculation:
    """A drafter and its draft length, driving a Generator's decode loop (decode)."""

    def __init__(
        self, drafter: Drafter, max_tokens: int | None = None, adaptive: bool = True
    ) -> None:
        """max_tokens: the longest draft (None: DEFAULT_DRAFT_TOKENS); adaptive False:
        always that long."""
        kind = "ngram" if isinstance(drafter, NgramDrafter) else "model"
        self.drafter = drafter
        self.length = DraftLength(
            DEFAULT_DRAFT_TOKENS[kind] if max_tokens is None else max_tokens,
            draft_cost=0.0 if kind == "ngram" else 0.4,
            adaptive=adaptive,
        )

    @property
    def name(self) -> str:
        return self.drafter.name

    def close(self) -> None:
        self.drafter.close()

    def decode(self, gen: Generator, seq: GenSequence, logits: np.ndarray) -> Iterator[str]:
        """Generator.stream's decode loop with drafts: yields text pieces until the
        sequence ends (the context window full ends it "length" unless the generator's
        policy slides it). `logits`: the prompt's last position's."""
        cache, stats = gen.cache, seq.stats
        self.length.reset()
        prefill = getattr(self.drafter, "prefill", None)
        if prefill is not None:  # the draft's prompt, counted with the target's
            t0 = time.perf_counter()
            prefill(seq.history)
            stats.prompt_seconds += time.perf_counter() - t0
        rows: Sequence[np.ndarray] = [logits]
        drafts: list[int] = []
        base = cache.length - 1  # the cache position of rows[0]'s input
        stats.decode_passes += 1
        t_start = time.perf_counter()
        while True:
            yield from self.accept(seq, cache, rows, drafts, base)
            stats.generate_seconds = time.perf_counter() - t_start
            if seq.done:
                return
            if cache.room() == 0:
                if gen.context_policy != "slide":
                    seq.end("length")
                    return
                gen._slide()
            gen._pace(decode=True)
            gen._kernels_ready()
            rows, drafts, base = self.verify(gen.model, seq, cache, seq.token, gen.lock)

    def verify(
        self, model, seq: GenSequence, cache, token: int, lock=None
    ) -> tuple[np.ndarray, list[int], int]:
        """Draft after seq's history (which ends with `token`, the next input) and run
        [token, drafts...] through `model` (a Transformer) on `cache` in one pass.
        Returns the logits rows, the drafts and the cache position of the first row's
        input; `accept` then samples from them."""
        length, stats = self.length, seq.stats
        left = seq.max_tokens - stats.generated_tokens  # tokens the rows may give
        k = min(length.next(), cache.room() - 1, left - 1)
        t0 = time.perf_counter()
        drafts = self.drafter.propose(seq.history, k)[:k] if k > 0 else []
        vocab = model.spec.vocab_size
        for j, d in enumerate(drafts):
            if not 0 <= d < vocab:
                drafts = drafts[:j]
                break
        if drafts:  # a grammar's sequence verifies only what its mask would allow
            drafts = drafts[: seq.allowed_draft(drafts)]
        t1 = time.perf_counter()
        base = cache.length
        if lock is None:
            rows = self._run(model, cache, token, drafts)
        else:
            with lock:
                rows = self._run(model, cache, token, drafts)
        steps = getattr(self.drafter, "steps", 0) if drafts else 0
        length.timed(len(drafts) + 1, time.perf_counter() - t1, t1 - t0, len(drafts), steps)
        stats.draft_tokens += len(drafts)
        stats.decode_passes += 1
        return rows, drafts, base

    @staticmethod
    def _run(model, cache, token: int, drafts: list[int]) -> np.ndarray:
        if drafts:
            return model.verify([token, *drafts], cache)
        return model.forward([token], cache).reshape(1, -1)

    def accept(
        self, seq: GenSequence, cache, rows: Sequence[np.ndarray], drafts: list[int], base: int
    ) -> Iterator[str]:
        """Sample from rows[0], and from rows[i] while the sample before equals drafts[i-1];
        yield the text pieces; truncate the cache back to the inputs that stand (the
        verified token and the drafts the samples agreed with)."""
        i = 0
        for i, row in enumerate(rows):
            text = seq.step(row)
            if text:
                yield text
            if seq.done or i == len(drafts) or seq.token != drafts[i]:
                break
        cache.truncate(base + i + 1)
        seq.stats.accepted_tokens += i
        self.length.update(len(drafts), i)
