"""Tokenizers built from GGUF metadata, behind one interface.

A GGUF file carries no ``tokenizer.json``: the vocabulary, merges, scores, token types and special
ids live in its metadata under llama.cpp's key names (``tokenizer.ggml.*``). This package turns that
metadata (a ``dict`` of GGUF key -> value; arrays may be lists, numpy arrays or the GGUF reader's
:class:`~edgerun.formats.gguf.StringArray`) into a :class:`Tokenizer`. Nothing the size of the
vocabulary is kept as Python objects per token: the decoding table is one ``bytes`` blob plus
offsets, token types a numpy array, and the token strings stay in the mapped file.

Supported: ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE, :class:`BPETokenizer`), with the
pre-tokenizer that ``tokenizer.ggml.pre`` names (:data:`.bpe.PRE_TOKENIZERS`: the names
llama.cpp's converter writes for Llama 3, Qwen2/3, SmolLM, StarCoder/Granite, Command-R, OLMo,
DBRX, GLM-4, Mistral's Tekken, GPT-4o/Llama 4, EXAONE, LFM2, ..., each split as llama.cpp
splits it); and ``"llama"`` (SentencePiece,
:class:`SentencePieceTokenizer`: Llama 1/2, Mistral, Gemma, ...), which can also load a
``tokenizer.model`` file directly.

Encoding uses the ``tokenizers`` library (a BPE model built from vocab + merges) or the
``sentencepiece`` library (a ModelProto built from pieces + scores + types; written by hand in
:mod:`.sp_model_proto`, so protobuf is not needed). Decoding and :meth:`Tokenizer.token_bytes`
are done in :mod:`.base`, from a per-token byte table, so that ``decode(ids) ==
b"".join(token_bytes(i) for i in ids).decode("utf-8", "replace")`` (SentencePiece with a dummy
prefix also drops the first piece's leading space), and :class:`StreamDecoder` can emit text
incrementally with the same result.

Layout: :mod:`.base` (the :class:`Tokenizer` interface and shared pieces), :mod:`.bpe`
(byte-level BPE), :mod:`.sentencepiece` (SentencePiece) with :mod:`.sp_model_proto` (its
ModelProto reader/writer and :class:`SentencePieceSpec`), :mod:`.from_gguf` (picking one from
GGUF metadata); :class:`StreamDecoder` lives in :mod:`.base` beside the interface it uses.
Dependencies point one way: ``base`` <- ``bpe`` / ``sp_model_proto`` <- ``sentencepiece`` <-
``from_gguf``. Everything public is re-exported here.
"""

from edgerun.tokenizer.base import (
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNKNOWN,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    StreamDecoder,
    Tokenizer,
)
from edgerun.tokenizer.bpe import GPT2_SPLIT as GPT2_SPLIT
from edgerun.tokenizer.bpe import LLAMA3_SPLIT as LLAMA3_SPLIT
from edgerun.tokenizer.bpe import QWEN2_SPLIT as QWEN2_SPLIT
from edgerun.tokenizer.bpe import BPETokenizer
from edgerun.tokenizer.from_gguf import tokenizer_from_gguf_metadata
from edgerun.tokenizer.sentencepiece import (
    SentencePieceTokenizer,
    sentencepiece_spec_to_metadata,
)
from edgerun.tokenizer.sp_model_proto import SentencePieceSpec

__all__ = [
    "TOKEN_TYPE_NORMAL",
    "TOKEN_TYPE_UNKNOWN",
    "TOKEN_TYPE_CONTROL",
    "TOKEN_TYPE_USER_DEFINED",
    "TOKEN_TYPE_UNUSED",
    "TOKEN_TYPE_BYTE",
    "Tokenizer",
    "BPETokenizer",
    "SentencePieceTokenizer",
    "SentencePieceSpec",
    "StreamDecoder",
    "sentencepiece_spec_to_metadata",
    "tokenizer_from_gguf_metadata",
]
