"""Which tokenizer a GGUF file's metadata describes.

The one place that reads ``tokenizer.ggml.model`` and picks the implementation
(:class:`~.bpe.BPETokenizer` for ``"gpt2"``, :class:`~.sentencepiece.SentencePieceTokenizer`
for ``"llama"``, :class:`~.gemma4.Gemma4Tokenizer` for ``"gemma4"``), so callers holding
GGUF metadata need not know the kinds, and each kind's module need not know the others.
"""

from __future__ import annotations

from typing import Any

from edgerun.errors import ModelFormatError, UnsupportedError
from edgerun.tokenizer.base import Tokenizer
from edgerun.tokenizer.bpe import BPETokenizer
from edgerun.tokenizer.gemma4 import Gemma4Tokenizer
from edgerun.tokenizer.sentencepiece import SentencePieceTokenizer

__all__ = ["tokenizer_from_gguf_metadata"]


def tokenizer_from_gguf_metadata(meta: dict[str, Any], source: str | None = None) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes (``meta``: GGUF key -> value; arrays as
    lists, numpy arrays or :class:`~edgerun.formats.gguf.StringArray`).

    The metadata is untrusted: a field of the wrong type or out of range raises
    :class:`ModelFormatError`, a kind of vocabulary or pre-tokenizer edgerun does not
    implement :class:`UnsupportedError`, each naming ``source`` (default: the file the
    reader's metadata came from, its ``source`` attribute) and the field."""
    if source is None:
        source = getattr(meta, "source", None)
    try:
        return _build(meta)
    except (ModelFormatError, UnsupportedError) as e:
        if source and not str(e).startswith(f"{source}:"):
            raise type(e)(f"{source}: {e}") from None
        raise


def _build(meta: dict[str, Any]) -> Tokenizer:
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ModelFormatError(
            "GGUF metadata has no 'tokenizer.ggml.model'; the file carries no tokenizer"
        )
    if not isinstance(model, str):
        raise ModelFormatError(
            f"GGUF metadata 'tokenizer.ggml.model' should be a string, found {type(model).__name__}"
        )
    if model == "gpt2":
        return BPETokenizer(meta)
    if model == "llama":
        return SentencePieceTokenizer(meta)
    if model == "gemma4":
        return Gemma4Tokenizer(meta)
    what = {
        "t5": "Unigram (T5-style) tokenizers are not supported",
        "bert": "WordPiece (BERT-style) tokenizers are not supported",
        "rwkv": "RWKV tokenizers are not supported",
    }.get(model, "this tokenizer type is not supported")
    raise UnsupportedError(
        f"GGUF metadata 'tokenizer.ggml.model' = {model!r}: {what}. "
        "edgerun supports byte-level BPE ('gpt2'), SentencePiece ('llama') and Gemma 4's "
        "BPE ('gemma4') vocabularies."
    )
