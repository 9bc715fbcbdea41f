"""Byte-level BPE (``tokenizer.ggml.model = "gpt2"``): GPT-2, SmolLM, Qwen2, Llama 3, ...

Its own module because it is one whole way of tokenizing: the pre-tokenizer regexes that
``tokenizer.ggml.pre`` selects (llama.cpp's names mapped to the split each family uses), GPT-2's
byte alphabet, and :class:`BPETokenizer`, which splits text with the ``tokenizers`` library's
pre-tokenizers, merges each word with the GGUF merges (bpe_merges.py: ~26 MiB less than the
library's BPE model on Qwen2.5's vocabulary) and decodes through :class:`~.base.Tokenizer`.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np

from edgerun.errors import InvalidArgumentError, ModelFormatError, UnsupportedError
from edgerun.tokenizer.base import (
    _BYTE_TOKEN,
    _END_OF_TURN_TEXTS,
    TOKEN_TYPE_BYTE,
    TOKEN_TYPE_CONTROL,
    TOKEN_TYPE_NORMAL,
    TOKEN_TYPE_UNUSED,
    TOKEN_TYPE_USER_DEFINED,
    Tokenizer,
    _ByteTable,
    _literal_regex,
    _merges_and_types,
    _meta_str,
    _vocabulary,
)
from edgerun.tokenizer.bpe_merges import MergeTable

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

# Qwen3.5: as Qwen2, with combining marks (\p{M}) part of a word rather than of the
# punctuation runs (llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN35).
QWEN35_SPLIT = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+"
    r"|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Tekken (Mistral Nemo, Mistral Small 3): words split at lower-to-upper case changes, every
# digit alone, a run of punctuation takes trailing newlines and slashes. Written as llama.cpp
# writes it (llama-vocab.cpp): "upper" is any letter but a-z, "lower" any letter but A-Z, so a
# letter outside ASCII is both (tokenizer.json's \p{Lu}/\p{Ll} classes differ there, and
# llama.cpp is what GGUF files are made for).
_UPPERISH = r"(?:(?=\p{L})[^a-z])"
_LOWERISH = r"(?:(?=\p{L})[^A-Z])"
TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# GPT-4o (o200k; Llama 4): Tekken's case-aware words with an optional contraction after
# them, numbers in groups of up to three.
_CONTRACTION = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}*{_LOWERISH}+{_CONTRACTION}?"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPERISH}+{_LOWERISH}*{_CONTRACTION}?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizer:
    """How one kind of byte-level BPE vocabulary splits text into words before merging
    (llama.cpp's ``LLAMA_VOCAB_PRE_TYPE_*``).

    ``splits``: regexes applied in turn, each cutting every piece so far into its matches
    and the text between them (llama.cpp's ``regex_exprs``; the ``tokenizers`` library's
    ``Split(behavior="isolated")``). ``ignore_merges``: a word that is itself a vocabulary
    token is taken whole. ``add_bos``: whether BOS is prepended when the file has no
    ``tokenizer.ggml.add_bos_token``."""

    splits: tuple[str, ...]
    ignore_merges: bool = False
    add_bos: bool = False


_GPT2 = PreTokenizer((GPT2_SPLIT,))
# llama.cpp's split for "default" (and for a file without tokenizer.ggml.pre): runs of
# punctuation and ASCII symbols cut out first, then GPT-2's split, digits, ASCII digit triples.
_DEFAULT = PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", GPT2_SPLIT, r"\p{N}+", r"[0-9][0-9][0-9]"))
_DIGITS = PreTokenizer((r"\p{N}", GPT2_SPLIT))  # StarCoder: every digit isolated first
_QWEN2 = PreTokenizer((QWEN2_SPLIT,))
_QWEN35 = PreTokenizer((QWEN35_SPLIT,))
_LLAMA3 = PreTokenizer((LLAMA3_SPLIT,), ignore_merges=True, add_bos=True)
_LLAMA3_MERGED = PreTokenizer((LLAMA3_SPLIT,))  # Llama 3's split, every word merged
_GLM4 = PreTokenizer((LLAMA3_SPLIT,), ignore_merges=True)
_TEKKEN = PreTokenizer((TEKKEN_SPLIT,), ignore_merges=True, add_bos=True)
_GPT4O = PreTokenizer((GPT4O_SPLIT,))

# tokenizer.ggml.pre -> its pre-tokenizer: each name llama.cpp's converter writes
# (convert_hf_to_gguf.py get_vocab_base_pre) for a byte-level vocabulary of a text model
# edgerun can run, grouped as llama-vocab.cpp groups them.
PRE_TOKENIZERS: dict[str, PreTokenizer] = {
    "default": _DEFAULT,
    **dict.fromkeys(
        (
            "gpt2",  # edgerun's name for GPT-2's split before it took llama.cpp's ("gpt-2")
            "gpt-2",
            "phi-2",
            "mpt",
            "olmo",
            "jais",
            "exaone4",
            "trillion",
            "granite-docling",
            "gigachat",
            "a.x-4.0",
            "mellum",
        ),
        _GPT2,
    ),
    **dict.fromkeys(
        (
            "starcoder",
            "refact",
            "command-r",
            "smollm",
            "codeshell",
            "exaone",
            "minerva-7b",
            "mellum2",
        ),
        _DIGITS,
    ),
    **dict.fromkeys(
        (
            "qwen2",
            "deepseek-r1-qwen",
            "stablelm2",
            "megrez",
            "hunyuan",
            "solar-open",
            "kormo",
            "f2llmv2",
            "grok-2",
        ),
        _QWEN2,
    ),
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
        ),
        _LLAMA3,
    ),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe"), _LLAMA3_MERGED),
    **dict.fromkeys(("glm4", "glm5"), _GLM4),
    "tekken": _TEKKEN,
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}


def pre_tokenizer_for(pre: str) -> PreTokenizer:
    """The pre-tokenizer ``tokenizer.ggml.pre`` = ``pre`` names; UnsupportedError listing
    the known names for any other (a different split would give the model wrong input)."""
    found = PRE_TOKENIZERS.get(pre)
    if found is None:
        raise UnsupportedError(
            f"GGUF metadata 'tokenizer.ggml.pre' = {pre!r} names a pre-tokenizer edgerun does "
            f"not support (supported: {', '.join(sorted(PRE_TOKENIZERS))}); tokenizing with a "
            "different split would give the model wrong input"
        )
    return found


# Words of at most this many characters keep their ids in a cache of this many words
# (the library's BPE model caches 10,000); the cache is emptied when it is full.
_CACHED_WORD_CHARS = 64
_WORD_CACHE_SIZE = 10_000


class _WordIndex:
    """Which vocabulary token a word spells, if any (ignore_merges), from sorted hashes of
    the token strings (1.5 MiB for 128k tokens, where a dict of them costs ~15 MiB). A hash
    match is confirmed against the token's own string."""

    __slots__ = ("hashes", "ids")

    def __init__(self, vocab: dict[str, int]) -> None:
        hashes = np.fromiter((hash(t) for t in vocab), dtype=np.int64, count=len(vocab))
        ids = np.fromiter(vocab.values(), dtype=np.int32, count=len(vocab))
        order = np.argsort(hashes, kind="stable")
        self.hashes, self.ids = hashes[order], ids[order]

    def find(self, word: str, tokens: Sequence[str]) -> int | None:
        h = hash(word)
        i = int(np.searchsorted(self.hashes, h))
        while i < len(self.hashes) and self.hashes[i] == h:
            if tokens[int(self.ids[i])] == word:
                return int(self.ids[i])
            i += 1
        return None


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


class BPETokenizer(Tokenizer):
    """Byte-level BPE (``tokenizer.ggml.model = "gpt2"``): GPT-2, SmolLM, Qwen2, Llama 3, ...

    Built from ``tokenizer.ggml.tokens``, ``tokenizer.ggml.merges`` and
    ``tokenizer.ggml.token_type``. Control tokens (type 3) are registered as special added tokens
    and user-defined tokens (type 4) as plain added tokens, so both are matched whole in text, as
    llama.cpp and transformers do.
    """

    def __init__(self, meta: dict[str, Any]) -> None:
        super().__init__()
        from tokenizers import Regex as TkRegex
        from tokenizers import pre_tokenizers

        tokens = _vocabulary(meta)
        merges, types = _merges_and_types(
            meta, len(tokens), "byte-level BPE ('tokenizer.ggml.model' = 'gpt2')"
        )

        pre = _meta_str(meta, "tokenizer.ggml.pre") or "default"
        kind = pre_tokenizer_for(pre)
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
        control: list[tuple[str, int]] = []
        user: list[tuple[str, int]] = []

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
                    control.append((text, i))
                elif ttype == TOKEN_TYPE_USER_DEFINED:
                    user.append((text, i))
        self._token_bytes = _ByteTable(blob, offsets)
        del blob, offsets
        end_of_turn_ids = {t: vocab.get(t) for t in _END_OF_TURN_TEXTS}

        # The merges as ids (bpe_merges.MergeTable): merge j joins its two halves, both
        # vocabulary tokens, into the token they spell together.
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
        del left, right, joined
        # a word's first symbols: its characters, each a byte in GPT-2's alphabet (a
        # character the vocabulary lacks is dropped, as the library's BPE model does)
        self._char_ids = {c: vocab[c] for c in _byte_decoder() if c in vocab}
        # ignore_merges (Llama 3): a word that is itself a token is taken whole
        self._whole_words = _WordIndex(vocab) if kind.ignore_merges else None
        del vocab
        self._pre = pre_tokenizers.Sequence(
            [
                *(
                    pre_tokenizers.Split(TkRegex(r), behavior="isolated", invert=False)
                    for r in kind.splits
                ),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        # Added tokens are matched whole before the split, leftmost-longest: control tokens
        # (special; plain text when parse_special is false) and user-defined ones (always).
        self._special_text = dict(control)
        self._special_re = _literal_regex(self._special_text)
        self._added_ids = dict(control + user)
        self._added_re = _literal_regex(self._added_ids)
        self._user_re = _literal_regex(t for t, _ in user)
        self._word_cache: dict[str, list[int]] = {}

        # Special ids.
        self._read_special_ids(meta, types, end_of_turn_ids, kind.add_bos)

    def warm(self) -> None:
        """Load (or compile) the merge kernel. The generator's warm-up calls this: a
        budgeted run pages the compiler's libraries out once its kernels are loaded, and
        the first prompt must not fault them back in (offload/io.page_out_large_libraries).
        Not at construction: the runtime floor is measured before any kernel loads."""
        self._merges.merge(np.zeros(2, np.int32))

    def _encode(self, texts: list[str], parse_special: bool) -> list[list[int]]:
        return [self._encode_one(t, parse_special) for t in texts]

    def _encode_one(self, text: str, parse_special: bool) -> list[int]:
        """Added tokens matched whole, the rest split (pre-tokenized) into words, each
        word BPE-merged; with parse_special=False control-token strings are plain text."""
        pattern = self._added_re if parse_special else self._user_re
        return self._encode_around(text, pattern, self._added_ids)

    def _encode_text(self, text: str) -> list[int]:
        if not text:
            return []
        ids: list[int] = []
        cache = self._word_cache
        for word, _ in self._pre.pre_tokenize_str(text):
            got = cache.get(word)
            if got is None:
                got = self._encode_word(word)
                if len(word) <= _CACHED_WORD_CHARS:
                    if len(cache) >= _WORD_CACHE_SIZE:
                        cache.clear()
                    cache[word] = got
            ids += got
        return ids

    def _encode_word(self, word: str) -> list[int]:
        if self._whole_words is not None:
            i = self._whole_words.find(word, self._tokens)
            if i is not None:
                return [i]
        chars = self._char_ids
        first = np.array([chars[c] for c in word if c in chars], dtype=np.int32)
        return self._merges.merge(first).tolist()

    def encode(
        self, text: str, add_bos: bool | None = None, parse_special: bool = True
    ) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError(f"encode() takes a str, got {type(text).__name__}")
        ids = self._encode([text], parse_special)[0] if text else []
        return self._with_bos(ids, add_bos)

    def encode_batch(
        self, texts: Sequence[str], add_bos: bool | None = None, parse_special: bool = True
    ) -> list[list[int]]:
        texts = list(texts)
        out = self._encode(texts, parse_special) if texts else []
        return [self._with_bos(ids, add_bos) for ids in out]

    def id_to_token(self, id: int) -> str:
        """The token as the vocabulary spells it (byte-level alphabet for normal tokens)."""
        self.token_bytes(id)  # range check
        return self._tokens[id]
