"""Tokenizers built from GGUF metadata, behind one interface.

A GGUF file carries no ``tokenizer.json``: the vocabulary, merges, scores, token types and special
ids live in its metadata under llama.cpp's key names (``tokenizer.ggml.*``). This module turns that
metadata (a ``dict`` of GGUF key -> value; arrays may be lists, numpy arrays or the GGUF reader's
:class:`~edgerun.formats.gguf.StringArray`) into a :class:`Tokenizer`. Nothing the size of the
vocabulary is kept as Python objects per token: the decoding table is one ``bytes`` blob plus
offsets, token types a numpy array, and the token strings stay in the mapped file.

Supported: ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE, :class:`BPETokenizer`), with the
pre-tokenizer that ``tokenizer.ggml.pre`` names (``gpt2``/``default``, ``smollm`` and the
StarCoder family, ``qwen2``, ``llama-bpe``/``llama3``); and ``"llama"`` (SentencePiece,
:class:`SentencePieceTokenizer`: Llama 1/2, Mistral, Gemma, ...), which can also load a
``tokenizer.model`` file directly.

Encoding uses the ``tokenizers`` library (a BPE model built from vocab + merges) or the
``sentencepiece`` library (a ModelProto built from pieces + scores + types; written by hand here,
so protobuf is not needed). Decoding and :meth:`Tokenizer.token_bytes` are done here, from a
per-token byte table, so that ``decode(ids) == b"".join(token_bytes(i) for i in ids).decode(
"utf-8", "replace")`` (SentencePiece with a dummy prefix also drops the first piece's leading
space), and :class:`StreamDecoder` can emit text incrementally with the same result.
"""

from __future__ import annotations

import codecs
import operator
import os
import re
import struct
import threading
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

import numpy as np

from edgerun.errors import InvalidArgumentError, ModelFormatError, UnsupportedError

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

# llama.cpp's token types (``tokenizer.ggml.token_type``).
TOKEN_TYPE_NORMAL = 1
TOKEN_TYPE_UNKNOWN = 2
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4
TOKEN_TYPE_UNUSED = 5
TOKEN_TYPE_BYTE = 6

# Token texts that end a turn in common chat formats. They join ``eos_ids`` when the vocabulary
# has them as non-normal tokens (llama.cpp does the same when it builds its end-of-generation set).
_EOT_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_END_OF_TURN_TEXTS = (
    "<|im_end|>",
    "<|endoftext|>",
    "<end_of_turn>",
    "<|eot_id|>",
    "<|eom_id|>",
    "<|end|>",
    "<EOT>",
    "<|end_of_text|>",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
)

# ---------------------------------------------------------------------------------------------
# Pre-tokenizer regexes (llama.cpp llama-vocab.cpp, and the matching HF tokenizer.json files).
# ---------------------------------------------------------------------------------------------

# GPT-2 split. The ``tokenizers`` ByteLevel pre-tokenizer with use_regex=True applies exactly this.
GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# Llama 3 (``llama-bpe``): case-insensitive contractions, numbers in groups of up to three.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2: as Llama 3, but every digit alone.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> pre-tokenizer kind.
#   "gpt2":   ByteLevel with the GPT-2 regex
#   "digits": every digit isolated, then the GPT-2 regex (StarCoder / SmolLM)
#   "llama3", "qwen2": a Split on that regex, then ByteLevel without its own regex
_PRE_TOKENIZERS = {
    "default": "gpt2",
    "gpt2": "gpt2",
    "gpt-2": "gpt2",
    "mpt": "gpt2",
    "olmo": "gpt2",
    "jais": "gpt2",
    "smollm": "digits",
    "starcoder": "digits",
    "refact": "digits",
    "command-r": "digits",
    "codeshell": "digits",
    "exaone": "digits",
    "minerva-7b": "digits",
    "qwen2": "qwen2",
    "deepseek-r1-qwen": "qwen2",
    "stablelm2": "qwen2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "llama-v3": "llama3",
    "falcon3": "llama3",
    "pixtral": "llama3",
    "dbrx": "llama3",
    "smaug-bpe": "llama3",
}

# Pre-tokenizer kinds whose vocabularies llama.cpp tokenizes with ``ignore_merges`` (a word that
# is itself in the vocabulary is taken whole), as their tokenizer.json files say.
_IGNORE_MERGES = {"llama3"}

# Kinds for which llama.cpp adds BOS when the file has no ``tokenizer.ggml.add_bos_token``.
_DEFAULT_ADD_BOS = {"llama3"}


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's printable spelling of each byte, inverted: char -> byte value."""
    bs = list(range(ord("!"), ord("~") + 1))
    bs += list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@lru_cache(maxsize=1)
def _byte_alphabet() -> tuple[re.Pattern[str], dict[int, int]]:
    """A regex finding a character outside GPT-2's byte alphabet, and the str.translate table
    that maps the alphabet to the latin-1 characters of the bytes it spells."""
    decoder = _byte_decoder()
    outside = re.compile("[^" + "".join(re.escape(c) for c in decoder) + "]")
    return outside, {ord(c): b for c, b in decoder.items()}


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _str_seq(tokens: Any) -> Sequence[str]:
    """The vocabulary as an indexable sequence of str: a GGUF :class:`StringArray` (read from the
    mapped file on access) is kept as it is, anything else becomes a list."""
    from edgerun.formats.gguf import StringArray

    if isinstance(tokens, StringArray):
        return tokens
    return [str(t) for t in tokens]


def _int_array(values: Any) -> np.ndarray:
    """Token types as an integer array (a GGUF array is already one: a view of the file)."""
    a = np.asarray(values)
    return a if a.dtype.kind in "iu" else a.astype(np.int64)


def _check_len(key: str, values: Any, n: int) -> None:
    if len(values) != n:
        raise ModelFormatError(
            f"GGUF metadata 'tokenizer.ggml.{key}' has {len(values)} entries but "
            f"'tokenizer.ggml.tokens' has {n}"
        )


class _ByteTable:
    """The per-token bytes, the decoding table: one blob and the offsets of each token's bytes
    in it (a list of 262k ``bytes`` objects would cost ~10 MiB more). Indexes as that list."""

    __slots__ = ("blob", "offsets")

    def __init__(self, blob: bytes | bytearray = b"", offsets: array[int] | None = None) -> None:
        """``offsets``: token i's bytes are ``blob[offsets[i]:offsets[i + 1]]``."""
        self.blob = bytes(blob)
        if offsets is None:
            offsets = array("q", [0])
        self.offsets = array("I", offsets) if len(blob) < 1 << 32 else offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: Any) -> bytes:
        n = len(self.offsets) - 1
        i = operator.index(i)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("token byte table index out of range")
        return self.blob[self.offsets[i] : self.offsets[i + 1]]


def _as_int(value: Any, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            return int(value)
        except (TypeError, ValueError) as e:
            raise ModelFormatError(
                f"GGUF metadata {key!r} should be an integer, got {value!r}"
            ) from e
    return value


# ---------------------------------------------------------------------------------------------
# Interface
# ---------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one model. Subclasses implement :meth:`encode`.

    Attributes every tokenizer has: ``vocab_size``, ``bos_id``/``eos_id`` (``None`` when the model
    has none), ``eos_ids`` (eos plus end-of-turn tokens; generation stops on any of them),
    ``special_ids`` (control/unknown tokens; ``decode(skip_special=True)`` drops them),
    ``add_bos`` (the model's rule for prepending BOS) and ``chat_template`` (or ``None``).
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eos_ids: frozenset[int]
    special_ids: frozenset[int]
    add_bos: bool
    chat_template: str | None

    def __init__(self) -> None:
        self._token_bytes = _ByteTable()

    # -- encoding --------------------------------------------------------------------------------

    def _set_turn_and_special_ids(
        self,
        meta: dict[str, Any],
        types: np.ndarray,
        extra_eos: Iterable[int | None],
        end_of_turn_id: Callable[[str], int | None],
        default_add_bos: bool,
    ) -> None:
        """eos_ids (eos, eot/eom ids, end-of-turn tokens), special_ids, add_bos, template."""
        eos = {i for i in (self.eos_id, *extra_eos) if i is not None}
        for text in _END_OF_TURN_TEXTS:
            i = end_of_turn_id(text)
            if i is not None:
                eos.add(i)
        self.eos_ids = frozenset(eos)
        special = set(
            np.flatnonzero((types == TOKEN_TYPE_CONTROL) | (types == TOKEN_TYPE_UNKNOWN)).tolist()
        )
        special |= {i for i in (self.bos_id, self.eos_id) if i is not None}
        self.special_ids = frozenset(special)
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        self.add_bos = bool(add_bos) if add_bos is not None else default_add_bos
        template = meta.get("tokenizer.chat_template")
        self.chat_template = str(template) if template else None

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        """Token ids for ``text``.

        ``add_bos``: ``None`` follows the model (``tokenizer.ggml.add_bos_token``); ``True`` /
        ``False`` force it. ``parse_special``: when true, control-token strings in the text (such as
        ``<|im_start|>``) become their ids, as chat prompts need; when false they are tokenized as
        plain text (use this for untrusted user text).
        """
        raise NotImplementedError

    def _with_bos(self, ids: list[int], add_bos: bool | None) -> list[int]:
        if add_bos is None:
            add_bos = self.add_bos
        if add_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    # -- decoding --------------------------------------------------------------------------------

    def token_bytes(self, id: int) -> bytes:
        """The raw bytes token ``id`` stands for (control tokens: their text, UTF-8)."""
        try:
            if id < 0:
                raise IndexError
            return self._token_bytes[id]
        except (IndexError, TypeError):
            raise InvalidArgumentError(
                f"token id {id!r} is out of range for a vocabulary of {self.vocab_size} tokens"
            ) from None

    def token_text(self, id: int) -> str:
        """``token_bytes(id)`` as text (invalid UTF-8 replaced); for display only."""
        return self.token_bytes(id).decode("utf-8", errors="replace")

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        """Text for ``ids``. Bytes that are not valid UTF-8 become U+FFFD."""
        blob, offsets = self._token_bytes.blob, self._token_bytes.offsets
        n = len(offsets) - 1
        skip = self.special_ids if skip_special else ()
        parts = []
        for i in ids:
            i = int(i)
            if i in skip:
                continue
            if not 0 <= i < n:
                self.token_bytes(i)  # raises the clear error
            parts.append(blob[offsets[i] : offsets[i + 1]])
        return b"".join(parts).decode("utf-8", errors="replace")

    @property
    def bos_token(self) -> str:
        """BOS as text ("" when the model has none), e.g. for chat templates."""
        return "" if self.bos_id is None else self.token_text(self.bos_id)

    @property
    def eos_token(self) -> str:
        """EOS as text ("" when the model has none), e.g. for chat templates."""
        return "" if self.eos_id is None else self.token_text(self.eos_id)

    def stream_decoder(
        self, skip_special: bool = False, strip_leading_space: bool = False
    ) -> StreamDecoder:
        return StreamDecoder(
            self, skip_special=skip_special, strip_leading_space=strip_leading_space
        )

    def _strips_leading_space(self, id: int) -> bool:
        """Whether :meth:`decode` drops the first byte (a space) of ``id`` when it comes first."""
        return False

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(vocab_size={self.vocab_size}, bos_id={self.bos_id}, "
            f"eos_ids={sorted(self.eos_ids)}, add_bos={self.add_bos})"
        )


# ---------------------------------------------------------------------------------------------
# Byte-level BPE
# ---------------------------------------------------------------------------------------------


class BPETokenizer(Tokenizer):
    """Byte-level BPE (``tokenizer.ggml.model = "gpt2"``): GPT-2, SmolLM, Qwen2, Llama 3, ...

    Built from ``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges`` and
    ``tokenizer.ggml.token_type``. Control tokens (type 3) are registered as special added tokens
    and user-defined tokens (type 4) as plain added tokens, so both are matched whole in text, as
    llama.cpp and transformers do.
    """

    def __init__(self, meta: dict[str, Any]) -> None:
        super().__init__()
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Regex as TkRegex
        from tokenizers import Tokenizer as TkTokenizer

        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None or not len(tokens):
            raise ModelFormatError(
                "GGUF metadata has no 'tokenizer.ggml.tokens'; the file carries no vocabulary"
            )
        tokens = _str_seq(tokens)
        merges = meta.get("tokenizer.ggml.merges")
        if merges is None or not len(merges):
            raise ModelFormatError(
                "GGUF metadata has no 'tokenizer.ggml.merges', which a byte-level BPE "
                "('tokenizer.ggml.model' = 'gpt2') vocabulary needs"
            )
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = np.full(len(tokens), TOKEN_TYPE_NORMAL, dtype=np.int32)
        types = _int_array(types)
        _check_len("token_type", types, len(tokens))

        pre = str(meta.get("tokenizer.ggml.pre") or "default")
        kind = _PRE_TOKENIZERS.get(pre)
        if kind is None:
            raise UnsupportedError(
                f"GGUF metadata 'tokenizer.ggml.pre' = {pre!r} names a pre-tokenizer edgerun does "
                f"not know yet (known: {', '.join(sorted(_PRE_TOKENIZERS))}); tokenizing with a "
                "different split would give the model wrong input"
            )
        self.pre = pre
        self.vocab_size = len(tokens)
        self.token_types = types
        self._tokens = tokens

        # One pass over the vocabulary: the decoding table (per-token bytes), the BPE vocab
        # (duplicate spellings keep their first id) and the added tokens. Control -> special,
        # user-defined -> plain added (matched whole either way). A control token spelled outside
        # the byte alphabet is a llama.cpp mislabel of a normal token (transformers skips those).
        outside_alphabet, to_latin1 = _byte_alphabet()
        vocab: dict[str, int] = {}
        control: list[Any] = []
        user: list[Any] = []

        blob = bytearray()
        offsets = array("q", [0])
        for i, (text, ttype) in enumerate(zip(tokens, types.tolist())):
            in_alphabet = outside_alphabet.search(text) is None
            if ttype == TOKEN_TYPE_NORMAL or ttype == TOKEN_TYPE_UNUSED:
                if in_alphabet:
                    blob += text.translate(to_latin1).encode("latin-1")
                else:  # a token stored verbatim rather than in the byte alphabet
                    blob += text.encode("utf-8")
            elif ttype == TOKEN_TYPE_BYTE and (m := _BYTE_TOKEN.match(text)):
                blob.append(int(m.group(1), 16))
            else:  # control, user-defined, unknown: their text as written
                blob += text.encode("utf-8")
            offsets.append(len(blob))
            if vocab.setdefault(text, i) == i and text:
                if ttype == TOKEN_TYPE_CONTROL and in_alphabet:
                    control.append(AddedToken(text, normalized=False, special=True))
                elif ttype == TOKEN_TYPE_USER_DEFINED:
                    user.append(AddedToken(text, normalized=False, special=False))
        self._token_bytes = _ByteTable(blob, offsets)
        del blob, offsets
        end_of_turn_ids = {t: vocab.get(t) for t in _END_OF_TURN_TEXTS}

        # The merges' halves are vocabulary tokens: sharing those str objects halves the
        # transient cost of the pairs.
        canon = {t: t for t in vocab}
        pairs = []
        for m in merges:
            a, sep, b = str(m).partition(" ")
            if not sep:
                raise ModelFormatError(
                    f"GGUF metadata 'tokenizer.ggml.merges' has a bad entry {m!r}"
                )
            pairs.append((canon.get(a, a), canon.get(b, b)))
        del canon
        model = models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=kind in _IGNORE_MERGES,
        )
        del vocab, pairs  # the model holds its own copy
        tk = TkTokenizer(model)
        if kind == "gpt2":
            tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        elif kind == "digits":
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Digits(individual_digits=True),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
                ]
            )
        else:
            split = LLAMA3_SPLIT if kind == "llama3" else QWEN2_SPLIT
            tk.pre_tokenizer = pre_tokenizers.Sequence(
                [
                    pre_tokenizers.Split(TkRegex(split), behavior="isolated", invert=False),
                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
                ]
            )
        tk.decoder = decoders.ByteLevel()

        if control:
            tk.add_special_tokens(control)
        if user:
            tk.add_tokens(user)
        self._tk = tk
        self._tk_plain: Any = None  # same, but control strings in text are plain text
        self._lock = threading.Lock()

        # Special ids.
        n = self.vocab_size

        def _id(key: str) -> int | None:
            v = _as_int(meta.get(key), key)
            if v is None:
                return None
            if not 0 <= v < n:
                raise ModelFormatError(
                    f"GGUF metadata {key!r} = {v} is outside the vocabulary of {n} tokens"
                )
            return v

        self.bos_id = _id("tokenizer.ggml.bos_token_id")
        self.eos_id = _id("tokenizer.ggml.eos_token_id")
        self.unk_id = _id("tokenizer.ggml.unknown_token_id")
        self.pad_id = _id("tokenizer.ggml.padding_token_id")

        def end_of_turn(text: str) -> int | None:
            i = end_of_turn_ids.get(text)
            return i if i is not None and types[i] != TOKEN_TYPE_NORMAL else None

        self._set_turn_and_special_ids(
            meta, types, [_id(k) for k in _EOT_KEYS], end_of_turn, kind in _DEFAULT_ADD_BOS
        )

    def _plain(self) -> Any:
        """A copy of the backend that treats control-token strings as ordinary text."""
        if self._tk_plain is None:
            with self._lock:
                if self._tk_plain is None:
                    from tokenizers import Tokenizer as TkTokenizer

                    tk = TkTokenizer.from_str(self._tk.to_str())
                    tk.encode_special_tokens = True
                    self._tk_plain = tk
        return self._tk_plain

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode() takes a str, got {type(text).__name__}")
        tk = self._tk if parse_special else self._plain()
        ids = tk.encode(text, add_special_tokens=False).ids if text else []
        return self._with_bos(ids, add_bos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool | None = None, parse_special: bool = True
    ) -> list[list[int]]:
        tk = self._tk if parse_special else self._plain()
        out = tk.encode_batch(list(texts), add_special_tokens=False)
        return [self._with_bos(e.ids, add_bos) for e in out]

    def id_to_token(self, id: int) -> str:
        """The token as the vocabulary spells it (byte-level alphabet for normal tokens)."""
        self.token_bytes(id)  # range check
        return self._tokens[id]


# ---------------------------------------------------------------------------------------------
# SentencePiece
# ---------------------------------------------------------------------------------------------

# sentencepiece's ModelProto, written and read by hand: the schema is small and stable, and doing
# it here keeps protobuf out of the runtime dependencies. Field numbers are those of
# sentencepiece_model.proto (ModelProto, SentencePiece, TrainerSpec, NormalizerSpec).
_SPM_UNIGRAM = 1
_SPM_BPE = 2
_SPM_MODEL_TYPES = {"unigram": _SPM_UNIGRAM, "bpe": _SPM_BPE, "word": 3, "char": 4}

_SPACE = "\u2581"  # "▁", SentencePiece's spelling of a space


def _pb_varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int32/int64 negatives: ten-byte two's complement
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _pb_field_varint(field: int, n: int) -> bytes:
    return _pb_varint(field << 3) + _pb_varint(int(n))


def _pb_field_bytes(field: int, data: bytes) -> bytes:
    return _pb_varint((field << 3) | 2) + _pb_varint(len(data)) + data


def _pb_field_float(field: int, x: float) -> bytes:
    return _pb_varint((field << 3) | 5) + struct.pack("<f", x)


_SHORT_VARINTS = [bytes((i,)) for i in range(128)]
_PB_TYPE_FIELDS = {ty: _pb_field_varint(3, ty) for ty in range(7)}


def _pb_piece(out: bytearray, piece: str, score: bytes, ty: int) -> None:
    """Append one ModelProto ``pieces`` entry to ``out``: a SentencePiece message with 1 piece
    (string), 2 score (``score``: the float's four bytes), 3 type (enum, left out when normal)."""
    short = _SHORT_VARINTS
    p = piece.encode("utf-8")
    lp = len(p)
    head = short[lp] if lp < 128 else _pb_varint(lp)
    tail = b"" if ty == TOKEN_TYPE_NORMAL else _PB_TYPE_FIELDS.get(ty) or _pb_field_varint(3, ty)
    n = 6 + len(head) + lp + len(tail)
    out += b"\x0a" + (short[n] if n < 128 else _pb_varint(n)) + b"\x0a" + head
    out += p
    out += b"\x15" + score + tail


def _pb_parse(data: bytes) -> list[tuple[int, int, Any]]:
    """One protobuf message's fields as ``(field, wire type, value)``; raises ValueError."""
    out = []
    i, n = 0, len(data)

    def varint() -> int:
        nonlocal i
        r = shift = 0
        while True:
            if i >= n or shift > 63:
                raise ValueError("truncated varint")
            c = data[i]
            i += 1
            r |= (c & 0x7F) << shift
            shift += 7
            if c < 0x80:
                return r

    while i < n:
        key = varint()
        fnum, wire = key >> 3, key & 7
        if wire == 0:
            value: Any = varint()
        elif wire == 1:
            value = data[i : i + 8]
            i += 8
        elif wire == 2:
            size = varint()
            value = data[i : i + size]
            i += size
        elif wire == 5:
            value = data[i : i + 4]
            i += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        if i > n:
            raise ValueError("truncated field")
        out.append((fnum, wire, value))
    return out


def _pb_int32(v: int) -> int:
    v &= (1 << 64) - 1
    return v - (1 << 64) if v >= 1 << 63 else v


@dataclass
class SentencePieceSpec:
    """What a SentencePiece model is made of: the pieces, their scores and types, and the few
    trainer/normalizer settings that change how text is encoded. :func:`to_model_proto` writes it
    as the serialized ModelProto ``sentencepiece`` loads; :func:`from_model_proto` reads one.

    ``types`` uses SentencePiece's numbering, which is also GGUF's ``tokenizer.ggml.token_type``
    (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte).
    """

    pieces: list[str]
    scores: list[float]
    types: list[int]
    model_type: int = _SPM_BPE
    byte_fallback: bool = False
    add_dummy_prefix: bool = True
    remove_extra_whitespaces: bool = False
    escape_whitespaces: bool = True
    treat_whitespace_as_suffix: bool = False
    normalizer_name: str = "identity"
    precompiled_charsmap: bytes = b""
    unk_surface: str | None = None
    # Special ids as a .model file's trainer_spec states them (-1: none).
    unk_id: int = 0
    bos_id: int = 1
    eos_id: int = 2
    pad_id: int = -1
    # A denormalizer, kept verbatim from a .model file (rare; None: none).
    denormalizer: bytes | None = field(default=None, repr=False)

    def to_model_proto(self) -> bytes:
        out = bytearray()
        pack = struct.Struct("<f").pack
        for piece, score, ty in zip(self.pieces, self.scores, self.types):
            _pb_piece(out, piece, pack(score), ty)
        out += self._proto_settings(len(self.pieces))
        return bytes(out)

    def _proto_settings(self, n_pieces: int) -> bytes:
        """The ModelProto fields after the pieces: trainer, normalizer, denormalizer specs."""
        parts = []
        trainer = (
            _pb_field_varint(3, self.model_type)
            + _pb_field_varint(4, n_pieces)
            + _pb_field_varint(24, self.treat_whitespace_as_suffix)
            + _pb_field_varint(35, self.byte_fallback)
            + _pb_field_varint(40, self.unk_id)
            + _pb_field_varint(41, self.bos_id)
            + _pb_field_varint(42, self.eos_id)
            + _pb_field_varint(43, self.pad_id)
        )
        if self.unk_surface is not None:
            trainer += _pb_field_bytes(44, self.unk_surface.encode("utf-8"))
        parts.append(_pb_field_bytes(2, trainer))
        normalizer = (
            _pb_field_bytes(1, self.normalizer_name.encode("utf-8"))
            + (_pb_field_bytes(2, self.precompiled_charsmap) if self.precompiled_charsmap else b"")
            + _pb_field_varint(3, self.add_dummy_prefix)
            + _pb_field_varint(4, self.remove_extra_whitespaces)
            + _pb_field_varint(5, self.escape_whitespaces)
        )
        parts.append(_pb_field_bytes(3, normalizer))
        if self.denormalizer is not None:
            parts.append(_pb_field_bytes(5, self.denormalizer))
        return b"".join(parts)

    @classmethod
    def from_model_proto(cls, data: bytes) -> SentencePieceSpec:
        """Read a serialized ModelProto (the contents of a ``tokenizer.model`` file)."""
        try:
            top = _pb_parse(data)
            pieces, scores, types = [], [], []
            spec = cls(pieces, scores, types, model_type=_SPM_UNIGRAM)
            # Proto defaults, which a file leaves out: a default NormalizerSpec is NFKC with a
            # dummy prefix and whitespace clean-up; sentencepiece applies the same.
            spec.add_dummy_prefix = True
            spec.remove_extra_whitespaces = True
            spec.normalizer_name = ""
            for f, wire, value in top:
                if f == 1 and wire == 2:
                    piece, score, ty = "", 0.0, TOKEN_TYPE_NORMAL
                    for pf, pw, pv in _pb_parse(value):
                        if pf == 1 and pw == 2:
                            piece = bytes(pv).decode("utf-8")
                        elif pf == 2 and pw == 5:
                            score = struct.unpack("<f", pv)[0]
                        elif pf == 3 and pw == 0:
                            ty = int(pv)
                    pieces.append(piece)
                    scores.append(score)
                    types.append(ty)
                elif f == 2 and wire == 2:
                    for tf, tw, tv in _pb_parse(value):
                        if tw == 0:
                            if tf == 3:
                                spec.model_type = int(tv)
                            elif tf == 24:
                                spec.treat_whitespace_as_suffix = bool(tv)
                            elif tf == 35:
                                spec.byte_fallback = bool(tv)
                            elif tf in (40, 41, 42, 43):
                                setattr(
                                    spec,
                                    {40: "unk_id", 41: "bos_id", 42: "eos_id", 43: "pad_id"}[tf],
                                    _pb_int32(tv),
                                )
                        elif tf == 44 and tw == 2:
                            spec.unk_surface = bytes(tv).decode("utf-8")
                elif f == 3 and wire == 2:
                    for nf, nw, nv in _pb_parse(value):
                        if nf == 1 and nw == 2:
                            spec.normalizer_name = bytes(nv).decode("utf-8")
                        elif nf == 2 and nw == 2:
                            spec.precompiled_charsmap = bytes(nv)
                        elif nf == 3 and nw == 0:
                            spec.add_dummy_prefix = bool(nv)
                        elif nf == 4 and nw == 0:
                            spec.remove_extra_whitespaces = bool(nv)
                        elif nf == 5 and nw == 0:
                            spec.escape_whitespaces = bool(nv)
                elif f == 5 and wire == 2:
                    spec.denormalizer = bytes(value)
        except (ValueError, UnicodeDecodeError, struct.error) as e:
            raise ModelFormatError(
                f"not a valid SentencePiece model ({e}); expected the serialized ModelProto of a "
                "tokenizer.model file"
            ) from e
        if not pieces:
            raise ModelFormatError(
                "the SentencePiece model has no pieces; expected the serialized ModelProto of a "
                "tokenizer.model file"
            )
        return spec


def _literal_regex(strings: Iterable[str]) -> re.Pattern[str] | None:
    """A regex matching any of ``strings``, leftmost-longest (as tokenizers' added-token matcher
    does), built as a trie so that thousands of alternatives cost little per text position."""
    strings = sorted({s for s in strings if s})
    if not strings:
        return None
    long = sorted((s for s in strings if len(s) > 200), key=len, reverse=True)
    trie: dict[str, Any] = {}
    for s in strings:
        if len(s) > 200:
            continue
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in node.items() if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        # Greedy "?": the longer continuations are tried before ending here.
        return f"(?:{body})?" if "" in node else body

    pattern = "|".join([*(re.escape(s) for s in long), *([build(trie)] if trie else [])])
    return re.compile(pattern)


class SentencePieceTokenizer(Tokenizer):
    """SentencePiece (``tokenizer.ggml.model = "llama"``): Llama 1/2, Mistral, Gemma, Phi-3, ...

    Encoding is done by the ``sentencepiece`` library, on a ModelProto built from the GGUF's
    ``tokenizer.ggml.tokens``, ``tokenizer.ggml.scores`` and ``tokenizer.ggml.token_type`` (BPE
    over the scores, as llama.cpp's SPM tokenizer does; byte fallback when the vocabulary has the
    ``<0xNN>`` byte tokens; identity normalization, spaces escaped as ``▁``; a dummy prefix space
    when ``tokenizer.ggml.add_space_prefix`` says so, true by default as in llama.cpp).
    :meth:`from_file` loads a Hugging Face / original ``tokenizer.model`` through the same code.

    Special tokens: control tokens (``<bos>``, ``<start_of_turn>``, ...) are never produced from
    text by SentencePiece; with ``parse_special=True`` their strings in the text are cut out and
    become their ids first (leftmost-longest), and each piece of text between them is encoded on
    its own (so with a dummy prefix each gets its ``▁``, as llama.cpp does). User-defined tokens
    are matched whole by SentencePiece itself, always (inside the escaped text: with a dummy
    prefix, text that starts with one gets a ``▁`` token first, where llama.cpp, which cuts them
    out beforehand, gives none; vocabularies without a dummy prefix, such as Gemma's, agree).

    Decoding: a normal or user-defined token is its text with ``▁`` as a space, a byte token
    ``<0xNN>`` the byte itself, a control or unknown token its text (dropped with
    ``skip_special``). With a dummy prefix, :meth:`decode` drops the space that starts the first
    piece, as SentencePiece and transformers do; :class:`StreamDecoder` keeps it unless asked
    (``strip_leading_space=True``), since a generated continuation's first space is real text.
    """

    def __init__(
        self,
        meta: dict[str, Any],
        *,
        spec: SentencePieceSpec | None = None,
    ) -> None:
        """Build from GGUF metadata. ``spec``, when given, supplies the SentencePiece model
        settings (normalizer, model type) that a GGUF does not carry; :meth:`from_file` passes
        the file's own."""
        super().__init__()
        tokens = meta.get("tokenizer.ggml.tokens")
        if tokens is None or not len(tokens):
            raise ModelFormatError(
                "GGUF metadata has no 'tokenizer.ggml.tokens'; the file carries no vocabulary"
            )
        tokens = _str_seq(tokens)
        n = len(tokens)
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = np.full(n, TOKEN_TYPE_NORMAL, dtype=np.int32)
        types = _int_array(types)
        scores = meta.get("tokenizer.ggml.scores")
        scores = np.zeros(n, dtype=np.float32) if scores is None else np.asarray(scores)
        if scores.dtype.kind != "f":
            scores = scores.astype(np.float64)
        _check_len("token_type", types, n)
        _check_len("scores", scores, n)

        def _id(key: str) -> int | None:
            v = _as_int(meta.get(key), key)
            if v is None or v < 0:  # -1: none (a .model file's pad_id, for one)
                return None
            if v >= n:
                raise ModelFormatError(
                    f"GGUF metadata {key!r} = {v} is outside the vocabulary of {n} tokens"
                )
            return v

        self.vocab_size = n
        self.bos_id = _id("tokenizer.ggml.bos_token_id")
        self.eos_id = _id("tokenizer.ggml.eos_token_id")
        self.pad_id = _id("tokenizer.ggml.padding_token_id")
        unk_id = _id("tokenizer.ggml.unknown_token_id")
        if unk_id is None:
            unknown = np.flatnonzero(types == TOKEN_TYPE_UNKNOWN)
            unk_id = int(unknown[0]) if len(unknown) else 0
        self.unk_id = unk_id

        # The scores as the ModelProto stores them (float32, four bytes each).
        if scores.dtype == np.float32:
            score_bytes = scores.astype("<f4", copy=False).tobytes()
        else:
            pack = struct.Struct("<f").pack
            score_bytes = b"".join(pack(s) for s in scores.tolist())

        # One pass over the vocabulary builds the model the library runs (its pieces, serialized
        # straight into the ModelProto), the decoding table and the special-token strings.
        # Types are normalized to what SentencePiece accepts: exactly one unknown piece (Gemma
        # files label <unk> a control token), byte pieces only when spelled <0xNN>, no empty or
        # repeated pieces (those become unused placeholders, which text never produces; the first
        # of a repeated spelling keeps it).
        escape = spec.escape_whitespaces if spec is not None else True
        sp_types = bytearray(n)
        proto = bytearray()
        seen: set[str] = set()
        byte_ids: list[int] = []
        special_text: dict[str, int] = {}
        blob = bytearray()
        offsets = array("q", [0])
        for i, (text, ty) in enumerate(zip(tokens, types.tolist())):
            if i == unk_id:
                ty = TOKEN_TYPE_UNKNOWN
            elif ty == TOKEN_TYPE_UNKNOWN:
                ty = TOKEN_TYPE_CONTROL
            elif ty == TOKEN_TYPE_BYTE and not _BYTE_TOKEN.match(text):
                ty = TOKEN_TYPE_NORMAL
            elif ty not in (
                TOKEN_TYPE_NORMAL,
                TOKEN_TYPE_CONTROL,
                TOKEN_TYPE_USER_DEFINED,
                TOKEN_TYPE_UNUSED,
                TOKEN_TYPE_BYTE,
            ):
                ty = TOKEN_TYPE_NORMAL  # 0, "undefined" in llama.cpp
            piece = text
            if ty == TOKEN_TYPE_USER_DEFINED and escape:
                # GGUF stores user-defined pieces as raw text ("  " for two spaces); SentencePiece
                # matches them in the escaped text ("▁▁").
                piece = piece.replace(" ", _SPACE)
            if not piece or piece in seen:
                piece = f"<edgerun-placeholder-{i}>"
                ty = TOKEN_TYPE_UNUSED if ty != TOKEN_TYPE_UNKNOWN else ty
            seen.add(piece)
            sp_types[i] = ty
            _pb_piece(proto, piece, score_bytes[4 * i : 4 * i + 4], ty)
            # Decoding: a byte token is its byte, a control or unknown token its text, any other
            # its text with ▁ as a space. Control and unknown strings are parsed as special.
            if ty == TOKEN_TYPE_BYTE:
                byte_ids.append(i)
                blob.append(int(text[3:5], 16))
            elif ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN):
                if text:
                    special_text.setdefault(text, i)
                blob += text.encode("utf-8")
            else:
                blob += text.replace(_SPACE, " ").encode("utf-8")
            offsets.append(len(blob))
        self._token_bytes = _ByteTable(blob, offsets)
        del seen, score_bytes, blob, offsets
        self.token_types = np.frombuffer(sp_types, dtype=np.uint8)
        self._tokens = tokens
        self._scores = scores

        has_bytes = bool(byte_ids)
        if spec is None:
            add_prefix = meta.get("tokenizer.ggml.add_space_prefix")
            spec = SentencePieceSpec(
                pieces=[],
                scores=[],
                types=[],
                model_type=_SPM_BPE,
                byte_fallback=has_bytes,
                add_dummy_prefix=True if add_prefix is None else bool(add_prefix),
                remove_extra_whitespaces=False,
                escape_whitespaces=True,
            )
        else:
            spec = replace(spec, pieces=[], scores=[], types=[])
            spec.byte_fallback = spec.byte_fallback and has_bytes
        spec.unk_id = unk_id
        spec.bos_id = -1 if self.bos_id is None else self.bos_id
        spec.eos_id = -1 if self.eos_id is None else self.eos_id
        spec.pad_id = -1 if self.pad_id is None else self.pad_id
        self._settings = spec  # the spec without its pieces: see the spec property
        self.add_space_prefix = spec.add_dummy_prefix
        proto += spec._proto_settings(n)
        model_proto = bytes(proto)
        del proto

        import sentencepiece

        try:
            self._sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        except (RuntimeError, OSError) as e:
            raise ModelFormatError(
                f"the SentencePiece vocabulary could not be loaded ({e}); the GGUF tokenizer "
                "metadata is inconsistent"
            ) from e
        del model_proto

        # decode() drops the first piece's leading space where SentencePiece does.
        self._strip_first_space = (
            spec.add_dummy_prefix or spec.remove_extra_whitespaces
        ) and not spec.treat_whitespace_as_suffix
        self._byte_ids = frozenset(byte_ids)

        # Special-token strings in text are matched leftmost-longest.
        self._special_text = special_text
        self._special_re = _literal_regex(special_text)

        # llama.cpp adds BOS to a SentencePiece vocabulary whose file does not say otherwise.
        self._set_turn_and_special_ids(
            meta, self.token_types, [_id(k) for k in _EOT_KEYS], special_text.get, True
        )

    @property
    def spec(self) -> SentencePieceSpec:
        """The SentencePiece model this tokenizer runs: its pieces (as the library holds them),
        scores, types and settings. Rebuilt on each access; the vocabulary is not kept twice."""
        pieces = [self._sp.id_to_piece(i) for i in range(self.vocab_size)]
        return replace(
            self._settings,
            pieces=pieces,
            scores=self._scores.tolist(),
            types=self.token_types.tolist(),
        )

    @property
    def model_proto(self) -> bytes:
        """The serialized ModelProto the ``sentencepiece`` library was loaded from."""
        return self.spec.to_model_proto()

    # -- construction from a tokenizer.model --------------------------------------------------

    @classmethod
    def from_file(
        cls,
        path: str | os.PathLike[str],
        *,
        add_bos: bool | None = None,
        chat_template: str | None = None,
    ) -> SentencePieceTokenizer:
        """Load a SentencePiece ``tokenizer.model`` file (Hugging Face repos, original releases).

        The file's pieces, types and normalizer settings are kept as they are. ``add_bos``
        defaults to true when the model has a BOS piece (as Llama and Gemma want).
        """
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise InvalidArgumentError(f"cannot read SentencePiece model {str(path)!r}: {e}") from e
        return cls.from_model_proto(data, add_bos=add_bos, chat_template=chat_template)

    @classmethod
    def from_model_proto(
        cls,
        data: bytes,
        *,
        add_bos: bool | None = None,
        chat_template: str | None = None,
    ) -> SentencePieceTokenizer:
        """As :meth:`from_file`, from the serialized ModelProto's bytes."""
        spec = SentencePieceSpec.from_model_proto(bytes(data))
        meta = sentencepiece_spec_to_metadata(spec)
        if add_bos is not None:
            meta["tokenizer.ggml.add_bos_token"] = bool(add_bos)
        elif meta.get("tokenizer.ggml.bos_token_id") is None:
            meta["tokenizer.ggml.add_bos_token"] = False
        if chat_template:
            meta["tokenizer.chat_template"] = chat_template
        return cls(meta, spec=spec)

    # -- encoding -------------------------------------------------------------------------------

    def _encode_text(self, text: str) -> list[int]:
        return self._sp.encode(text, out_type=int) if text else []

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode() takes a str, got {type(text).__name__}")
        if not parse_special or self._special_re is None:
            return self._with_bos(self._encode_text(text), add_bos)
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids += self._encode_text(text[pos : m.start()])
            ids.append(self._special_text[m.group()])
            pos = m.end()
        ids += self._encode_text(text[pos:])
        return self._with_bos(ids, add_bos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool | None = None, parse_special: bool = True
    ) -> list[list[int]]:
        return [self.encode(t, add_bos=add_bos, parse_special=parse_special) for t in texts]

    # -- decoding -------------------------------------------------------------------------------

    def _strips_leading_space(self, id: int) -> bool:
        return (
            self._strip_first_space
            and id not in self._byte_ids
            and id not in self.special_ids
            and self._token_bytes[id][:1] == b" "
        )

    def decode(self, ids: Iterable[int], skip_special: bool = False) -> str:
        if not self._strip_first_space:
            return super().decode(ids, skip_special)
        ids = [int(i) for i in ids]
        skip = self.special_ids if skip_special else ()
        first = next((i for i in ids if i not in skip), None)
        text = super().decode(ids, skip_special)
        if first is not None and self._strips_leading_space(first):
            text = text[1:]
        return text

    def id_to_token(self, id: int) -> str:
        """The token as the vocabulary spells it (``▁`` for a space in normal tokens)."""
        self.token_bytes(id)  # range check
        return self._tokens[id]


def sentencepiece_spec_to_metadata(spec: SentencePieceSpec) -> dict[str, Any]:
    """GGUF-style tokenizer metadata for a SentencePiece model, as llama.cpp's converter writes
    it (user-defined pieces keep ``▁``: :class:`SentencePieceTokenizer` accepts both)."""
    n = len(spec.pieces)

    def ok(i: int) -> int | None:
        return i if 0 <= i < n else None

    unk = ok(spec.unk_id)
    if unk is None or spec.types[unk] != TOKEN_TYPE_UNKNOWN:
        unk = next((i for i, ty in enumerate(spec.types) if ty == TOKEN_TYPE_UNKNOWN), unk)
    meta: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": list(spec.pieces),
        "tokenizer.ggml.scores": list(spec.scores),
        "tokenizer.ggml.token_type": list(spec.types),
        "tokenizer.ggml.add_space_prefix": spec.add_dummy_prefix,
        "tokenizer.ggml.unknown_token_id": unk,
        "tokenizer.ggml.bos_token_id": ok(spec.bos_id),
        "tokenizer.ggml.eos_token_id": ok(spec.eos_id),
        "tokenizer.ggml.padding_token_id": ok(spec.pad_id),
    }
    return {k: v for k, v in meta.items() if v is not None}


# ---------------------------------------------------------------------------------------------
# Factory
# ---------------------------------------------------------------------------------------------


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes (``meta``: GGUF key -> value; arrays as
    lists, numpy arrays or :class:`~edgerun.formats.gguf.StringArray`)."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ModelFormatError(
            "GGUF metadata has no 'tokenizer.ggml.model'; the file carries no tokenizer"
        )
    model = str(model)
    if model == "gpt2":
        return BPETokenizer(meta)
    if model == "llama":
        return SentencePieceTokenizer(meta)
    what = {
        "t5": "Unigram (T5-style) tokenizers are not supported",
        "bert": "WordPiece (BERT-style) tokenizers are not supported",
        "rwkv": "RWKV tokenizers are not supported",
    }.get(model, "this tokenizer type is not supported")
    raise UnsupportedError(
        f"GGUF metadata 'tokenizer.ggml.model' = {model!r}: {what}. "
        "edgerun supports byte-level BPE ('gpt2') and SentencePiece ('llama') vocabularies."
    )


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------


class StreamDecoder:
    """Turns token ids, fed one at a time, into text without ever splitting a character.

    ``push(id)`` returns the text that became complete with this token (often "", when a
    multi-byte character is still incomplete); ``flush()`` returns what is left at the end (an
    incomplete tail becomes U+FFFD there, as :meth:`Tokenizer.decode` would do). The concatenation
    of everything returned equals ``tokenizer.decode(ids, skip_special)``, except that a
    SentencePiece model with a dummy prefix keeps the first piece's leading space unless
    ``strip_leading_space`` is true (a generated continuation's first space is real text).
    """

    def __init__(
        self, tokenizer: Tokenizer, skip_special: bool = False, strip_leading_space: bool = False
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.strip_leading_space = strip_leading_space
        self._first = True
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, id: int) -> str:
        id = int(id)
        if self.skip_special and id in self.tokenizer.special_ids:
            return ""
        data = self.tokenizer.token_bytes(id)
        if self._first:
            self._first = False
            if self.strip_leading_space and self.tokenizer._strips_leading_space(id):
                data = data[1:]
        return self._dec.decode(data, final=False)

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        self._first = True
        return out

    @property
    def pending(self) -> bool:
        """True while bytes of an incomplete character are held back."""
        return bool(self._dec.getstate()[0])
