"""Perplexity of a model on a text, llama.cpp style.

The text is tokenized once (no BOS), cut into chunks of n_ctx tokens; each chunk is
evaluated from an empty KV cache (its first token replaced by BOS when the tokenizer
adds one, as llama.cpp's perplexity does) and only the second half of each chunk is
scored, so every scored token sees at least n_ctx/2 tokens of context.
PPL = exp(mean NLL); its standard error comes from the NLLs' standard error by the
delta method (PPL * SE(NLL)).

Evaluation text: Python's own pydoc topic help (edgerun.corpus, re-exported here).
Calibration (edgerun.tools.calibrate) uses the last quarter of the same corpus;
evaluation reads from the start, so with --limit-tokens below ~75% of the corpus
(~100k tokens) the two never overlap.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from edgerun.corpus import CALIBRATION_FRACTION, calibration_text, evaluation_text
from edgerun.errors import InvalidArgumentError

__all__ = [
    "CALIBRATION_FRACTION",
    "PerplexityResult",
    "calibration_text",
    "evaluation_text",
    "perplexity",
]


@dataclass
class PerplexityResult:
    ppl: float
    stderr: float
    nll: float
    n_scored: int
    n_chunks: int
    n_ctx: int
    seconds: float = 0.0

    def __str__(self) -> str:
        return (
            f"PPL = {self.ppl:.4f} +/- {self.stderr:.4f} ({self.n_scored} tokens scored in "
            f"{self.n_chunks} chunks of {self.n_ctx})"
        )


def _log_softmax_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    lg = logits.astype(np.float64)
    m = lg.max(axis=1, keepdims=True)
    lse = m[:, 0] + np.log(np.exp(lg - m).sum(axis=1))
    return lse - lg[np.arange(len(targets)), targets]


def perplexity(
    model,
    text: str | None = None,
    n_ctx: int = 512,
    limit_tokens: int | None = None,
    batch: int = 128,
    on_progress: Callable[[int, int], None] | None = None,
) -> PerplexityResult:
    """Perplexity of an edgerun Model on `text` (default: evaluation_text())."""
    import time

    if n_ctx < 4:
        raise InvalidArgumentError(f"context size must be at least 4, got {n_ctx}")
    if n_ctx > model.spec.context_length:
        raise InvalidArgumentError(
            f"context size {n_ctx} exceeds the model's {model.spec.context_length}"
        )
    t0 = time.perf_counter()
    text = evaluation_text() if text is None else text
    tok = model.tokenizer
    tokens = tok.encode(text, add_bos=False, parse_special=False)
    if limit_tokens is not None:
        tokens = tokens[: int(limit_tokens)]
    n_chunks = len(tokens) // n_ctx
    if n_chunks < 1:
        raise InvalidArgumentError(
            f"the text has {len(tokens)} tokens, fewer than one chunk of {n_ctx}; use a "
            "smaller -c or more text"
        )
    bos = tok.bos_id if getattr(tok, "add_bos", False) else None
    first = n_ctx // 2
    tr = model.transformer
    from edgerun.runtime.cpu_share import set_threads

    set_threads(model.threads)
    nlls = []
    for c in range(n_chunks):
        ids = list(tokens[c * n_ctx : (c + 1) * n_ctx])
        if bos is not None:
            ids[0] = bos
        cache = tr.new_cache(n_ctx)
        for b0 in range(0, n_ctx, batch):
            sub = ids[b0 : b0 + batch]
            logits = tr.forward(sub, cache, all_logits=True)
            pos = np.arange(b0, b0 + len(sub))
            keep = (pos >= first) & (pos < n_ctx - 1)
            if keep.any():
                tgt = np.asarray([ids[p + 1] for p in pos[keep]])
                nlls.append(_log_softmax_nll(logits[keep], tgt))
            if on_progress:
                on_progress(c * n_ctx + b0 + len(sub), n_chunks * n_ctx)
    nll = np.concatenate(nlls)
    mean = float(nll.mean())
    se = float(nll.std(ddof=1) / math.sqrt(len(nll))) if len(nll) > 1 else 0.0
    ppl = math.exp(mean)
    return PerplexityResult(
        ppl, ppl * se, mean, len(nll), n_chunks, n_ctx, time.perf_counter() - t0
    )
