"""Token sampling: repetition penalty -> top-k -> temperature -> top-p -> min-p -> draw.

Greedy when temperature <= 0. A seed makes a run reproducible: the same
seed, prompt and settings give the same text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from edgerun.errors import InvalidArgumentError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    seed: int | None = None

    def __post_init__(self) -> None:
        checks = [
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 = off), got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p < 1.0, f"min_p must be in [0, 1), got {self.min_p}"),
            (self.repeat_penalty > 0, f"repeat_penalty must be > 0, got {self.repeat_penalty}"),
            (self.repeat_last_n >= 0, f"repeat_last_n must be >= 0, got {self.repeat_last_n}"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidArgumentError(msg)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


DEFAULT_SAMPLING = SamplingParams()  # the defaults every front end (API, CLI, chat app) uses


def apply_repeat_penalty(
    logits: np.ndarray, history: Sequence[int], penalty: float, last_n: int
) -> np.ndarray:
    """CTRL-style penalty on tokens seen in the last `last_n` ids (llama.cpp semantics)."""
    if penalty == 1.0 or last_n == 0 or not history:
        return logits
    seen = np.unique(np.asarray(history[-last_n:], dtype=np.int64))
    out = logits.copy()
    vals = out[seen]
    out[seen] = np.where(vals > 0, vals / penalty, vals * penalty)
    return out


class Sampler:
    """Stateful sampler: owns its random generator so a seed fixes the sequence."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        p = self.params
        logits = apply_repeat_penalty(
            np.asarray(logits, dtype=np.float32), history, p.repeat_penalty, p.repeat_last_n
        )
        if p.greedy:
            return int(np.argmax(logits))
        vocab = logits.shape[0]
        k = p.top_k if 0 < p.top_k < vocab else vocab
        if k < vocab:
            idx = np.argpartition(-logits, k - 1)[:k]
        else:
            idx = np.arange(vocab)
        vals = logits[idx].astype(np.float64)
        order = np.argsort(-vals, kind="stable")
        idx, vals = idx[order], vals[order]
        probs = np.exp((vals - vals[0]) / p.temperature)
        probs /= probs.sum()
        if p.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), p.top_p) + 1)
            idx, probs = idx[:cut], probs[:cut]
        if p.min_p > 0.0:
            keep = probs >= p.min_p * probs[0]
            idx, probs = idx[keep], probs[keep]
        probs /= probs.sum()
        return int(idx[self.rng.choice(len(idx), p=probs)])
