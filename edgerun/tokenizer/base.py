"""The interface every tokenizer implements, and the pieces the concrete ones share.

:class:`Tokenizer` holds what does not depend on the vocabulary's kind: the attributes
(``vocab_size``, ``bos_id``/``eos_id``/``eos_ids``, ``special_ids``, ``add_bos``,
``chat_template``), BOS handling, and decoding from a per-token byte table (:class:`_ByteTable`:
one ``bytes`` blob plus offsets, so nothing the size of the vocabulary is kept as Python objects
per token). Also here: llama.cpp's token-type numbers, the end-of-turn token texts, and the small
GGUF-metadata helpers (:func:`_str_seq`, :func:`_int_array`, :func:`_check_len`, :func:`_as_int`)
that both :mod:`.bpe` and :mod:`.sentencepiece` use. This module imports nothing else from the
package (``stream_decoder`` imports :mod:`.stream` when called).
"""

from __future__ import annotations

import operator
import re
from array import array
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from edgerun.errors import InvalidArgumentError, ModelFormatError

if TYPE_CHECKING:
    from edgerun.tokenizer.stream import StreamDecoder

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


def _vocabulary(meta: dict[str, Any]) -> Sequence[str]:
    """`tokenizer.ggml.tokens` as a sequence of str; a clear error when it is missing."""
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is None or not len(tokens):
        raise ModelFormatError(
            "GGUF metadata has no 'tokenizer.ggml.tokens'; the file carries no vocabulary"
        )
    return _str_seq(tokens)


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
        from edgerun.tokenizer.stream import StreamDecoder

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
