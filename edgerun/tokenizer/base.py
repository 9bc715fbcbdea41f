"""The interface every tokenizer implements, and the pieces the concrete ones share.

:class:`Tokenizer` holds what does not depend on the vocabulary's kind: the attributes
(``vocab_size``, ``bos_id``/``eos_id``/``eos_ids``, ``special_ids``, ``add_bos``,
``chat_template``), BOS handling, and decoding from a per-token byte table (:class:`_ByteTable`:
one ``bytes`` blob plus offsets, so nothing the size of the vocabulary is kept as Python objects
per token). Also here: llama.cpp's token-type numbers, the end-of-turn token texts, and the small
GGUF-metadata helpers (:func:`_str_seq`, :func:`_int_array`, :func:`_check_len`, :func:`_as_int`)
that both :mod:`.bpe` and :mod:`.sentencepiece` use; and :class:`StreamDecoder`, which turns
token ids into text as soon as each character is complete, through the :class:`Tokenizer`
interface only. This module imports nothing else from the package.
"""

from __future__ import annotations

import codecs
import operator
import re
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from edgerun.errors import InvalidArgumentError, ModelFormatError

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

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


# A vocabulary beyond these is corrupt or hostile (real ones: <= 262k tokens, <= 256 bytes).
MAX_VOCAB = 1 << 24
MAX_TOKEN_BYTES = 4096


def _vocabulary(meta: dict[str, Any]) -> Sequence[str]:
    """`tokenizer.ggml.tokens` as a sequence of str; a clear error when it is missing, not an
    array of strings, or holds an absurdly long token."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None or isinstance(tokens, str | bytes | int | float) or not len(tokens):
        raise ModelFormatError(
            "GGUF metadata has no 'tokenizer.ggml.tokens'; the file carries no vocabulary"
        )
    tokens = _str_seq(tokens, "tokenizer.ggml.tokens")
    if len(tokens) > MAX_VOCAB:
        raise ModelFormatError(
            f"GGUF metadata 'tokenizer.ggml.tokens' should have at most {MAX_VOCAB} entries, "
            f"found {len(tokens)}"
        )
    _check_token_lengths(tokens, "tokenizer.ggml.tokens", MAX_TOKEN_BYTES)
    return tokens


def _is_mapped_strings(x: Any) -> bool:
    """Whether x is a GGUF reader's mapped string array (formats.gguf.StringArray: a
    Sequence[str] with max_len()), told by its interface: the file formats sit above the
    tokenizer, which does not import them."""
    return isinstance(x, Sequence) and callable(getattr(x, "max_len", None))


def _check_token_lengths(strings: Sequence[str], key: str, limit: int) -> None:
    """Refuse an array holding a string longer than ``limit`` bytes, before decoding any."""
    if _is_mapped_strings(strings):
        longest = strings.max_len()
    else:
        longest = max((len(t) for t in strings), default=0)
        if longest > limit // 4:  # characters: measure the long ones in bytes
            longest = max(len(t.encode("utf-8", "surrogatepass")) for t in strings)
    if longest > limit:
        raise ModelFormatError(
            f"GGUF metadata '{key}' should hold entries of at most {limit} bytes, found one "
            f"of {longest}"
        )


def _str_seq(tokens: Any, key: str = "tokenizer.ggml.tokens") -> Sequence[str]:
    """An array of strings as an indexable sequence of str: a GGUF :class:`StringArray` (read
    from the mapped file on access) is kept as it is, a list of str is kept; anything else (a
    numeric array, a list with non-strings) is the wrong type for the key."""
    if _is_mapped_strings(tokens):
        return tokens
    if isinstance(tokens, list | tuple) and all(isinstance(t, str) for t in tokens):
        return list(tokens)
    if isinstance(tokens, np.ndarray):
        found = f"an array of {tokens.dtype}"
    elif isinstance(tokens, list | tuple):
        bad = next(t for t in tokens if not isinstance(t, str))
        found = f"a list holding {type(bad).__name__} {str(bad)[:40]!r}"
    else:
        found = type(tokens).__name__
    raise ModelFormatError(f"GGUF metadata '{key}' should be an array of strings, found {found}")


def _int_array(values: Any, key: str = "tokenizer.ggml.token_type") -> np.ndarray:
    """Token types as a 1-D integer array (a GGUF array is already one: a view of the file)."""
    return _num_array(values, key, "iu")


def _num_array(values: Any, key: str, kinds: str) -> np.ndarray:
    """A 1-D numeric metadata array whose dtype kind is in ``kinds`` (lists from a pack's JSON
    are converted); strings, nested or ragged lists are the wrong type for the key."""
    if isinstance(values, np.ndarray):
        a = values
    elif isinstance(values, list | tuple) and all(
        isinstance(v, int | float) and not isinstance(v, bool) for v in values
    ):
        a = np.asarray(values) if values else np.zeros(0, np.int64)
    else:
        a = None
    if a is None or a.ndim != 1 or a.dtype.kind not in kinds:
        found = f"an array of {a.dtype}" if a is not None else type(values).__name__
        want = "integers" if kinds == "iu" else "numbers"
        raise ModelFormatError(f"GGUF metadata '{key}' should be an array of {want}, found {found}")
    return a


def _meta_bool(meta: dict[str, Any], key: str) -> bool | None:
    """A boolean metadata field (GGUF bool), None when absent."""
    v = meta.get(key)
    if v is None or isinstance(v, bool | np.bool_):
        return None if v is None else bool(v)
    raise ModelFormatError(f"GGUF metadata {key!r} should be a bool, found {str(v)[:40]!r}")


def _meta_str(meta: dict[str, Any], key: str) -> str | None:
    """A string metadata field, None when absent."""
    v = meta.get(key)
    if v is None or isinstance(v, str):
        return v
    raise ModelFormatError(
        f"GGUF metadata {key!r} should be a string, found {type(v).__name__} {str(v)[:40]!r}"
    )


def _merges_and_types(
    meta: dict[str, Any], n_tokens: int, vocabulary: str
) -> tuple[Sequence[str], np.ndarray]:
    """A BPE vocabulary's merges (required, each of bounded length) and token types (one per
    token; absent: all normal); vocabulary names the kind in the error for missing merges."""
    merges = meta.get("tokenizer.ggml.merges")
    if merges is not None:
        merges = _str_seq(merges, "tokenizer.ggml.merges")
        _check_token_lengths(merges, "tokenizer.ggml.merges", 2 * MAX_TOKEN_BYTES + 1)
    if merges is None or not len(merges):
        raise ModelFormatError(
            f"GGUF metadata has no 'tokenizer.ggml.merges', which a {vocabulary} vocabulary needs"
        )
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        types = np.full(n_tokens, TOKEN_TYPE_NORMAL, dtype=np.int32)
    types = _int_array(types)
    _check_len("token_type", types, n_tokens)
    return merges, types


def _check_len(key: str, values: Any, n: int) -> None:
    if len(values) != n:
        raise ModelFormatError(
            f"GGUF metadata 'tokenizer.ggml.{key}' has {len(values)} entries but "
            f"'tokenizer.ggml.tokens' has {n}"
        )


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
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ModelFormatError(
            f"GGUF metadata {key!r} should be an integer, found {type(value).__name__} "
            f"{str(value)[:40]!r}"
        )
    return int(value)


class Tokenizer:
    """Text <-> token ids for one model. Subclasses implement :meth:`encode`.

    Attributes every tokenizer has: ``vocab_size``, ``bos_id``/``eos_id`` (``None`` when the model
    has none), ``eos_ids`` (eos plus end-of-turn tokens; generation stops on any of them),
    ``special_ids`` (control/unknown tokens; ``decode(skip_special=True)`` drops them),
    ``add_bos`` (the model's rule for prepending BOS), ``add_eos`` (its rule for appending EOS
    to a text it encodes whole, as embedding models ask; ``encode`` leaves it to the caller)
    and ``chat_template`` (or ``None``).
    """

    vocab_size: int
    bos_id: int | None
    eos_id: int | None
    eos_ids: frozenset[int]
    special_ids: frozenset[int]
    add_bos: bool
    add_eos: bool = False
    chat_template: str | None

    def __init__(self) -> None:
        self._token_bytes = _ByteTable()
        self._special_text: dict[str, int] = {}  # control-token string -> id
        self._special_re: re.Pattern[str] | None = None

    def warm(self) -> None:
        """Load any kernel encoding uses (the generator's warm-up calls this)."""

    def special_texts(self) -> dict[str, int]:
        """The control-token strings that ``encode(parse_special=True)`` turns into ids, each
        with its id (do not modify the dict)."""
        return self._special_text

    def special_pattern(self) -> re.Pattern[str] | None:
        """A regex finding those strings in text, leftmost-longest, as ``encode`` matches
        them (None when there are none)."""
        return self._special_re

    # -- encoding --------------------------------------------------------------------------------

    def _read_special_ids(
        self,
        meta: dict[str, Any],
        types: np.ndarray,
        end_of_turn_ids: dict[str, int | None],
        default_add_bos: bool,
    ) -> None:
        """bos, eos, unk and pad ids from the metadata (each inside the vocabulary of
        vocab_size tokens), then what _set_turn_and_special_ids sets; end_of_turn_ids: the
        vocabulary's id of each _END_OF_TURN_TEXTS string (None where it has none), an
        end of turn where that token is not a normal one."""
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

        extra_eos = [_id(k) for k in _EOT_KEYS]
        self._set_turn_and_special_ids(meta, types, extra_eos, end_of_turn, default_add_bos)

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
        add_bos = _meta_bool(meta, "tokenizer.ggml.add_bos_token")
        self.add_bos = add_bos if add_bos is not None else default_add_bos
        self.add_eos = bool(_meta_bool(meta, "tokenizer.ggml.add_eos_token"))
        template = _meta_str(meta, "tokenizer.chat_template")
        self.chat_template = template or None

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

    def _encode_text(self, text: str) -> list[int]:
        """Ids of text that holds no added token (the subclass's model)."""
        raise NotImplementedError

    def _encode_around(
        self, text: str, pattern: re.Pattern[str] | None, ids_of: dict[str, int]
    ) -> list[int]:
        """Ids of text whose strings that `pattern` finds (added tokens) are taken whole as
        ids_of gives them, the text between them through _encode_text."""
        if pattern is None:
            return self._encode_text(text)
        ids: list[int] = []
        pos = 0
        for m in pattern.finditer(text):
            ids += self._encode_text(text[pos : m.start()])
            ids.append(ids_of[m.group()])
            pos = m.end()
        ids += self._encode_text(text[pos:])
        return ids

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


# Streaming detokenization. Generation produces one token at a time, and a token's bytes may
# end mid-character (byte-level BPE, SentencePiece byte fallback): StreamDecoder holds such a
# tail back, using only the Tokenizer interface (token_bytes, special_ids, the leading-space
# rule), so it works with every tokenizer kind and gives the same text as Tokenizer.decode.
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
