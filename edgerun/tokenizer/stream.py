"""Streaming detokenization: token ids in, text out as soon as each character is complete.

Generation produces one token at a time, and a token's bytes may end mid-character (byte-level
BPE, SentencePiece byte fallback). :class:`StreamDecoder` holds such a tail back, using only the
:class:`~.base.Tokenizer` interface (``token_bytes``, ``special_ids``, the leading-space rule),
so it works with every tokenizer kind and gives the same text as :meth:`Tokenizer.decode`.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from edgerun.tokenizer.base import Tokenizer

__all__ = ["StreamDecoder"]


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
