"""Text embeddings: a text's final hidden states (after the output norm, what llama.cpp
pools) pooled into one vector, L2-normalised unless asked not to.

Short texts share passes: their rows go through the layers together
(Transformer.final_hidden_batch, each text attending only to itself), so the weights are
read once per pass and not once per text. A text longer than a pass (the engine's prompt
chunk, which a RAM budget sizes) runs alone, chunk by chunk, on a float32 KV cache.

A pass's row count picks the kernels as for any prompt: up to the interleaved decode
copies' batched limit (64 rows on this host's vnni path) the copies' int8 kernels, past it
the prompt GEMM. Passes are not capped at that limit, though the copies are faster for many
short texts: on an AMX host the GEMM's vectors equal transformers' dequantized float32
ones (cosine 1.000000 on Qwen2.5-Coder-0.5B Q8_0), the copies' only to 0.9984, below
llama.cpp's 0.9989 (benchmarks/embeddings_llamacpp.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from edgerun.errors import ContextOverflowError, InvalidArgumentError, UnsupportedError
from edgerun.generate.engine import Engine
from edgerun.model.kvcache import KVCache
from edgerun.runtime.cpu_share import set_threads
from edgerun.tokenizer import Tokenizer

# what embed_ids pools by: the last token (the one that saw the whole text, as causal
# embedding models such as Qwen3-Embedding are trained), the mean of all tokens, or the
# first token (a BERT-style [CLS]; in a causal model it sees only itself)
POOLINGS = ("last", "mean", "cls")


def text_tokens(tokenizer: Tokenizer, text: str) -> list[int]:
    """A text's ids as an embedding reads them: BOS where the model adds it, EOS where the
    file asks for it (tokenizer.ggml.add_eos_token: Qwen3-Embedding pools its final
    <|endoftext|>), control-token strings in the text taken as plain text (as llama.cpp)."""
    ids = tokenizer.encode(text, parse_special=False)
    if tokenizer.add_eos and tokenizer.eos_id is not None:
        ids.append(tokenizer.eos_id)
    return ids


def resolve_pooling(pooling: str | None, model_pooling: str) -> str:
    """The pooling asked for, else the model's (ModelSpec.pooling), checked."""
    chosen = model_pooling if pooling is None else pooling
    if chosen == "rank":
        raise UnsupportedError(
            "this model is a reranker (its file's pooling_type is 'rank'): it scores pairs "
            "and gives no embeddings; pass pooling='last' or 'mean' to pool its states anyway"
        )
    if chosen not in POOLINGS:
        raise InvalidArgumentError(f"pooling must be one of {', '.join(POOLINGS)}, got {chosen!r}")
    return chosen


def pool(hidden: np.ndarray, pooling: str) -> np.ndarray:
    """One vector [d] from a text's final hidden states [n, d]."""
    if pooling == "last":
        return hidden[-1].astype(np.float32, copy=True)
    if pooling == "mean":
        return hidden.mean(axis=0, dtype=np.float64).astype(np.float32)
    if pooling == "cls":
        return hidden[0].astype(np.float32, copy=True)
    raise InvalidArgumentError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Each row over its L2 norm (a zero row stays zero)."""
    norms = np.linalg.norm(vectors.astype(np.float64), axis=1, keepdims=True)
    return (vectors / np.where(norms > 0, norms, 1.0)).astype(np.float32)


def _passes(lengths: list[int], per_pass: int) -> list[list[int]]:
    """The indices of the texts each pass takes, in order: consecutive texts while their
    tokens fit per_pass; a longer text alone."""
    out: list[list[int]] = []
    room = 0
    for i, n in enumerate(lengths):
        if out and n <= room:
            out[-1].append(i)
            room -= n
        else:
            out.append([i])
            room = per_pass - n
    return out


def embed_ids(
    engine: Engine,
    sequences: Sequence[Sequence[int]],
    pooling: str | None = None,
    normalize: bool = True,
) -> np.ndarray:
    """Embeddings float32 [len(sequences), d_model] of token-id sequences.

    pooling None takes the model's (its file's '<arch>.pooling_type', else the family's
    default); normalize: each vector over its L2 norm."""
    transformer = engine.transformer
    how = resolve_pooling(pooling, transformer.spec.pooling)
    seqs = [[int(t) for t in s] for s in sequences]
    for i, s in enumerate(seqs):
        if not s:
            raise InvalidArgumentError(f"input {i} is empty: nothing to embed")
        if len(s) > engine.n_ctx:
            raise ContextOverflowError(
                f"input {i} has {len(s)} tokens but the context window is {engine.n_ctx}; "
                "shorten it or load the model with a larger n_ctx"
            )
        bad = [t for t in s if not 0 <= t < transformer.spec.vocab_size]
        if bad:
            raise InvalidArgumentError(
                f"input {i} holds token id {bad[0]}, outside the vocabulary "
                f"[0, {transformer.spec.vocab_size})"
            )
    out = np.empty((len(seqs), transformer.spec.d_model), np.float32)
    if engine.governor is not None:
        set_threads(engine.governor.threads)
    step = engine.prefill_chunk
    for group in _passes([len(s) for s in seqs], step):
        if len(seqs[group[0]]) > step:
            hidden = [_long_hidden(engine, seqs[group[0]])]
        else:
            with engine.lock:
                hidden = transformer.final_hidden_batch([seqs[i] for i in group])
                engine.after_prompt_chunk()
        for i, h in zip(group, hidden):
            out[i] = pool(h, how)
    return normalized(out) if normalize else out


def _long_hidden(engine: Engine, ids: list[int]) -> np.ndarray:
    """A text past one pass: its chunks in turn on a float32 cache of its length."""
    cache = KVCache(engine.spec, len(ids), "f32")
    parts = []
    step = engine.prefill_chunk
    try:
        for i in range(0, len(ids), step):
            with engine.lock:
                parts.append(engine.transformer.final_hidden(ids[i : i + step], cache))
                engine.after_prompt_chunk()
    finally:
        cache.release()
    return np.concatenate(parts, axis=0)
