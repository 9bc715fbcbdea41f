"""Tokenizers built from GGUF metadata, behind one interface.

A GGUF file carries no ``tokenizer.json``: the vocabulary, merges, token types and special ids
live in its metadata under llama.cpp's key names (``tokenizer.ggml.*``). This module turns that
metadata (a plain ``dict`` of GGUF key -> python value) into a :class:`Tokenizer`.

Supported today: ``tokenizer.ggml.model = "gpt2"`` (byte-level BPE), with the pre-tokenizer that
``tokenizer.ggml.pre`` names (``gpt2``/``default``, ``smollm`` and the StarCoder family,
``qwen2``, ``llama-bpe``/``llama3``). SentencePiece (``"llama"``) is not implemented yet and raises
:class:`~edgerun.errors.UnsupportedError`.

Encoding uses the ``tokenizers`` library (a BPE model built from vocab + merges); decoding and
:meth:`Tokenizer.token_bytes` are done here, from a per-token byte table, so that
``decode(ids) == b"".join(token_bytes(i) for i in ids).decode("utf-8", "replace")`` exactly, and
:class:`StreamDecoder` can emit text incrementally with the same result.
"""

from __future__ import annotations

import codecs
import re
import threading
from collections.abc import Iterable, Sequence
from functools import lru_cache
from typing import Any

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
    "StreamDecoder",
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


_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


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
        self._token_bytes: list[bytes] = []

    # -- encoding --------------------------------------------------------------------------------

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
        table = self._token_bytes
        n = len(table)
        skip = self.special_ids if skip_special else ()
        parts = []
        for i in ids:
            i = int(i)
            if i in skip:
                continue
            if not 0 <= i < n:
                self.token_bytes(i)  # raises the clear error
            parts.append(table[i])
        return b"".join(parts).decode("utf-8", errors="replace")

    @property
    def bos_token(self) -> str:
        """BOS as text ("" when the model has none), e.g. for chat templates."""
        return "" if self.bos_id is None else self.token_text(self.bos_id)

    @property
    def eos_token(self) -> str:
        """EOS as text ("" when the model has none), e.g. for chat templates."""
        return "" if self.eos_id is None else self.token_text(self.eos_id)

    def stream_decoder(self, skip_special: bool = False) -> StreamDecoder:
        return StreamDecoder(self, skip_special=skip_special)

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
        if not tokens:
            raise ModelFormatError(
                "GGUF metadata has no 'tokenizer.ggml.tokens'; the file carries no vocabulary"
            )
        tokens = [str(t) for t in tokens]
        merges = meta.get("tokenizer.ggml.merges")
        if not merges:
            raise ModelFormatError(
                "GGUF metadata has no 'tokenizer.ggml.merges', which a byte-level BPE "
                "('tokenizer.ggml.model' = 'gpt2') vocabulary needs"
            )
        types = meta.get("tokenizer.ggml.token_type")
        if types is None:
            types = [TOKEN_TYPE_NORMAL] * len(tokens)
        types = [int(t) for t in types]
        if len(types) != len(tokens):
            raise ModelFormatError(
                f"GGUF metadata 'tokenizer.ggml.token_type' has {len(types)} entries but "
                f"'tokenizer.ggml.tokens' has {len(tokens)}"
            )

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

        # Per-token bytes, the decoding table.
        byte_decoder = _byte_decoder()
        table: list[bytes] = []
        for text, ttype in zip(tokens, types):
            if ttype == TOKEN_TYPE_NORMAL or ttype == TOKEN_TYPE_UNUSED:
                if all(c in byte_decoder for c in text):
                    table.append(bytes(byte_decoder[c] for c in text))
                else:  # a token stored verbatim rather than in the byte alphabet
                    table.append(text.encode("utf-8"))
            elif ttype == TOKEN_TYPE_BYTE and (m := _BYTE_TOKEN.match(text)):
                table.append(bytes([int(m.group(1), 16)]))
            else:  # control, user-defined, unknown: their text as written
                table.append(text.encode("utf-8"))
        self._token_bytes = table

        # The BPE model. Duplicate spellings keep their first id.
        vocab: dict[str, int] = {}
        for i, text in enumerate(tokens):
            vocab.setdefault(text, i)
        pairs = []
        for m in merges:
            a, sep, b = str(m).partition(" ")
            if not sep:
                raise ModelFormatError(
                    f"GGUF metadata 'tokenizer.ggml.merges' has a bad entry {m!r}"
                )
            pairs.append((a, b))
        model = models.BPE(
            vocab=vocab,
            merges=pairs,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=kind in _IGNORE_MERGES,
        )
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

        # Added tokens: control -> special, user-defined -> plain added (matched whole either way).
        # A control token spelled outside the byte alphabet is a llama.cpp mislabel of a normal
        # token (transformers skips those too).
        control = [
            AddedToken(t, normalized=False, special=True)
            for i, (t, ty) in enumerate(zip(tokens, types))
            if ty == TOKEN_TYPE_CONTROL
            and t
            and vocab.get(t) == i
            and all(c in byte_decoder for c in t)
        ]
        user = [
            AddedToken(t, normalized=False, special=False)
            for i, (t, ty) in enumerate(zip(tokens, types))
            if ty == TOKEN_TYPE_USER_DEFINED and t and vocab.get(t) == i
        ]
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
        eos = {self.eos_id} if self.eos_id is not None else set()
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            v = _id(key)
            if v is not None:
                eos.add(v)
        for text in _END_OF_TURN_TEXTS:
            i = vocab.get(text)
            if i is not None and types[i] != TOKEN_TYPE_NORMAL:
                eos.add(i)
        self.eos_ids = frozenset(eos)
        special = {
            i for i, ty in enumerate(types) if ty in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_UNKNOWN)
        }
        special |= {i for i in (self.bos_id, self.eos_id) if i is not None}
        self.special_ids = frozenset(special)

        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        self.add_bos = bool(add_bos) if add_bos is not None else kind in _DEFAULT_ADD_BOS
        template = meta.get("tokenizer.chat_template")
        self.chat_template = str(template) if template else None

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
# Factory
# ---------------------------------------------------------------------------------------------


def tokenizer_from_gguf_metadata(meta: dict[str, Any]) -> Tokenizer:
    """The tokenizer a GGUF file's metadata describes (``meta``: GGUF key -> python value)."""
    model = meta.get("tokenizer.ggml.model")
    if model is None:
        raise ModelFormatError(
            "GGUF metadata has no 'tokenizer.ggml.model'; the file carries no tokenizer"
        )
    model = str(model)
    if model == "gpt2":
        return BPETokenizer(meta)
    what = {
        "llama": "SentencePiece (Llama/Mistral/Gemma-style) tokenizers are not implemented yet",
        "t5": "Unigram (T5-style) tokenizers are not supported",
        "bert": "WordPiece (BERT-style) tokenizers are not supported",
        "rwkv": "RWKV tokenizers are not supported",
    }.get(model, "this tokenizer type is not supported")
    raise UnsupportedError(
        f"GGUF metadata 'tokenizer.ggml.model' = {model!r}: {what}. "
        "edgerun currently supports byte-level BPE ('gpt2') vocabularies only."
    )


# ---------------------------------------------------------------------------------------------
# Streaming detokenization
# ---------------------------------------------------------------------------------------------


class StreamDecoder:
    """Turns token ids, fed one at a time, into text without ever splitting a character.

    ``push(id)`` returns the text that became complete with this token (often "", when a
    multi-byte character is still incomplete); ``flush()`` returns what is left at the end (an
    incomplete tail becomes U+FFFD there, as :meth:`Tokenizer.decode` would do). The concatenation
    of everything returned equals ``tokenizer.decode(ids, skip_special)``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, id: int) -> str:
        id = int(id)
        if self.skip_special and id in self.tokenizer.special_ids:
            return ""
        return self._dec.decode(self.tokenizer.token_bytes(id), final=False)

    def push_many(self, ids: Iterable[int]) -> str:
        return "".join(self.push(i) for i in ids)

    def flush(self) -> str:
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out

    @property
    def pending(self) -> bool:
        """True while bytes of an incomplete character are held back."""
        return bool(self._dec.getstate()[0])
