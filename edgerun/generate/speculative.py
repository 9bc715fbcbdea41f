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
- NgramDrafter: prompt lookup. The earlier place in the text (prompt and output) that
  matches its end longest proposes what followed it: code edits, rewrites, quotes. No
  match proposes nothing, so text where nothing repeats costs nothing.
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
DEFAULT_DRAFT_TOKENS = {"ngram": 16, "model": 5}


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
    """Prompt lookup decoding: the earlier occurrence of the text's end that matches it
    longest (at least min_ngram tokens, measured up to max_ngram; the latest among equals)
    proposes the tokens that followed it. Keeps, per min_ngram-gram, the end positions of
    its latest `per_key` occurrences that have a token after them, extended as the text
    grows (and rebuilt when a new text diverges), so a proposal costs a few dict lookups
    and at most per_key * max_ngram token comparisons.

    `match_length` is the last proposal's match (0: none): how far the text's end agrees
    with the place it copies from. A long match is a copy in progress (a rewrite, a quote)
    and is usually followed further; a match of a token or two is often a coincidence, so
    DraftLength keeps its acceptance per match length."""

    name = "ngram"
    resident_bytes = 0

    def __init__(self, max_ngram: int = 16, min_ngram: int = 1, per_key: int = 16) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise InvalidArgumentError(
                f"n-gram sizes must satisfy 1 <= min_ngram <= max_ngram, got {min_ngram}, "
                f"{max_ngram}"
            )
        if per_key < 1:
            raise InvalidArgumentError(f"per_key must be >= 1, got {per_key}")
        self.max_ngram, self.min_ngram, self.per_key = max_ngram, min_ngram, per_key
        self.tokens: list[int] = []
        # min_ngram-gram -> end indices (inclusive) of its latest occurrences, oldest first
        self._ends: dict[tuple[int, ...], list[int]] = {}
        self._indexed = 0  # end positions < this are in the dict
        self.match_length = 0
        # the Generator and the scheduler's thread may share one drafter
        self._lock = threading.Lock()

    def _sync(self, history: Sequence[int]) -> None:
        h = self.tokens
        n = len(h)
        if len(history) < n or list(history[:n]) != h:
            self.tokens, self._ends, self._indexed = [], {}, 0
        self.tokens.extend(int(t) for t in history[len(self.tokens) :])
        h, size = self.tokens, self.min_ngram
        # n-grams ending at e, for e whose next token exists (e <= len - 2)
        for e in range(max(self._indexed, size - 1), len(h) - 1):
            ends = self._ends.setdefault(tuple(h[e - size + 1 : e + 1]), [])
            ends.append(e)
            if len(ends) > self.per_key:
                del ends[0]
        self._indexed = max(self._indexed, len(h) - 1)

    def _match(self) -> tuple[int, int]:
        """(end index of the best earlier occurrence, its match length); (-1, 0): none."""
        h, size = self.tokens, self.min_ngram
        n = len(h)
        if n <= size:
            return -1, 0
        best, best_len = -1, 0
        for e in reversed(self._ends.get(tuple(h[-size:]), ())):
            m = size
            while m < self.max_ngram and e - m >= 0 and h[e - m] == h[n - 1 - m]:
                m += 1
            if m > best_len:
                best, best_len = e, m
        return best, best_len

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        self.match_length = 0
        if k <= 0 or not history:
            return []
        with self._lock:
            self._sync(history)
            end, self.match_length = self._match()
            return self.tokens[end + 1 : end + 1 + k] if end >= 0 else []

    def close(self) -> None:
        self.tokens, self._ends, self._indexed = [], {}, 0


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


# An n-gram draft's acceptance depends on how long its match is (NgramDrafter.match_length):
# DraftLength keeps one running acceptance per bucket of at least 1, 2, 3, 4 and 8 matched
# tokens. The priors are the per-token acceptance of each bucket over Qwen2.5-Coder-1.5B's
# greedy answers to benchmarks/speculative.py's edit, code and prose prompts.
MATCH_BUCKETS = (8, 4, 3, 2, 1)
MATCH_PRIOR = {1: 0.25, 2: 0.6, 3: 0.75, 4: 0.87, 8: 0.96}


def match_bucket(match: int) -> int:
    """The bucket of a match length (0: no match)."""
    for b in MATCH_BUCKETS:
        if match >= b:
            return b
    return 0


class DraftLength:
    """How many tokens to draft next: the k in [0, max_tokens] that maximises the
    expected tokens per second, (1 - a^(k+1)) / (1 - a) tokens for a pass that costs
    verify(k + 1) + k * draft one-token passes (verify: the measured cost of a pass of
    that many rows, else 1 + k * row), from the running acceptance a of drafted
    tokens (for an n-gram draft, the acceptance of its match length's bucket) and the
    measured costs of an extra verification row and of a drafted token (drafter seconds /
    one-token pass seconds). When no draft pays, it still drafts one token every `probe`
    passes, so a text that starts repeating is noticed."""

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
        self.by_match = dict(MATCH_PRIOR)  # bucket -> acceptance (n-gram drafts)
        self._idle = 0
        self.one_pass_s = 0.0  # EMA of a one-token pass's seconds (0: none measured yet)
        # rows -> EMA of a pass of that many rows, in one-token passes: the batched
        # kernels' cost per row grows with the rows (on Qwen2.5-1.5B, 2 threads: 1.05x
        # one pass at 2 rows, 2.0x at 8, 3.8x at 16), so a line through it misprices
        # long drafts; rows not measured yet take the line (row_cost)
        self.pass_cost: dict[int, float] = {}
        self._predicted: set[int] = set()  # rows whose pass_cost is a prediction (predict)

    def predict(self, pass_cost: dict[int, float]) -> None:
        """Take predicted costs (rows -> one-row passes, e.g. a RAM budget's plan) for the
        row counts not measured yet; the first measured pass of a count replaces its
        prediction outright, later ones average in."""
        for rows, cost in pass_cost.items():
            if rows not in self.pass_cost:
                self.pass_cost[rows] = float(cost)
                self._predicted.add(rows)

    def reset(self) -> None:
        """A new generation: its acceptances start from the priors again."""
        self.acceptance = self.prior
        self.by_match = dict(MATCH_PRIOR)
        self._idle = 0

    def best(self, match: int | None = None) -> int:
        """The best length for the running acceptance, or for a draft whose match
        length is `match` (0: no match, nothing to draft)."""
        if match is None:
            return self.best_for(self.acceptance)
        if not match_bucket(match):
            return 0
        return self.best_for(self.by_match[match_bucket(match)])

    def best_for(self, a: float) -> int:
        """The length that maximises speedup(k, a) (0: no draft pays)."""
        best_k, best_rate = 0, 1.0
        for k in range(1, self.max_tokens + 1):
            rate = self.speedup(k, a)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def speedup(self, k: int, acceptance: float) -> float:
        """Expected tokens per one-token pass's time of drafting k tokens at a per-token
        acceptance: (1 - a^(k+1)) / (1 - a) tokens for a pass of k + 1 rows and k drafted
        tokens (1.0: no draft)."""
        a = min(acceptance, 0.999)
        return (1 - a ** (k + 1)) / (1 - a) / (self.pass_price(k + 1) + k * self.draft_cost)

    def pass_price(self, rows: int) -> float:
        """A pass of `rows` rows in one-token passes: measured (or predicted), else the line
        of row_cost a row."""
        return self.pass_cost.get(rows, 1 + (rows - 1) * self.row_cost) if rows > 1 else 1.0

    def next(self, match: int | None = None) -> int:
        """The length of the next draft; `match`: an n-gram draft's match length."""
        if not self.adaptive:
            return self.max_tokens
        k = self.best(match)
        if k == 0 and self.max_tokens:
            self._idle += 1
            if self._idle >= self.probe:
                self._idle = 0
                return 1
        return k

    def update(self, drafted: int, accepted: int, match: int | None = None) -> None:
        """Fold one verification's outcome in: the drafts accepted, then the one rejected
        (the drafts after a rejection tell nothing); into the bucket of `match` for an
        n-gram draft."""
        if drafted <= 0:
            return
        seen = accepted + (1 if accepted < drafted else 0)
        w = 0.15
        b = match_bucket(match) if match is not None else 0
        a = self.by_match[b] if b else self.acceptance
        for i in range(seen):
            a += w * ((1.0 if i < accepted else 0.0) - a)
        if b:
            self.by_match[b] = a
        else:
            self.acceptance = a

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
        ratio = seconds / self.one_pass_s
        extra = max(0.0, ratio - 1.0) / (rows - 1)
        self.row_cost += w * (min(extra, 2.0) - self.row_cost)
        ratio = min(max(ratio, 1.0), 1.0 + 2.0 * (rows - 1))
        before = self.pass_cost.get(rows)
        if before is None or rows in self._predicted:
            self._predicted.discard(rows)
            self.pass_cost[rows] = ratio
        else:
            self.pass_cost[rows] = before + w * (ratio - before)
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
        # an n-gram draft's length follows its match length (DraftLength.by_match)
        self.sized_by_match = kind == "ngram"
        self._match: int | None = None  # the match length of the drafts in flight
        self.length = DraftLength(
            DEFAULT_DRAFT_TOKENS[kind] if max_tokens is None else max_tokens,
            draft_cost=0.0 if kind == "ngram" else 0.4,
            adaptive=adaptive,
        )

    @property
    def name(self) -> str:
        return self.drafter.name

    def fit(self, max_rows: int, pass_cost: dict[int, float] | None = None) -> None:
        """Size the drafts for a RAM budget: at most max_rows - 1 drafted tokens (the
        verification rows whose temporaries the budget's step margin holds), and a plan's
        predicted pass costs (rows -> one-row passes) as the prices of passes not measured
        yet, so the first drafts under streaming are as long as its cheap rows make
        worth it; each measured pass replaces them."""
        if max_rows < 1:
            raise InvalidArgumentError(f"a verification pass has at least one row, got {max_rows}")
        length = self.length
        length.max_tokens = min(length.max_tokens, max_rows - 1)
        length.predict({r: c for r, c in (pass_cost or {}).items() if r <= length.max_tokens + 1})

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
        limit = min(cache.room() - 1, left - 1)
        rows_cap = cache.state.max_verify_rows
        if rows_cap is not None:  # each row keeps a copy of a hybrid model's states
            limit = min(limit, rows_cap - 1)
        t0 = time.perf_counter()
        self._match = None
        if self.sized_by_match:  # proposing is free: its match length sets how many to keep
            k = min(length.max_tokens, limit)
            drafts = self.drafter.propose(seq.history, k)[:k] if k > 0 else []
            if drafts:
                self._match = self.drafter.match_length
                drafts = drafts[: length.next(self._match)]
        else:
            k = min(length.next(), limit)
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
        self.length.update(len(drafts), i, self._match)
