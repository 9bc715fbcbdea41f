"""Gemma 4's BPE (``tokenizer.ggml.model = "gemma4"``): SentencePiece-style pieces merged by
BPE ranks.

Its own module because it is neither byte-level BPE nor SentencePiece: the vocabulary spells
spaces as "▁" and everything else as raw UTF-8 (no GPT-2 byte alphabet), merges come from
``tokenizer.ggml.merges`` (the Hugging Face tokenizer.json's BPE model), text is never split
into words but for newlines (llama.cpp's GEMMA4 pre-type: runs of newlines apart from the
rest), and a character the vocabulary lacks falls back to its UTF-8 bytes as ``<0xNN>``
tokens (tokenizer.json's ``byte_fallback``). The merge loop is bpe_merges.MergeTable's.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from edgerun.errors import InvalidArgumentError, ModelFormatError
from edgerun.tokenizer.base import (
    _BYTE_TOKEN,
    _END_OF_TURN_TEXTS,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_USER_DEFINED,
    Tokenizer,
    _ByteTable,
    _literal_regex,
    _merges_and_types,
    _vocabulary,
)
from edgerun.tokenizer.bpe_merges import MergeTable

__all__ = ["Gemma4Tokenizer"]

_SPACE = "\u2581"  # "▁"
_SPLIT = re.compile(r"[^\n]+|\n+")  # llama.cpp's GEMMA4 regex: newline runs apart


class Gemma4Tokenizer(Tokenizer):
    """``tokenizer.ggml.model = "gemma4"``: BPE over "▁"-escaped UTF-8 with byte fallback.

    Control tokens are matched whole (with ``parse_special``), user-defined ones always, as
    in the other tokenizers; BOS is prepended by default (llama.cpp forces add_bos for
    Gemma 4 files)."""

    def __init__(self, meta: dict[str, Any]) -> None:
        super().__init__()
        tokens = _vocabulary(meta)
        merges, types = _merges_and_types(
            meta, len(tokens), "Gemma 4 BPE ('tokenizer.ggml.model' = 'gemma4')"
        )
        self.vocab_size = len(tokens)
        self.token_types = types
        self._tokens = tokens

        vocab: dict[str, int] = {}
        control: list[tuple[str, int]] = []
        user: list[tuple[str, int]] = []
        byte_ids = np.full(256, -1, np.int32)
        blob = bytearray()
        offsets = array("q", [0])
        for i, (text, ttype) in enumerate(zip(tokens, types.tolist())):
            if ttype == TOKEN_TYPE_BYTE and (m := _BYTE_TOKEN.match(text)):
                b = int(m.group(1), 16)
                blob.append(b)
                if byte_ids[b] < 0:
                    byte_ids[b] = i
            elif ttype in (TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED):
                blob += text.encode("utf-8")
            else:
                blob += text.replace(_SPACE, " ").encode("utf-8")
            offsets.append(len(blob))
            if vocab.setdefault(text, i) == i and text:
                if ttype == TOKEN_TYPE_CONTROL:
                    control.append((text, i))
                elif ttype == TOKEN_TYPE_USER_DEFINED:
                    user.append((text, i))
        self._token_bytes = _ByteTable(blob, offsets)
        del blob, offsets
        self._byte_ids = byte_ids

        left = np.empty(len(merges), np.int32)
        right = np.empty(len(merges), np.int32)
        joined = np.empty(len(merges), np.int32)
        for j, m in enumerate(merges):
            a, sep, b = m.partition(" ")
            ia, ib, iab = vocab.get(a), vocab.get(b), vocab.get(a + b)
            if not sep or ia is None or ib is None or iab is None:
                what = "is not 'left right'" if not sep else "names a token not in the vocabulary"
                raise ModelFormatError(
                    f"GGUF metadata 'tokenizer.ggml.merges' entry #{j} {m[:80]!r} {what} "
                    "(expected two vocabulary tokens whose join is one too)"
                )
            left[j], right[j], joined[j] = ia, ib, iab
        self._merges = MergeTable(left, right, joined)
        # a piece's first symbols: its characters that are tokens (the rest fall back to bytes)
        self._char_ids = {t: i for t, i in vocab.items() if len(t) == 1}
        self._newlines = {t: i for t, i in vocab.items() if t and not t.strip("\n")}
        self._special_text = dict(control)
        self._special_re = _literal_regex(self._special_text)
        self._added_ids = dict(control + user)
        self._added_re = _literal_regex(self._added_ids)
        self._user_re = _literal_regex(t for t, _ in user)
        end_of_turn_ids = {t: vocab.get(t) for t in _END_OF_TURN_TEXTS}
        del vocab

        self._read_special_ids(meta, types, end_of_turn_ids, True)
        self.add_bos = True  # as llama.cpp: Gemma 4 always starts with BOS

    def warm(self) -> None:
        self._merges.merge(np.zeros(2, np.int32))

    def _encode_text(self, text: str) -> list[int]:
        if not text:
            return []
        ids: list[int] = []
        for piece in _SPLIT.findall(text.replace(" ", _SPACE)):
            whole = self._newlines.get(piece)
            if whole is not None:
                ids.append(whole)
                continue
            ids += self._encode_piece(piece)
        return ids

    def _encode_piece(self, piece: str) -> list[int]:
        """BPE over the piece's characters; a run of characters the vocabulary lacks
        becomes their UTF-8 bytes (byte fallback), which no merge joins."""
        ids: list[int] = []
        run: list[int] = []
        for c in piece:
            i = self._char_ids.get(c)
            if i is not None:
                run.append(i)
                continue
            if run:
                ids += self._merges.merge(np.array(run, np.int32)).tolist()
                run = []
            for b in c.encode("utf-8"):
                fb = int(self._byte_ids[b])
                if fb >= 0:
                    ids.append(fb)
                elif self.unk_id is not None:
                    ids.append(self.unk_id)
        if run:
            ids += self._merges.merge(np.array(run, np.int32)).tolist()
        return ids

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode() takes a str, got {type(text).__name__}")
        pattern = self._added_re if parse_special else self._user_re
        ids = self._encode_around(text, pattern, self._added_ids) if text else []
        return self._with_bos(ids, add_bos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool | None = None, parse_special: bool = True
    ) -> list[list[int]]:
        return [self.encode(t, add_bos, parse_special) for t in texts]

    def id_to_token(self, id: int) -> str:
        """The token as the vocabulary spells it ("▁" for spaces)."""
        self.token_bytes(id)  # range check
        return self._tokens[id]
